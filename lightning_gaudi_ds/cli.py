"""``lightning-gaudi-ds`` console script (also ``python -m lightning_gaudi_ds``).

Every sub-command is declared in :data:`COMMANDS`: its help line and the module that owns it, which exposes
``add_arguments(parser)``, ``run(args) -> int`` and optionally ``prepare_args(argv) -> argv``. That module is
imported only when its sub-command is parsed, so ``lightning-gaudi-ds --help`` and ``lightning-gaudi-ds spawn --help``
import neither torch nor DeepSpeed. Adding a sub-command is one entry.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple


class Command(NamedTuple):
    module: str
    help: str


COMMANDS: dict[str, Command] = {
    "spawn": Command("lightning_gaudi_ds.launch.runner",
                     "launch a training script on N ranks (torchrun, DeepSpeed or MPI)"),
    "convert": Command("lightning_gaudi_ds.checkpoint.command",
                       "convert a sharded ZeRO checkpoint to one fp32 file or a Hugging Face model directory"),
    "env": Command("lightning_gaudi_ds.report",
                   "print device, versions, built DeepSpeed ops and stale build locks"),
    "fabric": Command("lightning_gaudi_ds.fabric_cli",
                      "Lightning's `fabric run`, knowing the hpu accelerator and every hpu_deepspeed* strategy"),
    "plan": Command("lightning_gaudi_ds.planning.command",
                    "predicted memory per rank for ZeRO stages 0-3 and offload"),
}


class _SubcommandParser(argparse.ArgumentParser):
    """A sub-command's parser that imports its module and declares its arguments only when first used."""

    def __init__(self, *args: Any, module: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._module_name: str | None = module or None
        self._prepare: Callable[[list[str]], list[str]] | None = None  # the module's prepare_args, if any

    def _declare(self) -> None:
        if self._module_name is not None:
            module = importlib.import_module(self._module_name)
            self._module_name = None
            module.add_arguments(self)
            self.set_defaults(_run=module.run)
            self._prepare = getattr(module, "prepare_args", None)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._declare()
        if args is not None and self._prepare is not None:  # e.g. negative numbers as values (plan)
            args = self._prepare(list(args))
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._declare()
        return super().format_help()

    def format_usage(self) -> str:
        self._declare()
        return super().format_usage()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-gaudi-ds", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}",
                                parser_class=_SubcommandParser)
    for name, command in COMMANDS.items():
        sub.add_parser(name, help=command.help, description=command.help, module=command.module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
