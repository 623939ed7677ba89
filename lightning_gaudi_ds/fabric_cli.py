"""``lightning-gaudi-ds fabric run``: Lightning's ``fabric run``, knowing the ``"hpu"`` accelerator and every
``hpu_deepspeed*`` strategy.

Lightning's ``fabric run`` (``lightning/fabric/cli.py``) takes its ``--strategy`` choices from Fabric's registry
when it is imported, less the offload names, and its ``--accelerator`` choices from a fixed list without ``"hpu"``;
each rank then builds ``Fabric()`` from the ``LT_*`` variables it sets, before the script (a LitGPT script, say)
has imported this package, if it ever does. This is Lightning's own command (its options, parsing, checks and
torchrun launch) with those two choices widened, ``--devices`` counted for HPUs, and each rank started as
``python -m lightning_gaudi_ds.fabric_cli SCRIPT ARGS``, which registers this package with Fabric and then runs
the script as ``python SCRIPT ARGS`` does.

    lightning-gaudi-ds fabric run --accelerator hpu --devices 8 --strategy hpu_deepspeed_stage_3 \\
        --precision bf16-mixed train.py --lr 3e-4
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from typing import Any

RANK_MODULE = "lightning_gaudi_ds.fabric_cli"
_PROG = "lightning-gaudi-ds fabric"


# ------------------------------------------------------------------------------- the CLI's process
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``fabric``: everything after it goes to the click group (:func:`fabric_group`)."""
    parser.add_argument("fabric_argv", nargs=argparse.REMAINDER, metavar="run ...",
                        help=f"Lightning's `fabric run` options, the script and its arguments (`{_PROG} run --help`)")


def prepare_args(argv: list[str]) -> list[str]:
    return ["--", *argv]  # --help included: click answers it


def run(args: argparse.Namespace) -> int:
    argv = list(args.fabric_argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    try:
        fabric_group().main(args=argv, prog_name=_PROG, standalone_mode=True)
    except SystemExit as exit:  # click ends every call so: 0, 2 for bad usage, or a rank's exit code
        return exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    return 0


def strategy_names() -> list[str]:
    """The names ``--strategy`` accepts beyond Lightning's: every ``hpu_deepspeed*`` name, offload ones included
    (each is complete as registered)."""
    from lightning_gaudi_ds.core.base import REGISTERED

    return [name for name, _, _ in REGISTERED]


def fabric_group() -> Any:
    """A click group whose ``run`` is a copy of Lightning's ``fabric run`` command (Lightning's own stays as it is)
    with ``--accelerator hpu`` and :func:`strategy_names` accepted and the ranks started through this module."""
    import copy

    from lightning_gaudi_ds._compat import fabric_run_command

    lightning_run = fabric_run_command()
    if lightning_run is None:
        raise SystemExit(f"`{_PROG} run` is Lightning's `fabric run`, which needs click: pip install click")
    import click

    command = copy.copy(lightning_run)
    command.params = [copy.copy(param) for param in lightning_run.params]
    for param in command.params:
        extra = {"accelerator": ["hpu"], "strategy": strategy_names()}.get(param.name or "")
        if extra is not None and isinstance(param.type, click.Choice):
            choices = list(param.type.choices)
            param.type = click.Choice([*choices, *(name for name in extra if name not in choices)])
    command.callback = _launch
    return click.Group("fabric", commands={"run": command},
                       help="Lightning Fabric's CLI, knowing lightning_gaudi_ds's accelerator and strategies.")


def hpu_processes(devices: str) -> int:
    """``--devices`` for ``--accelerator hpu``: a count (processes per node), or ``auto``/``-1`` for every HPU."""
    import click

    from lightning_gaudi_ds import hpu

    if devices in ("auto", "-1"):
        count = hpu.device_count() if hpu.hpu_available() else 0
        if count < 1:
            raise click.BadParameter(
                f"{devices!r} counts the Gaudi devices of this machine, and none is visible (habana_frameworks"
                " missing or no device): pass the number of HPUs per node, such as --devices 8.",
                param_hint="'--devices'")
        return count
    if not devices.isdigit() or int(devices) < 1:
        raise click.BadParameter(
            f"{devices!r} with --accelerator hpu: HPUs are counted, not chosen by index; pass --devices N (N >= 1)"
            " or auto. To run on given Gaudi modules, set HABANA_VISIBLE_MODULES=0,1 and pass --devices 2.",
            param_hint="'--devices'")
    return int(devices)


def _launch(**options: Any) -> None:
    # Lightning's command body on `python -m lightning_gaudi_ds.fabric_cli SCRIPT ARGS`; the LT_* variables it
    # exports are for the ranks: this process's environment is put back afterwards.
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from lightning_gaudi_ds._compat import fabric_run_module

    script_args = list(options.pop("script_args", ()))
    if options.get("accelerator") == "hpu":
        options["devices"] = str(hpu_processes(str(options["devices"])))
    environ = dict(os.environ)
    try:
        fabric_run_module(options, [RANK_MODULE, options["script"], *script_args])
    except ChildFailedError as error:  # torchrun's summary of the failed ranks, then the first one's exit code
        print(error.format_msg(), file=sys.stderr)
        code = error.get_first_failure()[1].exitcode
        raise SystemExit(128 - code if code < 0 else code or 1) from None
    finally:
        os.environ.clear()
        os.environ.update(environ)


# ------------------------------------------------------------------------------------- each rank
def run_script(argv: list[str]) -> None:
    """``python -m lightning_gaudi_ds.fabric_cli SCRIPT ARGS``: register the ``"hpu"`` accelerator and the
    ``hpu_deepspeed*`` names with Fabric, then run ``SCRIPT`` as ``__main__`` with ``sys.argv`` and ``sys.path[0]``
    as ``python SCRIPT ARGS`` sets them."""
    if not argv:
        raise SystemExit(f"usage: python -m {RANK_MODULE} SCRIPT [ARGS...]")
    import lightning_gaudi_ds.accelerator
    import lightning_gaudi_ds.fabric  # noqa: F401

    script = argv[0]
    sys.argv = list(argv)
    if not getattr(sys.flags, "safe_path", False):  # `python -m` put the working directory there
        sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    run_script(sys.argv[1:])
