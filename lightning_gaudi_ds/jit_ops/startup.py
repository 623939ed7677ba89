"""What every rank does with DeepSpeed's JIT ops before ``deepspeed.init_distributed``.

Training never uses the CPU shared-memory op: ZeRO's collectives go through ``TorchBackend.all_reduce`` etc., which
are ``torch.distributed`` calls; only ``deepspeed.comm.inference_all_reduce`` (AutoTP inference layers) calls the
kernel, and only when ``LOCAL_SIZE == world size`` (DeepSpeed's launcher sets it; Lightning's does not). The op
also costs a 66 MB ``/dev/shm`` segment per rank that DeepSpeed never unlinks. So by default
(``LIGHTNING_GAUDI_DS_SHM_COMM=off``) DeepSpeed is told not to build or load it, and collectives are plain
``torch.distributed``; ``on`` loads it, building it once when missing (DeepSpeed's own behaviour), and falls back
with one warning when it cannot be built.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from lightning_gaudi_ds import _compat
from lightning_gaudi_ds.errors import SetupError
from lightning_gaudi_ds.jit_ops.build import (
    BUILD_COMMAND,
    CPU_ADAM,
    OPS,
    SHM_COMM,
    built_library,
    compiler_missing,
    ds_builder,
    installed_ops,
    load_op,
    say,
    short_error,
)
from lightning_gaudi_ds.jit_ops.locks import BuildLockError, clear_stale_locks, scan_locks
from lightning_gaudi_ds.launch import envvars

SHM_MODE_ENV = envvars.SHM_COMM.name
log = logging.getLogger(__name__)


@dataclass
class StartupOps:
    """What :func:`prepare_startup` decided, for logs and tests."""

    shm_comm: str  # "loaded" | "fallback" | "not used"
    reason: str = ""
    loaded: list[str] = field(default_factory=list)
    cleared_locks: list[str] = field(default_factory=list)


_fallback_said = False  # the fallback warning is given once per process


def shm_mode(env: Mapping[str, str] = os.environ) -> str:
    """``off`` (default) or ``on``, from ``LIGHTNING_GAUDI_DS_SHM_COMM``."""
    return str(envvars.read(envvars.SHM_COMM, env))


def shm_segment_name(rank: int, env: Mapping[str, str] = os.environ) -> str:
    """The POSIX shm segment DeepSpeed's op creates for ``rank`` (shm.cpp ``shm_initialize``)."""
    return (f"{_compat.SHM_SEGMENT_PREFIX}_{os.getuid()}_{env.get('MASTER_ADDR', '')}_{env.get('MASTER_PORT', '')}"
            f"_{rank}")


def _unlink_own_segment(rank: int) -> None:
    # DeepSpeed never unlinks its 66 MB segment per rank: /dev/shm (RAM) fills up run after run. Peers keep
    # their mapping; by exit every rank has long passed shm_initialize (collectives followed it).
    with contextlib.suppress(OSError):
        os.unlink(Path("/dev/shm") / shm_segment_name(rank))


def prepare_startup(
    deepspeed_accelerator: str,
    offload_optimizer: bool = False,
    world_size: int = 1,
    say: Callable[[str], None] = say,
    shm_comm: str | None = None,
    local_size: int | None = None,
) -> StartupOps:
    """Run on every rank before ``deepspeed.init_distributed``: never hang on a build lock, never compile silently.

    Clears stale build locks of DeepSpeed's JIT ops, decides whether the CPU shm op is loaded (see the module
    docstring) and, with ZeRO-Offload (``offload_optimizer``), loads ``cpu_adam`` (building it once if needed,
    with a message). ``shm_comm`` is the shm mode (default: ``LIGHTNING_GAUDI_DS_SHM_COMM``, else off);
    ``local_size`` the ``LOCAL_SIZE`` DeepSpeed's shm op will see at ``init_distributed`` (default: the variable).
    """
    # Ops this run does not load only get a warning for a lock that cannot be judged; loaded ones raise. Every op
    # of the cache, not only those the set-up builds: ZeRO-Infinity's zero.Init loads pin_memory with async_io.
    names = tuple(dict.fromkeys([*OPS, *(info.path.parent.name for info in scan_locks())]))
    cleared = [str(i.path) for i in clear_stale_locks(names, say, strict=False) if i.state == "stale"]
    if deepspeed_accelerator == "cpu":
        if local_size is None and os.environ.get("LOCAL_SIZE", "").isdigit():
            local_size = int(os.environ["LOCAL_SIZE"])
        mode = shm_mode(os.environ if shm_comm is None else {SHM_MODE_ENV: shm_comm})
        result = _prepare_shm(mode, world_size, local_size, say)
    else:
        result = StartupOps("not used")
    result.cleared_locks = cleared
    if offload_optimizer:
        builder = ds_builder(OPS[CPU_ADAM])
        if builder is not None and not installed_ops().get(CPU_ADAM):
            if built_library(CPU_ADAM) is None:
                say(f"building DeepSpeed's {CPU_ADAM} op for ZeRO-Offload (first run only, 2-5 min on 2 cores);"
                    f" build it ahead with `{BUILD_COMMAND}`")
            try:
                load_op(CPU_ADAM, builder, say)
            except BuildLockError:
                raise
            except Exception as err:  # re-raised, with the way out (a compiler, or no offload)
                raise SetupError(
                    f"ZeRO-Offload needs DeepSpeed's {CPU_ADAM} op, which could not be built: {short_error(err)}."
                    f" Install a C++ compiler and ninja, then run `{BUILD_COMMAND}`; or train without offload"
                    " (offload_optimizer=False)."
                ) from err
            result.loaded.append(CPU_ADAM)
    return result


def _disable_shm(reason: str, world_size: int, warn: bool) -> StartupOps:
    """Tell DeepSpeed not to build/load the shm op (``build_shm_op`` then returns None); warn once if asked."""
    _compat.disable_deepspeed_op(SHM_COMM)
    global _fallback_said
    if warn and not _fallback_said and world_size > 1:
        _fallback_said = True
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(f"DeepSpeed's shared-memory comm op is not used ({reason}); collectives use plain"
                       " torch.distributed (ZeRO training's all-reduce always does).")
    else:
        log.debug("DeepSpeed's shared-memory comm op is not used: %s", reason)
    return StartupOps("fallback", reason)


def _prepare_shm(mode: str, world_size: int, local_size: int | None, say: Callable[[str], None]) -> StartupOps:
    if not _compat.deepspeed_op_enabled(SHM_COMM):
        return StartupOps("not used", "DeepSpeed reports it incompatible here")
    builder = ds_builder(OPS[SHM_COMM])
    if builder is None:
        return StartupOps("not used", "no builder on this DeepSpeed accelerator")
    if mode == "off":
        return _disable_shm(f"{SHM_MODE_ENV}=off, the default", world_size, warn=False)
    built = installed_ops().get(SHM_COMM) or built_library(SHM_COMM) is not None
    if not built and (missing := compiler_missing()) is not None:
        return _disable_shm(f"it cannot be built: {missing}", world_size, warn=True)
    if not built:
        say(f"building DeepSpeed's {SHM_COMM} op (first run only, 1-4 min on 2 cores);"
            f" build it ahead with `{BUILD_COMMAND}`")
    try:
        load_op(SHM_COMM, builder, say)
    except BuildLockError:
        raise
    except Exception as err:  # every rank sees the same failure (same build dir): all fall back alike
        return _disable_shm(f"its build failed: {short_error(err)}", world_size, warn=True)
    if local_size != world_size:
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(f"{SHM_MODE_ENV}=on: DeepSpeed's shm kernel engages only when LOCAL_SIZE equals the world"
                       f" size ({world_size}, all ranks on this machine); LOCAL_SIZE is {local_size}, so the op is"
                       " loaded but unused.")
    else:
        atexit.register(lambda: _unlink_own_segment(int(os.environ.get("RANK", "0"))))  # RANK: set by then
    return StartupOps("loaded", mode, [SHM_COMM])
