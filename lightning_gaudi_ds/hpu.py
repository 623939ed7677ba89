"""Everything asked of the Intel Gaudi software stack, in one place.

``habana_frameworks`` (and torch) are imported inside the functions that need them, so this module imports on
any machine, and the launcher can use it without importing torch. Tests replace ``habana_frameworks`` with a
double (``tests/hpu_double.py``) that behaves like the real import: the execution mode is fixed at the first
import, hccl's module-level set-up rewrites the rank variables, and DeepSpeed finds the HPU accelerator by itself.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args

from lightning_gaudi_ds.errors import InvalidArgumentError, SetupError

log = logging.getLogger(__name__)

Mode = Literal["eager", "lazy"]
MODES: tuple[Mode, ...] = get_args(Mode)  #: the one list every ``hpu_mode`` check uses
LAZY_MODE_ENV = "PT_HPU_LAZY_MODE"

# The values Habana's integrations use, exported where unset to the ranks a launcher starts (ours, and Lightning's
# through the strategy): the bridge and DeepSpeed see them from the process's start. Never written into the user's
# own process for its life: by the time the strategy runs the bridge is imported, DeepSpeed's HPU accelerator sets
# the two PT_HPU_* ones itself when it is created, and DEEPSPEED_USE_HPU is set around engine creation only
# (optimum-habana sets it just before deepspeed.initialize).
ENV_DEFAULTS: Mapping[str, str] = {
    "DEEPSPEED_USE_HPU": "true",
    "PT_HPU_LAZY_ACC_PAR_MODE": "0",
    "PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES": "0",
}

MISSING_STACK = (
    "`Trainer(accelerator='hpu')` needs the Intel Gaudi software stack: the Python package"
    " `habana_frameworks.torch` is not installed in this environment. Run inside Habana's PyTorch container"
    " (or install the Gaudi software stack), or choose `accelerator='cpu'`, `'cuda'` or `'auto'`."
)


# ------------------------------------------------------------------------------------------- the stack
def habana_frameworks_installed() -> bool:
    """Whether the Gaudi software stack can be imported (without importing it)."""
    if "habana_frameworks.torch" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("habana_frameworks.torch") is not None
    except (ModuleNotFoundError, ValueError):  # ValueError: a module in sys.modules without __spec__
        return False


def hpu_available() -> bool:
    """Whether at least one Gaudi device is usable from this process."""
    if not habana_frameworks_installed():
        return False
    try:
        import habana_frameworks.torch.hpu as hthpu

        return bool(hthpu.is_available())
    except Exception as err:  # a broken install must not break CPU users
        log.debug("habana_frameworks is installed but unusable: %s", err)
        return False


def require_stack() -> None:
    """Raise a clear error when the Gaudi stack is missing or sees no device."""
    if not habana_frameworks_installed():
        raise SetupError(MISSING_STACK)
    import habana_frameworks.torch.hpu as hthpu

    if not hthpu.is_available():
        raise SetupError(
            "`Trainer(accelerator='hpu')`: habana_frameworks is installed but no Gaudi device is visible"
            " (habana_frameworks.torch.hpu.is_available() is False). Check `hl-smi` and HABANA_VISIBLE_MODULES,"
            " or choose `accelerator='cpu'` or `'cuda'`."
        )


def device_count() -> int:
    import habana_frameworks.torch.hpu as hthpu

    return int(hthpu.device_count())


def total_memory(index: int = 0) -> int:
    """Bytes of memory of HPU ``index``: the runtime's ``Limit``, what its allocator may use."""
    import habana_frameworks.torch.hpu as hthpu

    return int(hthpu.memory_stats(index)["Limit"])


def device_name() -> str:
    """``"GAUDI"`` (first generation), ``"GAUDI2"``, ``"GAUDI3"``, ...; empty without a device."""
    import habana_frameworks.torch.hpu as hthpu

    return str(hthpu.get_device_name())


def fp16_supported() -> bool:
    """Whether the card computes in float16: first-generation Gaudi does not (bf16 only)."""
    return device_name() != "GAUDI"


def stack_version() -> str | None:
    """The installed Gaudi PyTorch bridge's version, or None when unknown."""
    try:
        from habana_frameworks.torch import __version__

        return str(__version__)
    except ImportError:
        return None


# -------------------------------------------------------------------------------------- execution mode
# habana_frameworks loads its lazy or its eager plugin at the first import of `habana_frameworks.torch` (torch's
# device autoload may do that at `import torch`), from PT_HPU_LAZY_MODE; unset means eager in current releases
# ("0" = eager + torch.compile, the default path; "1" = lazy, graphs cut by mark_step, a legacy fallback). Once
# imported, the mode cannot change, so the launcher sets the variable before the ranks start; in the user's own
# process the strategy finds the stack imported already (the accelerator's availability check imports it).
def mode_from_env(environ: Mapping[str, str] = os.environ) -> Mode:
    """The mode ``habana_frameworks`` chooses when it is first imported with ``environ``."""
    return "lazy" if environ.get(LAZY_MODE_ENV, "0") not in ("", "0") else "eager"


def mode_env(mode: Mode) -> dict[str, str]:
    """The environment that makes ranks import ``habana_frameworks`` in ``mode``."""
    return {LAZY_MODE_ENV: "1" if mode == "lazy" else "0"}


def imported_mode() -> Mode | None:
    """The mode ``habana_frameworks`` was imported with, or None when this process has not imported it."""
    if "habana_frameworks.torch" not in sys.modules:
        return None
    # Current releases cache the answer at the first call, which the import makes: the mode actually loaded.
    from habana_frameworks.torch.utils.internal import is_lazy

    return "lazy" if is_lazy() else "eager"


def check_mode_name(value: object, where: str, error: type[Exception]) -> None:
    """The one check of a requested mode's name (the strategy's ``hpu_mode``, ``spawn --hpu_mode``,
    :func:`check_mode`): ``error`` (the caller's member of the error family) unless ``value`` is None or a mode;
    ``where`` names the argument, ``{}`` standing for the value (``"hpu_mode={}"``)."""
    if value not in (None, *MODES):
        raise error(f"{where.format(repr(value))} is not a Gaudi execution mode. Use 'eager' (with torch.compile,"
                    " Habana's default) or 'lazy' (the legacy mark_step mode), or leave it unset to use"
                    " PT_HPU_LAZY_MODE (unset: eager).")


def check_mode(requested: Mode | None) -> Mode:
    """The mode this process runs in; refuses ``requested`` when ``habana_frameworks`` was imported in the other.

    When the stack is installed but not imported yet, it is imported now with ``PT_HPU_LAZY_MODE`` set to the mode
    for that import only, which fixes the mode for the process. ``os.environ`` is left as it was: ranks started
    from here get the mode from their launcher (:func:`rank_env`).
    """
    check_mode_name(requested, "hpu_mode={}", InvalidArgumentError)
    current = imported_mode()
    wanted: Mode = requested or current or mode_from_env()
    if current is not None and current != wanted:
        raise SetupError(
            f"HPU execution mode {wanted!r} was requested, but habana_frameworks was already imported in {current!r}"
            f" mode ({LAZY_MODE_ENV}={os.environ.get(LAZY_MODE_ENV, '<unset>')} at import), and the mode cannot"
            " change afterwards. Start Python with"
            f" `{LAZY_MODE_ENV}={mode_env(wanted)[LAZY_MODE_ENV]}` (the `lightning-gaudi-ds spawn --hpu_mode"
            f" {wanted}` launcher sets it), or drop hpu_mode={requested!r} to run in {current!r} mode."
        )
    if current is None and habana_frameworks_installed():
        from lightning_gaudi_ds._environ import scoped_environ

        with scoped_environ(mode_env(wanted), override=True):  # the bridge reads it at its first import only
            import habana_frameworks.torch  # noqa: F401
    return wanted


def rank_env(mode: Mode, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What a launcher adds to ``environ`` for the Gaudi ranks it starts: :data:`ENV_DEFAULTS` where unset, and
    the execution mode spelled out (each rank's bridge picks it at import)."""
    return {**{key: value for key, value in ENV_DEFAULTS.items() if key not in environ}, **mode_env(mode)}


def describe_mode(mode: Mode, compile_backend: str | None) -> str:
    """One line for the logs: the execution mode and how graphs are built."""
    if mode == "lazy":
        return "HPU execution mode: lazy (PT_HPU_LAZY_MODE=1; graphs cut by mark_step, a legacy fallback)"
    how = f"engine compiled with torch.compile(backend={compile_backend!r})" if compile_backend else "not compiled"
    return f"HPU execution mode: eager (PT_HPU_LAZY_MODE=0; {how})"


def mark_step_fn(mode: Mode | None = None) -> Callable[[], None] | None:
    """``htcore.mark_step`` in lazy mode (by default the mode this process imported), else ``None``: eager mode
    has no graphs to cut."""
    if (mode or imported_mode() or mode_from_env()) != "lazy":
        return None
    import habana_frameworks.torch.core as htcore

    return htcore.mark_step


# -------------------------------------------------------------------------------------- process set-up
def init_distributed(world_size: int, global_rank: int, local_rank: int) -> None:
    """Register the ``hccl`` backend with torch.distributed and prepare HCCL for this rank."""
    import habana_frameworks.torch.distributed.hccl as hccl  # the import registers the backend

    hccl.initialize_distributed_hpu(world_size=world_size, rank=global_rank, local_rank=local_rank)


def disable_uninitialized_memory_fill() -> None:
    """Stop torch filling new tensors with NaN in deterministic mode.

    Upstream DeepSpeed's HPU accelerator does this as a workaround (the fill breaks the bridge's memory mapping);
    the Gaudi fork does not, and both turn deterministic mode on.
    """
    import torch  # here: the launcher imports this module without torch

    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]


# -------------------------------------------------------------------------------------- optimizers
def is_habana_fused_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one of ``habana_frameworks.torch.hpex.optimizers`` (FusedAdamW, FusedSGD, ...)."""
    module = type(optimizer).__module__ or ""
    return module.startswith("habana_frameworks.torch.hpex.optimizers")


def fused_optimizer_problem(optimizer: Any, offloads_optimizer: bool) -> str | None:
    """Why DeepSpeed cannot train with ``optimizer``, or None when it can.

    A Habana fused optimizer runs HPU kernels on HPU tensors. As DeepSpeed's client optimizer on the card it works
    (optimum-habana passes FusedAdamW this way). ZeRO-Offload keeps the optimizer states on the CPU and steps them
    there, where no HPU kernel can run.
    """
    if not is_habana_fused_optimizer(optimizer) or not offloads_optimizer:
        return None
    return (
        f"configure_optimizers returned Habana's {type(optimizer).__qualname__}, whose HPU kernels cannot step"
        " optimizer states that ZeRO-Offload keeps on the CPU. Return torch.optim.AdamW (it becomes"
        " DeepSpeedCPUAdam under offload), or turn off offload_optimizer to keep the fused optimizer on the card."
    )


def wrap_in_hpu_graph(module: Any) -> Any:
    """Record ``module``'s forward as an HPU graph and replay it on later calls (Gaudi's ``enable_cuda_graph``).

    Lazy mode only, as Habana's DeepSpeed fork does (``HPU_Accelerator.wrap_in_hpu_graph``): HPU graphs capture
    lazy-mode graphs, and in eager mode the module is returned as it is, with a warning.
    """
    import habana_frameworks.torch.hpu as hthpu

    if imported_mode() != "lazy":
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        rank_zero_warn("enable_cuda_graph=True on Gaudi records HPU graphs, which need lazy mode"
                       " (PT_HPU_LAZY_MODE=1, HPUDeepSpeedStrategy(hpu_mode='lazy')); in eager mode the model runs"
                       " without them.")
        return module
    return hthpu.wrap_in_hpu_graph(module)
