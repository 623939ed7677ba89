"""``lightning-gaudi-ds`` console script (also ``python -m lightning_gaudi_ds``).

Subcommands live in the module that owns them; each exposes ``add_arguments(parser)`` and ``run(args) -> int``:
``spawn`` (lightning_gaudi_ds.launch), ``convert`` (lightning_gaudi_ds.checkpoint), ``env``
(lightning_gaudi_ds.report).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

SUBCOMMANDS = {
    "spawn": ("lightning_gaudi_ds.launch", "launch a training script on N ranks (torchrun, DeepSpeed or MPI)"),
    "convert": ("lightning_gaudi_ds.checkpoint", "convert a sharded ZeRO checkpoint to one fp32 state-dict file"),
    "env": ("lightning_gaudi_ds.report", "print device, versions, built DeepSpeed ops and stale build locks"),
    "plan": ("lightning_gaudi_ds.planning.command", "predicted memory per rank for ZeRO stages 0-3 and offload"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-gaudi-ds", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name != module_name:
                raise
            continue  # a subcommand whose module is not part of this build (yet): the others still work
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
        sub.choices[name].set_defaults(_module=module)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
