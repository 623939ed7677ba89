"""Everything the strategy asks of the Intel Gaudi software stack, in one place.

``habana_frameworks`` is imported inside each function, never at module level, so this module imports on
any machine. Tests replace ``habana_frameworks`` with a double and assert the calls made here.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional

import torch

from lightning_gaudi_ds.devices import DEVICES, apply_env_defaults, habana_frameworks_installed

log = logging.getLogger(__name__)

MISSING_STACK = (
    "`Trainer(accelerator='hpu')` needs the Intel Gaudi software stack: the Python package"
    " `habana_frameworks.torch` is not installed in this environment. Run inside Habana's PyTorch container"
    " (or install the Gaudi software stack), or choose `accelerator='cpu'`, `'cuda'` or `'auto'`."
)


def require_stack() -> None:
    """Raise a clear error when the Gaudi stack is missing or sees no device."""
    if not habana_frameworks_installed():
        raise RuntimeError(MISSING_STACK)
    import habana_frameworks.torch.hpu as hthpu

    if not hthpu.is_available():
        raise RuntimeError(
            "`Trainer(accelerator='hpu')`: habana_frameworks is installed but no Gaudi device is visible"
            " (habana_frameworks.torch.hpu.is_available() is False). Check `hl-smi` and HABANA_VISIBLE_MODULES,"
            " or choose `accelerator='cpu'` or `'cuda'`."
        )


def device_count() -> int:
    import habana_frameworks.torch.hpu as hthpu

    return int(hthpu.device_count())


def is_lazy() -> bool:
    """Lazy mode (graphs ended by ``mark_step``) unless ``PT_HPU_LAZY_MODE=0`` selects eager mode."""
    try:
        import habana_frameworks.torch.core as htcore

        if hasattr(htcore, "is_lazy"):
            return bool(htcore.is_lazy())
    except ImportError:
        pass
    return os.environ.get("PT_HPU_LAZY_MODE", "1") != "0"


def mark_step_fn() -> Optional[Callable[[], None]]:
    """``htcore.mark_step`` in lazy mode, else ``None`` (eager mode needs no graph breaks)."""
    if not is_lazy():
        return None
    import habana_frameworks.torch.core as htcore

    return htcore.mark_step


def prepare_environment() -> dict[str, str]:
    """Set the HPU environment defaults where unset (logged); return what was set."""
    return apply_env_defaults(DEVICES["hpu"])


def init_distributed(world_size: int, global_rank: int, local_rank: int) -> None:
    """Register the ``hccl`` backend with torch.distributed and prepare HCCL for this rank."""
    import habana_frameworks.torch.distributed.hccl as hccl  # the import registers the backend

    if hasattr(hccl, "initialize_distributed_hpu"):
        hccl.initialize_distributed_hpu(world_size=world_size, rank=global_rank, local_rank=local_rank)


def is_fused_adam(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one of Habana's fused optimizers (incompatible with DeepSpeed)."""
    module = type(optimizer).__module__ or ""
    return module.startswith("habana_frameworks") and "fused" in type(optimizer).__name__.lower()


def warn_if_deterministic_forced(before: bool) -> None:
    """DeepSpeed's HPU accelerator calls ``torch.use_deterministic_algorithms(True)``; tell the user."""
    if not before and torch.are_deterministic_algorithms_enabled():
        log.warning(
            "DeepSpeed's HPU accelerator turned on torch.use_deterministic_algorithms(True) for this process."
            " Some operators run slower or raise in deterministic mode; call"
            " torch.use_deterministic_algorithms(False) in your LightningModule's setup() to undo it."
        )
