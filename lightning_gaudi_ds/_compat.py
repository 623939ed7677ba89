"""Every private name of Lightning, DeepSpeed and torch the package relies on, in one place.

An upgrade that removes or renames one breaks it here, and ``tests/test_compat.py`` says which Lightning /
DeepSpeed / torch version removed what, and which part of this package used it. One section per area; code
elsewhere imports these names from here, never the private path itself.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.fabric.accelerators.registry import _AcceleratorRegistry
from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_STR_ALIAS_CONVERSION
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.strategies.deepspeed import _format_precision_config, _validate_device_index_selection
from lightning.fabric.utilities.load import _move_state_into
from lightning.fabric.utilities.types import _DEVICE, _PATH, _Stateful
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers, _MockOptimizer
from lightning.pytorch.strategies.deepspeed import remove_module_hooks
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from deepspeed import DeepSpeedEngine

__all__ = [
    "BUILD_LOCK_NAME",
    "COPIED_DEEPSPEED_STRATEGY_METHODS",
    "COPIED_FABRIC_DEEPSPEED_STRATEGY_METHODS",
    "OVERRIDDEN_FABRIC_DEEPSPEED_STRATEGY_HOOKS",
    "_Stateful",
    "launcher_of",
    "process_group_timeout",
    "set_num_nodes",
    "set_process_group_timeout_of",
    "COPIED_FROM_LIGHTNING_VERSION",
    "DEEPSPEED_LAUNCHER_ENV",
    "DEEPSPEED_NODE_RANK_ENV",
    "DEEPSPEED_STRATEGY_ATTRIBUTES",
    "LIGHTNING_CONVERTER_DROPPED_KEYS",
    "OVERRIDDEN_DEEPSPEED_STRATEGY_HOOKS",
    "SHM_SEGMENT_PREFIX",
    "_DEVICE",
    "_PATH",
    "_AcceleratorRegistry",
    "fused_kernel_devices",
    "TorchDispatchMode",
    "_MockOptimizer",
    "_StrategyRegistry",
    "_PRECISION_INPUT_STR_ALIAS_CONVERSION",
    "_format_precision_config",
    "_init_optimizers_and_lr_schedulers",
    "_move_state_into",
    "_validate_device_index_selection",
    "attached_trainer",
    "attention_function",
    "forget_mpu",
    "register_attention_function",
    "reset_autotp_kv_heads",
    "ulysses_attention",
    "ulysses_missing",
    "with_attention_implementation",
    "zero3_average_over_every_rank",
    "created_deepspeed_accelerator",
    "autotp_parse",
    "autotp_policy_names",
    "lm_head_allreduce",
    "tensor_parallel_config_keys",
    "tensor_parallel_layer_class",
    "deepspeed_accelerator_name",
    "deepspeed_op_enabled",
    "deepspeed_reads_config_key",
    "deepspeed_removed_config_keys",
    "deepspeed_version",
    "disable_deepspeed_op",
    "ds_to_universal",
    "extensions_root",
    "fabric_run_command",
    "fabric_run_module",
    "forget_jit_extension",
    "hf_deepspeed_config_ref",
    "is_unimplemented_builder",
    "forget_deepspeed_groups",
    "give_bf16_optimizer_zero_grad",
    "zero3_backward_requires_training_mode",
    "zero3_param_coordinator",
    "mark_step_wrapped_for_lr_scheduler",
    "precision_config_models",
    "model_states_meta",
    "model_states_name",
    "optim_states_name",
    "pin_device_count",
    "reset_zero3_trace_at_outer_forward_only",
    "remove_module_hooks",
    "start_children_with",
    "set_deepspeed_accelerator",
    "train_dataloaders",
    "universal_checkpoint_loading",
    "zero_init_paused",
]


# ================================================================ strategy, config and engine (layout-core)
# Lightning's private DeepSpeedStrategy methods HPUDeepSpeedStrategy overrides or calls. If Lightning renames one,
# the override silently stops being called (or the call fails), so the test checks each still exists.
OVERRIDDEN_DEEPSPEED_STRATEGY_HOOKS = (
    "_configure_launcher",  # validate precision/device before any process starts
    "_get_process_group_backend",  # the device's backend (gloo, nccl, hccl)
    "_load_config",  # load + validate the user's config
    "_init_config_if_needed",  # resolve again for a new Trainer / a fit after validate
    "_format_config",  # fill "auto" from the Trainer
    "_initialize_deepspeed_train",  # optimizer from the config or configure_optimizers
    "_initialize_deepspeed_inference",  # device_rank on CPU/HPU
    "_setup_model_and_optimizer",  # device_rank on CPU/HPU
    "_init_optimizers",  # Lightning's, then its "single optimizer" error said precisely; Habana's fused optimizers
    "_init_deepspeed_distributed",  # called from our setup_distributed
    "_set_deepspeed_activation_checkpointing",  # number of checkpoints for contiguous checkpointing
)
# The same for Fabric's DeepSpeedStrategy, which Fabric's HPUDeepSpeedStrategy overrides or calls.
OVERRIDDEN_FABRIC_DEEPSPEED_STRATEGY_HOOKS = (
    "_configure_launcher",  # validate precision/device before any process starts
    "_get_process_group_backend",  # the device's backend (gloo, nccl, hccl)
    "_load_config",  # load + validate the user's config
    "_format_config",  # fill "auto" before the model exists
    "_initialize_engine",  # stage="auto", "auto" for the model, ZeRO-Offload's optimizer, the device rank
    "_init_deepspeed_distributed",  # bounded rendezvous
    "_set_deepspeed_activation_checkpointing",  # number of checkpoints for contiguous checkpointing
    "_setup_distributed",  # device-index check where devices have one, JIT-op start-up
    "_set_world_ranks",  # called with the process group's start
)
# Private attributes of Lightning's DeepSpeedStrategy instances (Trainer's and Fabric's) the strategies read or set.
DEEPSPEED_STRATEGY_ATTRIBUTES = ("_config_initialized", "_process_group_backend", "_timeout", "_num_nodes",
                                 "_launcher")

# Methods of Lightning's DeepSpeedStrategy that HPUDeepSpeedStrategy copies with a change, and the hash of the
# Lightning source they copy (see _source_digest). A different hash means Lightning changed the original: carry
# its change over into the copy, then update the hash.
COPIED_FROM_LIGHTNING_VERSION = "2.6.6"
COPIED_DEEPSPEED_STRATEGY_METHODS: dict[str, str] = {
    "setup_environment": "d8046a5e0e133d04",  # without the CUDA-only gate
    "setup_distributed": "d8ce45e1f34e061c",  # device-index check only where devices have one, JIT-op start-up
    "_initialize_deepspeed_train": "f2a07b4c1db8f7dd",  # the optimizer may come from the config or the module
    "_initialize_deepspeed_inference": "cb20fc28d95bf969",  # device_rank for CPU/HPU
    "_setup_model_and_optimizer": "68c0cc65d009288f",  # device_rank for CPU/HPU
}
# Methods of Fabric's DeepSpeedStrategy that its HPUDeepSpeedStrategy copies with a change, guarded the same way.
COPIED_FABRIC_DEEPSPEED_STRATEGY_METHODS: dict[str, str] = {
    "setup_environment": "d8046a5e0e133d04",  # without the CUDA-only gate
    "_setup_distributed": "c91da5b5370d1e59",  # device-index check only where devices have one, JIT-op start-up
    "_initialize_engine": "1715df238051a03b",  # stage="auto", "auto" filled for the model, ZeRO-Offload's optimizer
}


def launcher_of(strategy: object) -> Any:
    """The launcher Lightning's (or Fabric's) strategy made in ``_configure_launcher`` (``_launcher``)."""
    return getattr(strategy, "_launcher")  # noqa: B009  (a private attribute, read in one place)


def set_num_nodes(strategy: object, nodes: int) -> None:
    """The strategy's node count (``_num_nodes``, which Lightning's ``num_nodes`` setter also spreads to the
    environment; a restart on fewer hosts sets it before the ranks are)."""
    setattr(strategy, "_num_nodes", nodes)  # noqa: B010


def process_group_timeout(strategy: object) -> Any:
    """The process-group timeout the strategy was given (``_timeout``; None: torch's default)."""
    return getattr(strategy, "_timeout")  # noqa: B009


def set_process_group_timeout_of(strategy: object, timeout: Any) -> None:
    """The timeout the strategy hands to ``deepspeed.init_distributed`` (``_timeout``)."""
    setattr(strategy, "_timeout", timeout)  # noqa: B010


def _source_digest(function: Any) -> str:
    """sha256 of a function's source, without blank lines, comments and indentation changes."""
    import hashlib
    import inspect

    lines = [line.strip() for line in inspect.getsource(function).splitlines()]
    code = "\n".join(line for line in lines if line and not line.startswith("#"))
    return hashlib.sha256(code.encode()).hexdigest()[:16]


def attached_trainer(module: Any | None) -> pl.Trainer | None:
    """The Trainer a LightningModule is attached to, or None (``LightningModule.trainer`` raises when detached)."""
    return getattr(module, "_trainer", None)


def train_dataloaders(trainer: pl.Trainer) -> list[Any] | None:
    """The train DataLoaders of a fit, built as ``Trainer.estimated_stepping_batches`` builds them (after
    ``LightningDataModule.setup``); the fit loop reuses them. None when there is no train loader."""
    loop = trainer.fit_loop
    if loop._combined_loader is None:
        loop.setup_data()
    if loop._combined_loader is None:
        return None
    return list(loop._combined_loader.flattened)


def deepspeed_accelerator_name() -> str:
    """The name of DeepSpeed's global accelerator (``"cpu"``, ``"cuda"``, ``"hpu"``); DeepSpeed has no public
    getter. Importing DeepSpeed picks that accelerator by auto-detection, so it is imported on first use."""
    from deepspeed.accelerator import get_accelerator

    return str(get_accelerator()._name)


def set_deepspeed_accelerator(name: str) -> str | None:
    """Make DeepSpeed's global accelerator ``name`` (``"cpu"``, ``"cuda"``, ``"hpu"``); return the name it had, or
    None when it was already ``name``. DeepSpeed's accelerator classes live in its private-by-convention modules."""
    import deepspeed.accelerator as ds_acc

    previous = deepspeed_accelerator_name()
    if previous == name:
        return None
    if name == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator as Accelerator
    elif name == "cuda":
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator as Accelerator
    else:
        from deepspeed.accelerator.hpu_accelerator import HPU_Accelerator as Accelerator
    ds_acc.set_accelerator(Accelerator())
    return previous


def pin_device_count(count: int) -> Callable[[], None]:
    """Make DeepSpeed's global accelerator report ``count`` devices until the returned undo is called.

    DeepSpeed's CPU accelerator reads the count from ``LOCAL_SIZE`` (its launcher sets it) and otherwise runs
    ``numactl --hardware`` in a subprocess on every call (ZeRO-3 calls it for every reduce bucket); this gives the
    same answer without writing ``LOCAL_SIZE`` into the user's process. Its ``device_count`` takes no argument.
    """
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    accelerator.device_count = lambda: count  # the instance attribute shadows the class's method

    def undo() -> None:
        accelerator.__dict__.pop("device_count", None)

    return undo


def start_children_with(launcher: Any, values: Callable[[], Mapping[str, str]]) -> None:
    """Have Lightning's (or Fabric's) subprocess launcher start its ranks with ``values()`` in their environment.

    ``_SubprocessScriptLauncher._call_children_scripts`` gives each child a copy of ``os.environ`` and takes nothing
    else: the values are in ``os.environ`` only while it starts them. Other launchers are left as they are.
    """
    from lightning.fabric.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher as _FabricSubprocessScriptLauncher,
    )
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    from lightning_gaudi_ds._environ import scoped_environ

    if not isinstance(launcher, (_SubprocessScriptLauncher, _FabricSubprocessScriptLauncher)):
        return
    start = launcher._call_children_scripts

    def start_with_values() -> None:
        with scoped_environ(values(), override=True):
            start()

    launcher._call_children_scripts = start_with_values  # type: ignore[method-assign]


def deepspeed_removed_config_keys() -> tuple[Mapping[str, str], Mapping[str, str]]:
    """``(top-level, zero_optimization)`` config keys this DeepSpeed has removed, with DeepSpeed's explanation.
    DeepSpeed versions before the removals have no such tables: nothing is removed there."""
    import deepspeed.runtime.config as ds_config

    return (
        getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}),
        getattr(ds_config, "_REMOVED_ZERO_CONFIG_KEYS", {}),
    )


@functools.cache
def deepspeed_reads_config_key(key: str) -> bool:
    """Whether this DeepSpeed's ``runtime/config.py`` reads top-level key ``key`` by its literal name (the keys of
    ``config.load.INLINE_KEYS``). 0.16 (Habana's fork) reads no ``sequence_parallel_size`` there, for one."""
    import deepspeed.runtime.config as ds_config

    source = inspect.getsource(ds_config)
    return f'"{key}"' in source or f"'{key}'" in source


def fused_kernel_devices() -> list[str]:
    """The device types torch's fused optimizer kernels run on (``torch.utils._foreach_utils``); empty on a torch
    without that table, which then keeps its own choice."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return []
    return list(_get_fused_kernels_supported_devices())


def deepspeed_version() -> str:
    """The installed DeepSpeed's version string (Habana's fork: upstream's, e.g. ``0.16.1+hpu.synapse.v1.21.0``)."""
    import deepspeed

    return str(deepspeed.__version__)


def precision_config_models() -> dict[str, type]:
    """DeepSpeed's pydantic models of the ``bf16`` and ``fp16`` config sections, by section name.

    DeepSpeed 0.17+ has them (``deepspeed.runtime.precision_config``). 0.16 (and Habana's fork) reads both sections
    by hand in ``runtime/config.py``, key by key, from its ``BFLOAT16_<KEY>``/``FP16_<KEY>`` constants and their
    ``_DEFAULT`` values: there an equivalent model is built from those constants, each key typed as its default
    (numbers as float), so the same keys and types are checked on every version.
    """
    try:
        from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    except ImportError:  # DeepSpeed < 0.17
        DeepSpeedBF16Config = _model_from_constants("DeepSpeedBF16Config", "BFLOAT16_")
        DeepSpeedFP16Config = _model_from_constants("DeepSpeedFP16Config", "FP16_")
    return {"bf16": DeepSpeedBF16Config, "bfloat16": DeepSpeedBF16Config, "fp16": DeepSpeedFP16Config}


def _model_from_constants(name: str, prefix: str) -> type:
    import deepspeed.runtime.constants as constants
    from pydantic import ConfigDict, create_model

    fields: dict[str, Any] = {}
    for const, key in vars(constants).items():
        if const.startswith(prefix) and hasattr(constants, f"{const}_DEFAULT"):
            default = getattr(constants, f"{const}_DEFAULT")
            fields[key] = (bool if isinstance(default, bool) else float, default)
    model: type = create_model(name, __config__=ConfigDict(extra="forbid"), **fields)
    return model


def mark_step_wrapped_for_lr_scheduler(optimizer: Any) -> None:
    """Give ``optimizer.step`` the marks torch's ``LRScheduler`` puts on the step it wraps when it is built.

    A scheduler re-pointed at a new optimizer (ZeRO-Offload's DeepSpeedCPUAdam in place of the user's AdamW) would
    otherwise warn on its first step that "optimizer.step() has been overridden after learning rate scheduler
    initialization" (torch checks ``_wrapped_by_lr_sched`` on the step and ``_opt_called`` on the optimizer).
    """
    import functools

    step = optimizer.step

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper


@functools.cache
def zero3_backward_requires_training_mode() -> bool:
    """Whether this DeepSpeed's ZeRO-3 backward hooks assert ``sub_module.training`` (Habana's fork 1.20/1.21 does;
    upstream has the assertion commented out): backward through a module in eval mode then fails."""
    import re

    from deepspeed.runtime.zero import parameter_offload

    return re.search(r"^\s*assert sub_module\.training", inspect.getsource(parameter_offload), re.M) is not None


def give_bf16_optimizer_zero_grad(optimizer: Any) -> None:
    """Give DeepSpeed 0.16's ``BF16_Optimizer`` (ZeRO stage 0 in bf16) the ``zero_grad`` 0.17 added, which Lightning's
    ``optimizer_zero_grad`` calls: clear the bf16 and the fp32 gradients (``clear_lp_grads``/``clear_hp_grads``, what
    its own ``step`` does). Any other optimizer is left as it is."""
    if hasattr(optimizer, "zero_grad") or not hasattr(optimizer, "clear_hp_grads"):
        return

    def zero_grad(set_to_none: bool = True) -> None:
        optimizer.clear_lp_grads()
        optimizer.clear_hp_grads()

    optimizer.zero_grad = zero_grad


def set_process_group_timeout(timeout: Any) -> None:
    """Set the default process group's collective timeout (a ``timedelta``) after it was created with a shorter one
    (the bounded rendezvous). torch's private ``_set_pg_timeout`` (torch >= 2.3; gloo and nccl)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout)


def reset_zero3_trace_at_outer_forward_only(engine: DeepSpeedEngine) -> bool:
    """Let a ZeRO-3 engine start its step at the outermost call of the top module only; True if it applied.

    DeepSpeed's ZeRO-3 (``DeepSpeedZeRoOffload.setup_zero_stage3_hooks``) resets its parameter coordinator in a
    forward pre-hook of the top module, i.e. of the LightningModule: Lightning calls the engine with ``forward``
    redirected to ``training_step``, and ``training_step`` calls ``self(x)``, the same module again. That second
    reset cuts every recorded trace after one module, so the trace is never complete: no prefetch, and every
    parameter is released after its forward and all-gathered again in backward (24-28% more CPU time than a
    plain ``deepspeed.initialize`` loop, benchmarks/README.md). Here the reset runs only when the top module is
    entered from outside itself. DeepSpeed 0.19 keeps the hook's handle (``fwd_pre_hook``); upstream 0.16 registers
    it without one (found by its function, ``_start_of_forward_hook``); Habana's fork resets no step in a pre-hook
    (it resets in an evaluation forward's post-hook, and per training/evaluation coordinator), so nothing applies.
    """
    import torch
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    optimizer = getattr(engine, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", optimizer)  # training: the ZeRO-3 optimizer's; eval: itself
    if not isinstance(offload, DeepSpeedZeRoOffload):
        return False
    handle = getattr(offload, "fwd_pre_hook", None)
    if handle is None:  # DeepSpeed 0.16: the reset hook has no handle
        hooks = offload.module._forward_pre_hooks
        found = [key for key, hook in hooks.items() if "_start_of_forward_hook" in _function_names(hook)]
        if len(found) != 1:
            return False

        def remove() -> None:
            hooks.pop(found[0], None)
    else:
        remove = handle.remove
    depth = 0

    @torch.compiler.disable
    def enter(module: Any, args: Any) -> None:
        nonlocal depth
        depth += 1
        if depth == 1:  # upstream's one coordinator (the fork, with one per mode, returned above)
            offload.get_param_coordinator().reset_step()

    @torch.compiler.disable
    def leave(module: Any, args: Any, output: Any) -> None:
        nonlocal depth
        depth = max(depth - 1, 0)

    remove()
    offload.fwd_pre_hook = offload.module.register_forward_pre_hook(enter, prepend=True)
    offload.forward_hooks.append(offload.module.register_forward_hook(leave, always_call=True))
    return True


def zero3_param_coordinator(offload: Any, training: bool = True) -> Any:
    """ZeRO-3's parameter coordinator of a ``DeepSpeedZeRoOffload``: upstream has one
    (``get_param_coordinator()``), Habana's fork one per mode (``get_param_coordinator(training)``)."""
    if "training" in inspect.signature(offload.get_param_coordinator).parameters:
        return offload.get_param_coordinator(training=training)
    return offload.get_param_coordinator()


@functools.cache
def zero3_gather_waits_for_last_only() -> bool:
    """Whether this DeepSpeed's blocking ZeRO-3 gather of several parameters (``Init._allgather_params_coalesced``,
    behind ``GatheredParameters``, transformers' ZeRO-3 loading and DeepSpeed's 16-bit state dict) waits for the last
    of its async all-gathers only: upstream before deepspeedai/DeepSpeed#8539 (0.16.1, Habana's fork 1.20/1.21).

    On CUDA and HPU that is enough (one stream runs them in order). gloo runs each on its own worker thread: the
    others may still be writing when the caller reads or writes the gathered weights (uninitialized memory, or a
    rank 0 load that the end of a gather overwrites, then broadcast to every rank). Without the source, assume so.
    """
    from deepspeed.runtime.zero.partition_parameters import Init

    try:
        source = inspect.getsource(Init._allgather_params_coalesced)
    except (OSError, TypeError):
        return True
    return re.search(r"launch_handles\[-1\]\.wait\(\)", source) is not None


def complete_zero3_gathers(module: Any | None = None) -> int:
    """Make the ZeRO-3 partitioners behind ``module``'s parameters (None: the active top-level ``zero.Init``, which
    converts every parameter built inside, the user's own where they nest the strategy's in it) wait for every
    all-gather of a blocking multi-parameter gather on gloo, where this DeepSpeed waits for the last only
    (:func:`zero3_gather_waits_for_last_only`); returns how many partitioners changed.

    Each partitioner (a ``zero.Init``, found as the ``self`` of a parameter's ``all_gather`` closure, or as
    DeepSpeed's ``top_level_context``) gets an instance attribute that runs its own gather and then a barrier on
    each group it used: gloo's barrier completes all of the group's earlier work first. Only those objects change;
    other ``zero.Init`` objects of the process, NCCL or HCCL groups, and a fixed DeepSpeed are left as they are.
    """
    if not zero3_gather_waits_for_last_only():
        return 0
    from deepspeed.runtime.zero import partition_parameters

    if module is None:
        partitioners = [partition_parameters.top_level_context]
    else:
        partitioners = []
        for param in module.parameters():
            gather = getattr(param, "all_gather", None)
            code, cells = getattr(gather, "__code__", None), getattr(gather, "__closure__", None)
            if code is not None and cells and "self" in code.co_freevars:
                partitioners.append(cells[code.co_freevars.index("self")].cell_contents)
    changed = 0
    for partitioner in {id(p): p for p in partitioners if isinstance(p, partition_parameters.Init)}.values():
        if "_allgather_params_coalesced" not in vars(partitioner):
            partitioner._allgather_params_coalesced = functools.partial(
                _gather_then_wait, partitioner, partitioner._allgather_params_coalesced)
            changed += 1
    return changed


def _gather_then_wait(partitioner: Any, gather: Callable[..., Any], param_list: list[Any], *args: Any,
                      **kwargs: Any) -> Any:
    import torch.distributed as dist

    result = gather(param_list, *args, **kwargs)
    if len(param_list) > 1 and partitioner.num_partitions > 1:
        groups = {id(g): g for g in (partitioner.get_partition_dp_group(p) for p in param_list)}
        for group in groups.values():
            if dist.get_backend(group) == "gloo":
                dist.barrier(group=group)
    return result


def _function_names(function: Any) -> set[str]:
    """A function's name and those of the functions its closure wraps (DeepSpeed's ``instrument_w_nvtx``)."""
    names = {getattr(function, "__name__", "")}
    for cell in getattr(function, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # an empty cell
            names.add(getattr(cell.cell_contents, "__name__", ""))
    return names


def forget_deepspeed_groups() -> None:
    """Drop the process groups DeepSpeed's group registry (``deepspeed.utils.groups``: ``_WORLD_GROUP``,
    ``_DATA_PARALLEL_GROUP``, the expert- and sequence-parallel dicts, ...) holds, so that destroying them frees
    them. Only at interpreter exit: DeepSpeed rebuilds them with a new process group, not without one."""
    import sys

    from torch.distributed import ProcessGroup

    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    for name, value in list(vars(groups).items()):
        if not name.startswith("_") or name.startswith("__"):
            continue
        if isinstance(value, ProcessGroup):
            setattr(groups, name, None)
        elif isinstance(value, dict) and any(isinstance(v, ProcessGroup) for v in value.values()):
            value.clear()


# ================================================================================================= Gaudi (gaudi)
def created_deepspeed_accelerator() -> str | None:
    """The name of DeepSpeed's global accelerator if it exists already, else None, without creating it.

    Creating DeepSpeed's HPU accelerator forces deterministic mode; whether that happened before the Trainer was
    built (``import deepspeed`` on a Gaudi machine creates it) decides what the strategy can tell the user.
    """
    import sys

    module = sys.modules.get("deepspeed.accelerator.real_accelerator")
    accelerator = getattr(module, "ds_accelerator", None)
    return None if accelerator is None else str(accelerator._name)


# ============================================================================ launching (lightning_gaudi_ds.launch)
# Variables ``deepspeed.launcher.launch`` sets for every rank it starts. CROSS_RANK (its node rank) is not
# documented: it comes from ``deepspeed.constants`` and is how DeepSpeedLauncherEnvironment tells the nodes apart.
DEEPSPEED_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "CROSS_RANK")
DEEPSPEED_NODE_RANK_ENV = "CROSS_RANK"


# Lightning's ``fabric run`` (lightning/fabric/cli.py, 2.6.6): its click command, whose options
# ``lightning_gaudi_ds.fabric_cli`` takes as they are, and its body, which sets the ``LT_*`` variables Fabric's
# connector reads in the ranks and runs torchrun on ``[..., args.script, *script_args]`` (``_torchrun_launch``).
def fabric_run_command() -> Any:
    """Lightning's ``fabric run`` ``click.Command`` (``lightning.fabric.cli._run``); None when click is missing,
    as Lightning then defines no command."""
    from lightning.fabric import cli

    return getattr(cli, "_run", None)


def fabric_run_module(options: Mapping[str, Any], module_argv: list[str]) -> None:
    """Lightning's ``fabric run`` with ``options`` (its command's parameters, less ``script_args``) on
    ``python -m <module_argv>`` instead of a script: torchrun's command line ends with ``args.script`` and the
    script's arguments, so ``"-m"`` as the script makes the first of ``module_argv`` torchrun's module."""
    from lightning.fabric import cli

    cli.main(args=argparse.Namespace(**{**options, "script": "-m"}), script_args=module_argv)


# ==================================================================== checkpoints (lightning_gaudi_ds.checkpoint)
def model_states_name(zero_stage: int, dp_rank: int, mp_rank: int = 0) -> str:
    """File name of one model-states shard in a tag folder (DeepSpeedEngine._get_ckpt_name).

    ZeRO-3 writes one per data-parallel rank; stages 0-2 one per model-parallel rank.
    """
    if zero_stage == 3:
        return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt"
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def optim_states_name(dp_rank: int, mp_rank: int = 0, bf16: bool = False) -> str:
    """File name of one ZeRO optimizer shard (DeepSpeedEngine._get_rank_zero_ckpt_name; ``bf16_`` under bf16)."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


# The DeepSpeed keys of a model-states file that Lightning's converter
# (lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict) drops from the Lightning state,
# copied from it (a local list there): tests/test_compat.py reads them from its source.
LIGHTNING_CONVERTER_DROPPED_KEYS = ("module", "optimizer", "lr_scheduler", "csr_tensor_module_names", "skipped_steps",
                                    "global_steps", "dp_world_size", "mp_world_size")


def model_states_meta(state: dict[str, Any]) -> tuple[int, int, int]:
    """(ZeRO stage, data-parallel world size, model-parallel world size) from a loaded model-states file.

    Keys written by DeepSpeedEngine._save_checkpoint (``ds_config``, ``dp_world_size``, ``mp_world_size``).
    """
    zero = (state.get("ds_config") or {}).get("zero_optimization") or {}
    return int(zero.get("stage", 0)), int(state.get("dp_world_size", 1)), int(state.get("mp_world_size", 1))


def weights_only_dropped_by_lightning() -> bool | None:
    """The ``weights_only`` passed to ``trainer.fit / validate / test / predict`` that is running, or None.

    Lightning 2.6.6 forwards it to ``strategy.load_checkpoint`` only when the strategy restores *before* setup:
    ``Trainer._run`` calls ``_restore_modules_and_callbacks(ckpt_path)`` without it when
    ``restore_checkpoint_after_setup`` is True, as it is for DeepSpeed training and ZeRO-3 evaluation. It is read from
    the running ``Trainer._run`` frame (its ``weights_only`` argument), nothing is changed.
    """
    import sys
    import types

    from lightning.pytorch import Trainer

    code = Trainer._run.__code__
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            value = frame.f_locals.get("weights_only")
            return value if isinstance(value, bool) else None
        frame = frame.f_back
    return None


def checkpoint_safe_globals() -> list[Any]:
    """The classes DeepSpeed pickles into its checkpoint shards, besides tensors and builtins: what torch's safe
    unpickler (``torch.load(weights_only=True)``) must be allowed to build to read them.

    Found by saving every stage (0-3) in fp32 and bf16, with and without optimizer offload, on DeepSpeed 0.16.1 and
    0.19.8, and listing each shard's ``torch.serialization.get_unsafe_globals_in_checkpoint``. They are plain data
    holders: none runs code when built (``__new__`` plus its saved ``__dict__``). ``DynamicLossScaler`` is what fp16
    saves in place of ``LossScaler``.
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def ds_to_universal(input_folder: Path, output_folder: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` conversion, in this process, with one worker (no process pool).

    DeepSpeed exposes it as a script only: ``main`` takes the ``Namespace`` its ``parse_arguments`` builds.
    """
    from deepspeed.checkpoint import ds_to_universal as script

    script.main(argparse.Namespace(
        input_folder=str(input_folder), output_folder=str(output_folder), num_extract_workers=1,
        num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True,
    ))


@contextlib.contextmanager
def universal_checkpoint_loading(engine: DeepSpeedEngine) -> Iterator[None]:
    """Make ``engine.load_checkpoint`` read a universal checkpoint (the ``load_universal_checkpoint`` config flag).

    DeepSpeed reads the flag from ``engine._config`` on every load; it has no argument for it.
    """
    engine._config.load_universal_checkpoint = True
    try:
        yield
    finally:
        engine._config.load_universal_checkpoint = False


# ================================================================== JIT-built ops (lightning_gaudi_ds.jit_ops)
def extensions_root() -> Path:
    """Torch's extension build root: ``TORCH_EXTENSIONS_DIR``, else ``<default root>/py<ver>_<cpu|cuXY|rocmXY>``.

    Torch's rule (``torch.utils.cpp_extension._get_build_directory``), without that function's side effect of
    creating the build directory of a named extension.
    """
    import os

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root()) / extensions_tag()


def extensions_tag() -> str:
    """Torch's name for its per-Python, per-build extension cache: ``py<ver>_<cpu|cuXY|rocmXY>``."""
    import sys

    import torch

    if torch.version.hip is not None:
        acc = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        acc = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        acc = "cpu"
    return f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{acc}"


BUILD_LOCK_NAME = "lock"  # torch's _jit_compile: FileBaton(os.path.join(build_directory, 'lock'))


def forget_jit_extension(name: str) -> None:
    """Make torch's JIT loader build extension ``name`` again in this process (it skips names it has seen)."""
    from torch.utils.cpp_extension import JIT_EXTENSION_VERSIONER

    JIT_EXTENSION_VERSIONER.entries.pop(name, None)


def deepspeed_op_enabled(name: str) -> bool:
    """Whether DeepSpeed will build/load op ``name`` (its ``deepspeed.ops.__compatible_ops__`` table)."""
    import deepspeed.ops

    return bool(deepspeed.ops.__compatible_ops__.get(name, False))


def disable_deepspeed_op(name: str) -> None:
    """Stop DeepSpeed from building/loading op ``name``: ``deepspeed.comm.torch.build_shm_op`` reads this table."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[name] = False


def is_unimplemented_builder(builder: Any) -> bool:
    """Whether an accelerator's ``create_op_builder`` returned its placeholder for an op it does not have.

    Every DeepSpeed accelerator has its own ``NotImplementedBuilder`` class; only the name is shared.
    """
    return type(builder).__name__ == "NotImplementedBuilder"


# shm.cpp SHM_BUFFER_NAME; a rank's segment is "<prefix>_<uid>_<addr>_<port>_<rank>"
SHM_SEGMENT_PREFIX = "deepspeed_allreduce_buffer"


# ================================================================ tensor-parallel inference (engine.inference)
# DeepSpeed's AutoTP internals (deepspeed.module_inject): its model parser, the base class of its split layers,
# and the row-parallel output projection with the per-model shard metadata. Imported when called: importing
# DeepSpeed picks its global accelerator.
def autotp_parse(model: Any) -> Any:
    """AutoTP's policy for ``model``; raises ``AssertionError`` with DeepSpeed's reason when it finds none."""
    from deepspeed.module_inject.auto_tp import AutoTP

    return AutoTP.tp_parser(model)


def autotp_policy_names(module: Any, names: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` (of an ``injection_policy``: linear layers of ``module``, each its path in ``module`` or a dotted
    suffix of it) plus the names DeepSpeed's AutoTP gives the layers they select.

    AutoTP (``AutoTP._replace_module``) names a linear layer ``<parent's name>.<its name>`` and a direct child of
    the policy's class ``.<its name>``, and tests the policy's tuple for that exact string: ``"fc2"`` alone would
    never match the ``fc2`` of the class that owns it.
    """
    import torch

    found = []
    for path, layer in module.named_modules():
        if isinstance(layer, torch.nn.Linear) and any(path == n or path.endswith("." + n) for n in names):
            parts = path.split(".")
            found.append("." + path if len(parts) == 1 else ".".join(parts[-2:]))
    return tuple(dict.fromkeys((*names, *found)))


def tensor_parallel_layer_class() -> type | tuple[type, ...]:
    """The class (0.17+: ``TensorParallel_Layer``, their base) or classes (0.16: ``LinearLayer``, ``LinearAllreduce``,
    ``LmHeadLinearAllreduce``) of the layers DeepSpeed's tensor parallelism puts in place of split ones: an
    ``isinstance`` argument."""
    try:
        from deepspeed.module_inject.layers import TensorParallel_Layer
    except ImportError:  # DeepSpeed 0.16 (Habana's fork): no common base class
        from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer, LmHeadLinearAllreduce

        return LinearLayer, LinearAllreduce, LmHeadLinearAllreduce
    return TensorParallel_Layer


def tensor_parallel_config_keys() -> tuple[str, ...]:
    """The fields of DeepSpeed's ``DeepSpeedTPConfig`` (``tensor_parallel`` of ``init_inference``); 0.16 has no
    ``tp_grain_size``, and Habana's fork refuses it."""
    from deepspeed.inference.config import DeepSpeedTPConfig

    return tuple(DeepSpeedTPConfig.model_fields)


def lm_head_allreduce(head: Any, group: Any, model_config: Any, grain: int) -> Any:
    """``head`` (an ``nn.Linear``) split by input columns over ``group``, its outputs summed, as AutoTP splits a
    top-level ``lm_head``; ``head`` itself where this DeepSpeed cannot split it for ``group``.

    0.17+ sizes the shards from the model's config (``AutoTPMeta``). 0.16 takes the weight already cut
    (``tp_shard.get_shard_size_list``, the fork's shard rule included) and sizes the input slice in ``forward``
    by the *global* rank: there only a group of every rank is split.
    """
    import torch
    from deepspeed.module_inject.layers import LmHeadLinearAllreduce

    try:
        from deepspeed.module_inject.tp_shard import AutoTPMeta
    except ImportError:  # DeepSpeed 0.16
        import deepspeed.module_inject.tp_shard as tp_shard
        import torch.distributed as dist

        if not hasattr(tp_shard, "num_kv_heads"):  # declared, unset until AutoTP's first split: None is "unknown"
            tp_shard.set_num_kv_heads(None)
        get_shard_size_list = tp_shard.get_shard_size_list
        rank, size = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
        if group is not None and size != dist.get_world_size():
            return head
        shard = head.weight.data.split(get_shard_size_list(head.in_features, size, "lm_head"), dim=1)[rank]
        bias = None if head.bias is None else torch.nn.Parameter(head.bias.data, requires_grad=False)
        return LmHeadLinearAllreduce(torch.nn.Parameter(shard.clone(), requires_grad=False), rank, size, bias, group)
    return LmHeadLinearAllreduce(head, group, tp_meta=AutoTPMeta.from_model_config(model_config, grain))


# ======================================================== sequence parallelism (lightning_gaudi_ds.sequence)
# DeepSpeed-Ulysses' exchange: ``deepspeed.sequence.layer.DistributedAttention`` in Habana's fork (0.16.1) and
# upstream. 0.16 splits heads unevenly whenever AutoTP's module-global key-value head count is set (by a
# tensor-parallel engine earlier in the process); 0.17+ takes the count from the key tensor. The engine keeps the
# ``mpu`` it was given in the module-global ``deepspeed.utils.groups.mpu``. transformers: the attention registry
# (``AttentionInterface``, public) and a config's attention implementation, set on that config alone.
def ulysses_missing() -> str | None:
    """None when the installed DeepSpeed has ``deepspeed.sequence.layer.DistributedAttention``, else what is missing;
    read from DeepSpeed's files, without importing it (importing DeepSpeed picks its accelerator)."""
    import importlib.util

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return "DeepSpeed is not installed"
    layer = Path(next(iter(spec.submodule_search_locations))) / "sequence" / "layer.py"
    if not layer.is_file():
        return f"no {layer}"
    if "class DistributedAttention" not in layer.read_text(errors="replace"):
        return f"{layer} has no DistributedAttention"
    return None


def ulysses_attention(local_attention: Callable[..., Any], group: Any) -> Any:
    """DeepSpeed's ``DistributedAttention`` around ``local_attention`` over ``group``: called as ``(query, key, value,
    0, None, *args)`` with tensors ``(batch, sequence part, heads, head size)``."""
    from deepspeed.sequence.layer import DistributedAttention

    return DistributedAttention(local_attention, group)


def reset_autotp_kv_heads() -> bool:
    """DeepSpeed 0.16: forget the key-value head count AutoTP left module-global (it would send Ulysses' exchange
    down its uneven-heads path); returns whether one was set. Nothing to do on 0.17+."""
    import deepspeed.sequence.layer as layer

    if not hasattr(layer, "get_num_kv_heads"):  # 0.17+: the count is the caller's
        return False
    from deepspeed.module_inject import tp_shard

    if tp_shard.get_num_kv_heads() is None:
        return False
    tp_shard.set_num_kv_heads(None)
    return True


def forget_mpu(mpu: Any) -> None:
    """Clear DeepSpeed's module-global ``groups.mpu`` if it is ``mpu``: an engine built later without one would
    otherwise take its groups."""
    import sys

    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None and getattr(groups, "mpu", None) is mpu:
        groups.mpu = None  # type: ignore[attr-defined]


def zero3_average_over_every_rank(optimizer: Any) -> None:
    """ZeRO-3's optimizer (``DeepSpeedZeroOptimizer_Stage3``) made to average gradients over every rank in each of its
    reduction paths: its ``sequence_parallel_size`` (read at each reduction, 0.16 to 0.19) set to 1."""
    optimizer.sequence_parallel_size = 1


def attention_function(name: str) -> Callable[..., Any]:
    """transformers' registered attention function ``name`` (``"sdpa"``, ``"flash_attention_2"``, ...)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def register_attention_function(name: str, function: Callable[..., Any]) -> None:
    """Register ``function`` as attention implementation ``name`` in transformers (its documented
    ``AttentionInterface.register``); registering it again is harmless."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, function)


def with_attention_implementation(config: Any, name: str) -> Any:
    """``config`` naming attention implementation ``name``; its sub-configs (shared with the original when
    ``config`` is a shallow copy) untouched, as the public setter would change them too."""
    if "_attn_implementation_internal" in vars(config):
        config._attn_implementation_internal = name
    else:  # transformers without the internal field
        config._attn_implementation = name
    return config


# ===================================================================== memory planner (lightning_gaudi_ds.planning)
# TorchDispatchMode (torch.utils._python_dispatch) sees every operator of forward and backward: on CPU, where
# torch keeps no allocator statistics, planning.activations samples the heap after each one.


# ================================================================ Hugging Face transformers (lightning_gaudi_ds.hf)
def hf_deepspeed_config_ref() -> Any:
    """transformers' module-global weak reference to the live ``HfDeepSpeedConfig`` (None when unset)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    return hf_deepspeed._hf_deepspeed_config_weak_ref


@contextlib.contextmanager
def zero_init_paused() -> Iterator[None]:
    """Inside an active ``deepspeed.zero.Init``, modules built here get whole parameters (DeepSpeed's own pause,
    used by ``deepspeed.initialize`` inside Init); nothing changes outside one."""
    from deepspeed.runtime.zero import partition_parameters

    active = partition_parameters.top_level_context is not None
    if active:
        partition_parameters.shutdown_init_context()
    try:
        yield
    finally:
        if active:
            partition_parameters.restore_init_context()


# ------------------------------------------------------------------------------ ckpt_path="last" (resume)
def hook_resume_path(trainer: pl.Trainer, resolve: Callable[[Any], Any]) -> None:
    """Have this Trainer's ``_CheckpointConnector.resume_start(checkpoint_path, weights_only)`` (Lightning 2.6.6:
    where ``_run`` starts restoring, before or after ``strategy.setup``, from the path that ``_parse_ckpt_path``
    made of the user's ``ckpt_path``) restore from ``resolve(checkpoint_path)`` instead. Only this Trainer instance
    changes; hooking it twice does nothing."""
    connector = trainer._checkpoint_connector
    if getattr(connector, "_lgds_resolve", None) is not None:
        return
    original = connector.resume_start

    def resume_start(checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
        original(resolve(checkpoint_path), weights_only=weights_only)

    connector._lgds_resolve = resolve  # type: ignore[attr-defined]
    connector.resume_start = resume_start  # type: ignore[method-assign]


def lightning_last_checkpoint(trainer: pl.Trainer, state_fn: Any) -> Any:
    """What Lightning makes of ``ckpt_path="last"`` (``_CheckpointConnector._parse_ckpt_path``), its message
    included ("there is no last checkpoint available") when there is none."""
    return trainer._checkpoint_connector._parse_ckpt_path(state_fn, "last", True, True)


def hook_sigterm_broadcast(trainer: pl.Trainer, before: Callable[[], None]) -> None:
    """Call ``before()`` at the start of every training batch just before Lightning 2.6.6 broadcasts global rank 0's
    ``trainer.received_sigterm`` to every rank (``_TrainingEpochLoop._broadcast_sigterm_tensor``, only called with
    more than one rank): a flag rank 0 sets there reaches every rank in that broadcast, and Lightning stops them all
    at that batch's start (``SIGTERMException``). Only this Trainer's loop changes; hooking it twice does nothing."""
    loop = trainer.fit_loop.epoch_loop
    if getattr(loop, "_lgds_before_broadcast", None) is not None:
        loop._lgds_before_broadcast = before  # type: ignore[attr-defined]
        return
    original = loop._broadcast_sigterm_tensor
    loop._lgds_before_broadcast = before  # type: ignore[attr-defined]

    def broadcast() -> None:
        loop._lgds_before_broadcast()  # type: ignore[attr-defined]
        original()

    loop._broadcast_sigterm_tensor = broadcast  # type: ignore[method-assign]


def last_checkpoint_candidates(trainer: pl.Trainer) -> set[str]:
    """What Lightning 2.6.6's ``_parse_ckpt_path`` weighs for ``ckpt_path="last"``: every ``OnExceptionCheckpoint``'s
    path and each ``ModelCheckpoint``'s ``last*.ckpt`` in its directory (``_find_last_checkpoints``)."""
    from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

    callbacks: list[Any] = getattr(trainer, "callbacks", [])
    candidates = {getattr(cb, "ckpt_path", None) for cb in callbacks if isinstance(cb, OnExceptionCheckpoint)}
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            candidates |= callback._find_last_checkpoints(trainer)
    return {str(c) for c in candidates if c}


def interrupted_last_checkpoints(trainer: pl.Trainer, suffix: str) -> set[str]:
    """The "last" checkpoints of :func:`last_checkpoint_candidates` that exist only as ``<name><suffix>`` (a save in
    progress or cut short): each ``OnExceptionCheckpoint``'s path, and each name in a ``ModelCheckpoint``'s
    ``dirpath`` that ``_find_last_checkpoints`` would list (``last*.ckpt``, Lightning 2.6.6's pattern) once
    ``suffix`` is taken off. Returns the names, not the ``suffix`` folders."""
    from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

    callbacks: list[Any] = getattr(trainer, "callbacks", [])
    names = {str(cb.ckpt_path) for cb in callbacks if isinstance(cb, OnExceptionCheckpoint) and cb.ckpt_path}
    for callback in trainer.checkpoint_callbacks:
        folder = getattr(callback, "dirpath", None)
        if not (isinstance(callback, ModelCheckpoint) and folder and os.path.isdir(folder)):
            continue
        last = re.compile(rf"^{callback.CHECKPOINT_NAME_LAST}(-(\d+))?")
        for entry in os.listdir(folder):
            name = Path(entry.removesuffix(suffix))
            if entry.endswith(suffix) and name.suffix == callback.FILE_EXTENSION and last.match(name.stem):
                names.add(os.path.normpath(os.path.join(folder, name)))
    return {n for n in names if not os.path.lexists(n) and os.path.isdir(n + suffix)}


def note_sigterm(trainer: pl.Trainer) -> None:
    """Set what ``Trainer.received_sigterm`` reads (``_SignalConnector.received_sigterm``, Lightning 2.6.6), as
    Lightning's own SIGTERM handler does: the loops then stop every rank at the end of the batch."""
    trainer._signal_connector.received_sigterm = True


def handler_before_lightning(trainer: pl.Trainer, signum: int) -> Callable[[int, Any], Any] | None:
    """The handler of ``signum`` before the fit (``_SignalConnector._original_handlers``, Lightning 2.6.6), when it
    is a Python function, as Lightning calls it from its own handler; None for the defaults."""
    handler = trainer._signal_connector._original_handlers.get(signum)
    return handler if callable(handler) else None


# ------------------------------------------------------------------------- mid-epoch resume (data position)
def hook_first_epoch_reset(trainer: pl.Trainer, before: Callable[[], str | None]) -> None:
    """Call ``before()`` once, in this Trainer's next fit, where its first training epoch starts (Lightning 2.6.6:
    ``_TrainingEpochLoop.reset``, after the checkpoint's loop progress was restored and the samplers' epoch set,
    before the first batch is fetched). The warnings of that reset starting with the message ``before`` returns are
    left out. Only this Trainer instance changes; hooking it again replaces ``before``."""
    import warnings

    loop = trainer.fit_loop.epoch_loop
    first = getattr(loop, "_lgds_before_reset", None) is None
    loop._lgds_before_reset = before  # type: ignore[attr-defined]
    if not first:
        return
    original = loop.reset

    def reset() -> None:
        pending, loop._lgds_before_reset = loop._lgds_before_reset, False  # type: ignore[attr-defined]
        silenced = pending() if pending else None
        with warnings.catch_warnings():
            if silenced:
                warnings.filterwarnings("ignore", message=re.escape(silenced))
            original()

    loop.reset = reset  # type: ignore[method-assign]


def train_loaders_built(trainer: pl.Trainer) -> list[Any]:
    """The train loaders of this fit as Lightning 2.6.6 prepared them (``FitLoop._combined_loader.flattened``:
    with its ``DistributedSampler``); empty before ``setup_data``."""
    combined = trainer.fit_loop._combined_loader
    return list(combined.flattened) if combined is not None else []


def restart_train_iterator(trainer: pl.Trainer) -> None:
    """Make the train loaders' iterator again (``iter(FitLoop._data_fetcher)``, as Lightning does for a new epoch):
    ``FitLoop.setup_data`` made it before the checkpoint was restored (DeepSpeed's batch-size probe runs it at
    setup), so a change to the loaders' samplers after that needs a new one."""
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None:
        iter(fetcher)


# ------------------------------------------------------------------------------------------------ ZeRO++
@contextlib.contextmanager
def zero_param_intra_group(size: int, zero_init: bool = False) -> Iterator[None]:
    """DeepSpeed's process-wide hpZ group (``deepspeed.utils.groups._ZERO_PARAM_INTRA_PARALLEL_GROUP``, 0.16.1 and
    0.19.8) made right for one call that builds a ZeRO-3 engine or enters ``zero.Init`` with
    ``zero_hpz_partition_size=size``. DeepSpeed creates that group once per process and then hands it to every later
    ZeRO-3 engine: a second hpZ ``zero.Init`` in the process asserts "already initialized", and a plain ZeRO-3 engine
    after an hpZ one silently runs hpZ. Here a plain engine (``size`` 1) sees no group, an hpZ one reuses the group
    of its size (DeepSpeed creates it where there is none, or one of another size), and the group stays for the
    next hpZ engine. An hpZ ``zero.Init`` (``zero_init``) always creates its group (it takes no existing one), so it
    sees none; the engine built from its model then reuses that new group. The previous group is left to the
    models that hold it."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    name = "_ZERO_PARAM_INTRA_PARALLEL_GROUP"
    current = getattr(groups, name)
    if current is not None:
        try:
            current_size = dist.get_world_size(group=current)
        except (RuntimeError, ValueError):  # its process group was destroyed: DeepSpeed may make a new one
            current, current_size = None, 0
        setattr(groups, name, current if size > 1 and current_size == size and not zero_init else None)
    try:
        yield
    finally:
        made = getattr(groups, name)
        setattr(groups, name, made if size > 1 and made is not None else current)


def runs_quantized_collectives(device_type: str) -> bool:
    """Whether this DeepSpeed runs ZeRO++'s quantized collectives (qwZ ``zero_quantized_weights``, qgZ
    ``zero_quantized_gradients``) on ``device_type``: both load DeepSpeed's ``QuantizerBuilder`` op through the
    device's accelerator (``CUDAQuantizer``, ``all_to_all_quant_reduce``). On CUDA it is DeepSpeed's own op
    (``deepspeed.ops.op_builder.QuantizerBuilder``); the CPU and HPU accelerators take theirs from
    ``deepspeed.ops.op_builder.cpu`` / ``.hpu``, which have none in 0.16.1 and 0.19.8 (their ``NotImplementedBuilder``
    raises "This op had not been implemented on CPU backend." at the first quantized all-gather)."""
    import importlib

    package = {"cuda": "deepspeed.ops.op_builder"}.get(device_type, f"deepspeed.ops.op_builder.{device_type}")
    try:
        module = importlib.import_module(package)
    except ImportError:
        return False
    return hasattr(module, "QuantizerBuilder")


def drop_hpz_secondary_partitions(engine: Any) -> None:
    """After DeepSpeed loaded a checkpoint into a ZeRO-3 engine with hpZ: drop the parameters' secondary partitions
    (``ds_secondary_tensor``), so that the next forward gathers the loaded primary partitions. DeepSpeed 0.16.1 (the
    fork's base) keeps the secondary partitions of the weights from before the load: its ``checkpoint_event_epilogue``
    does not call ``invalidate_secondary_tensor``, which 0.19's does, and the first step after a resume then trains on
    the old weights. Nothing happens without hpZ or a ZeRO-3 optimizer."""
    invalidate = getattr(getattr(engine, "optimizer", None), "invalidate_secondary_tensor", None)
    if callable(invalidate):
        invalidate()
