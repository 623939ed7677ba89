"""What a rank does around DeepSpeed, shared by the Trainer strategy and the Fabric strategy: DeepSpeed's accelerator
made the strategy's device, the process group started (bounded rendezvous, JIT-op start-up, ended at exit) and
``deepspeed.initialize`` called with the device rank and a copy of the config.

The functions read plain facts off the strategy (``root_device``, ranks, ``cluster_environment``): both Lightning's
and Fabric's ``DeepSpeedStrategy`` have them under the same names.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from datetime import timedelta
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.fabric.utilities.seed import reset_seed
from torch.nn import Module

from lightning_gaudi_ds import hf, hpu
from lightning_gaudi_ds._compat import (
    give_bf16_optimizer_zero_grad,
    reset_zero3_trace_at_outer_forward_only,
    start_children_with,
)
from lightning_gaudi_ds._compat import set_deepspeed_accelerator as _set_deepspeed_accelerator
from lightning_gaudi_ds.config.state import StrategyConfig
from lightning_gaudi_ds.config.validate import check_before_launch, check_device_indices
from lightning_gaudi_ds.devices import DeviceSpec, device_spec
from lightning_gaudi_ds.engine import checkpointing, shutdown
from lightning_gaudi_ds.engine.device import DeviceRuntime
from lightning_gaudi_ds.jit_ops.locks import op_cache
from lightning_gaudi_ds.jit_ops.startup import prepare_startup
from lightning_gaudi_ds.launch import envvars
from lightning_gaudi_ds.launch.environments import (
    check_launcher_world_size,
    launcher_num_nodes,
    resolve_environment,
)
from lightning_gaudi_ds.launch.rendezvous import bounded_rendezvous, waiting_message
from lightning_gaudi_ds.sequence import SequenceParallel

_P = ParamSpec("_P")
_S = TypeVar("_S")


# (name, description, kwargs): the strategy names both strategies register, as lightning-habana documented them.
REGISTERED: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("hpu_deepspeed", "DeepSpeed (ZeRO stage 2) on HPU, CUDA or CPU", {}),
    ("hpu_deepspeed_stage_1", "DeepSpeed ZeRO stage 1", {"stage": 1}),
    ("hpu_deepspeed_stage_2", "DeepSpeed ZeRO stage 2", {"stage": 2}),
    ("hpu_deepspeed_stage_2_offload", "DeepSpeed ZeRO stage 2, optimizer offloaded to CPU",
     {"stage": 2, "offload_optimizer": True}),
    ("hpu_deepspeed_stage_3", "DeepSpeed ZeRO stage 3", {"stage": 3}),
    ("hpu_deepspeed_stage_3_offload", "DeepSpeed ZeRO stage 3, optimizer and parameters offloaded to CPU",
     {"stage": 3, "offload_optimizer": True, "offload_parameters": True}),
    ("hpu_deepspeed_stage_3_offload_nvme", "DeepSpeed ZeRO stage 3, optimizer and parameters offloaded to NVMe",
     {"stage": 3, "offload_optimizer": True, "offload_parameters": True, "remote_device": "nvme",
      "offload_params_device": "nvme", "offload_optimizer_device": "nvme"}),
)


def register(strategy_cls: type, registry: Any) -> None:
    """Register every name of :data:`REGISTERED` for ``strategy_cls`` (overriding earlier entries of that name)."""
    for name, description, kwargs in REGISTERED:
        registry.register(name, strategy_cls, description=description, override=True, **kwargs)


class _TakesArgumentsOf(Protocol[_P]):
    def __call__(self, init: Callable[Concatenate[_S, ...], None], /) -> Callable[Concatenate[_S, _P], None]: ...


def arguments_of(cls: Callable[_P, Any]) -> _TakesArgumentsOf[_P]:
    """``@arguments_of(Other)`` on an ``__init__(self, *args, **kwargs)``: the arguments of ``Other(...)``, as mypy,
    IDEs and ``inspect.signature`` (through ``__wrapped__``) see them. One typed, documented argument list serves
    both strategies."""

    def decorate(init: Any) -> Any:
        init.__wrapped__ = cls.__init__
        return init

    return decorate


class StrategyCommon:
    """What the Trainer's and Fabric's ``HPUDeepSpeedStrategy`` share of their state, as a mixin before Lightning's
    ``DeepSpeedStrategy``: the config's state (``_resolver``), the device's (``_runtime``) and ZeRO-3's leaf
    modules, set from the arguments once Lightning's ``__init__`` has built or loaded the config."""

    config: Any
    zero_stage_3: bool
    _resolver: StrategyConfig
    _sequence: SequenceParallel

    def _adopt_arguments(
        self, *, config: Any, offload_parameters: bool, number_checkpoints: int | None, hpu_mode: hpu.Mode | None,
        torch_compile: bool | None, zero3_leaf_modules: Sequence[type[Module] | str] | None,
    ) -> None:
        assert isinstance(self.config, dict)
        self._resolver.adopt(self.config, user_config=config is not None, offload_parameters=offload_parameters)
        if number_checkpoints is not None:
            checkpointing.set_number_checkpoints(self.config, number_checkpoints)
        self._runtime = DeviceRuntime(requested_mode=hpu_mode, requested_compile=torch_compile)
        self._leaf_modules = hf.leaf_module_classes(zero3_leaf_modules)

    @property
    def torch_compile(self) -> bool:
        """Whether the engine is compiled after ``deepspeed.initialize`` (see the ``torch_compile`` argument)."""
        return self._runtime.compile

    @property
    def hpu_mode(self) -> hpu.Mode | None:
        """The Gaudi execution mode in force, once the Trainer (or Fabric) chose an HPU."""
        return self._runtime.mode

    @property
    def chosen_configuration(self) -> dict[str, Any] | None:
        """``stage="auto"``: the configuration setup chose (stage, offload), None before or for a fixed stage."""
        return self._resolver.chosen

    def _mark_leaf_modules(self, model: Module) -> None:
        if self._leaf_modules and self.zero_stage_3:
            hf.mark_leaf_modules(model, self._leaf_modules)
        elif self._leaf_modules and not getattr(self, "_leaf_modules_ignored", False):
            self._leaf_modules_ignored = True
            names = ", ".join(c.__name__ for c in self._leaf_modules)
            rank_zero_warn(f"HPUDeepSpeedStrategy(zero3_leaf_modules=[{names}]) is ignored at ZeRO stage"
                           f" {self.config['zero_optimization']['stage']}: leaf modules matter only under ZeRO-3"
                           " (stage=3), where they are gathered whole. Drop the argument, or run stage 3.")

    @property
    def sequence_parallel(self) -> SequenceParallel:
        """Sequence parallelism (``sequence_parallel_size``): its size, this rank's groups once started, and
        ``shard(batch)`` for batches the strategy does not see (see :mod:`lightning_gaudi_ds.sequence`)."""
        return self._sequence

    def teardown(self) -> None:
        super().teardown()  # type: ignore[misc]
        self._runtime.teardown()
        self._sequence.teardown()  # sequence parallelism: the model's attention as it was


def zero_init_context(config: dict[str, Any] | None, start: Callable[[], AbstractContextManager[Any]]) -> ExitStack:
    """The base strategy's sharded-construction context (``start``: ZeRO-3's ``zero.Init``) with transformers told
    (:func:`hf.zero3_loading`; ``config`` None below ZeRO-3), entered in the op cache: ``zero.Init`` builds
    ZeRO-Infinity's NVMe swapper as it starts, which loads the async_io and pin_memory ops where the set-up built
    them (outside it, torch's shared default: a JIT build there, and a hang on its lock if that build is killed)."""
    with ExitStack() as stack, op_cache():  # a failing start leaves nothing entered
        stack.enter_context(hf.loading_errors_named())
        stack.enter_context(hf.zero3_loading(config))
        stack.enter_context(start())
        return stack.pop_all()


def adopt_launcher(strategy: Any) -> None:
    """In ``set_world_ranks``, which the Trainer's constructor calls before ``_configure_launcher``: adopt DeepSpeed's
    launcher (Lightning takes it for a single-node launch), take the node count of a restart on fewer hosts
    (``LIGHTNING_GAUDI_DS_NUM_NODES``) over ``num_nodes``, and refuse a launcher whose process count disagrees with
    devices x num_nodes, before anything starts."""
    strategy.cluster_environment = resolve_environment(strategy.cluster_environment)
    nodes = launcher_num_nodes(strategy.num_nodes)
    if nodes != strategy.num_nodes:  # a restart on fewer hosts (spawn --min_nodes): the launcher's count wins
        rank_zero_info(f"{envvars.NUM_NODES.name}={nodes}: this restart runs on {nodes} node(s), not"
                       f" num_nodes={strategy.num_nodes}; hosts were left out (spawn --min_nodes).")
        strategy._num_nodes = nodes
    if strategy.parallel_devices is not None:
        check_launcher_world_size(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)


def before_launch(strategy: Any, runtime: DeviceRuntime, resolver: StrategyConfig, precision: str) -> None:
    """Once accelerator and precision are known (the Trainer's or Fabric's constructor, in ``_configure_launcher``),
    before any process is started: the checks of :func:`~lightning_gaudi_ds.config.validate.check_before_launch`,
    and the Gaudi execution mode fixed (see :meth:`DeviceRuntime.at_trainer`)."""
    assert strategy.parallel_devices is not None and isinstance(strategy.config, dict)
    check_before_launch(
        devices=strategy.parallel_devices, precision=precision, num_nodes=strategy.num_nodes,
        cluster_environment=strategy.cluster_environment, auto_stage=resolver.auto, config=strategy.config,
        config_source=resolver.source,
    )
    runtime.at_trainer(strategy.parallel_devices[0].type)


def after_launcher(launcher: Any, runtime: DeviceRuntime) -> None:
    """On an HPU, the ranks Lightning's (or Fabric's) launcher starts get the execution mode and the Gaudi defaults."""
    mode = runtime.mode
    if mode is not None:
        start_children_with(launcher, lambda: hpu.rank_env(mode))


def set_deepspeed_accelerator(spec: DeviceSpec) -> None:
    """Make DeepSpeed's global accelerator match the strategy's device (DS_ACCELERATOR may differ)."""
    previous = _set_deepspeed_accelerator(spec.deepspeed_accelerator)
    if previous is not None:
        rank_zero_info(f"DeepSpeed accelerator: {spec.deepspeed_accelerator} (was {previous})")


def prepare_device(
    strategy: Any, runtime: DeviceRuntime, select: Callable[[DeviceSpec], None], set_world_ranks: Callable[[], None]
) -> None:
    """In ``setup_environment``, before the process group starts: DeepSpeed's accelerator selected (``select``) and
    the device prepared; on an HPU, HCCL set up before the device is touched."""
    if not strategy.parallel_devices:  # Lightning's DDP code would fail on `assert self.parallel_devices`
        raise RuntimeError(
            f"{type(strategy).__name__}.setup_environment() found no devices (parallel_devices="
            f"{strategy.parallel_devices!r}): Fabric and the Trainer set them from `accelerator` and `devices`. Pass"
            " the strategy to Fabric(strategy=...) or Trainer(strategy=...), or set `parallel_devices` (for example"
            " [torch.device('cpu')] * 2) before calling it yourself."
        )
    spec = device_spec(strategy.root_device)
    runtime.before_accelerator_selected(spec.device_type, strategy.num_processes)
    select(spec)
    runtime.after_accelerator_selected(spec.device_type)
    if spec.device_type == "hpu":
        set_world_ranks()
        hpu.init_distributed(strategy.world_size, strategy.global_rank, strategy.local_rank)


def start_distributed(
    strategy: Any, runtime: DeviceRuntime, *, set_world_ranks: Callable[[], None], init: Callable[[], None],
    offload: bool, shm_comm: Any,
) -> None:
    """Lightning's ``setup_distributed`` for DeepSpeed, with the device-index check only where devices have an
    index (CUDA), and the JIT-op start-up on every rank before DeepSpeed builds anything (stale build locks cleared;
    ``shm_comm``: whether the CPU shm comm op is loaded). ``init`` starts the process group."""
    assert strategy.parallel_devices is not None
    check_device_indices(strategy.parallel_devices)
    reset_seed()
    set_world_ranks()
    prepare_startup(device_spec(strategy.root_device).deepspeed_accelerator, offload, strategy.world_size,
                    shm_comm=shm_comm, local_size=runtime.local_size)
    with runtime.deepspeed_calls():
        init()


def bounded_init(strategy: Any, init: Callable[[], None]) -> None:
    """Lightning's ``_init_deepspeed_distributed`` (``init``), with the rendezvous bounded by
    LIGHTNING_GAUDI_DS_RENDEZVOUS_TIMEOUT and announced while it waits (a second node that was never started would
    otherwise hang silently for the process group's 30 minutes); the group's own timeout applies once it has formed.
    A group this started ends at interpreter exit (:mod:`lightning_gaudi_ds.engine.shutdown`)."""
    limit = envvars.read(envvars.RENDEZVOUS_TIMEOUT)
    full = strategy._timeout if strategy._timeout is not None else default_pg_timeout
    env = strategy.cluster_environment
    assert env is not None
    what = waiting_message(strategy.global_rank, strategy.world_size, strategy.num_nodes, strategy.num_processes,
                           env.main_address, env.main_port)

    def set_timeout(timeout: timedelta) -> None:
        strategy._timeout = timeout

    # Announced across nodes only: on one node the other ranks are starting (imports take seconds).
    started = not torch.distributed.is_initialized()
    bounded_rendezvous(init, what, full, set_timeout, limit=limit,
                       announce=strategy.local_rank == 0 and strategy.num_nodes > 1)
    shutdown.end_at_exit(started)  # ours ends at exit, its C++ threads joined before finalization


def deepspeed_args(root_device: torch.device, local_rank: int) -> argparse.Namespace:
    """Lightning passes ``root_device.index``, which is None on CPU and HPU; DeepSpeed needs the local rank."""
    index = root_device.index
    return argparse.Namespace(device_rank=local_rank if index is None else index)


def initialize(
    strategy: Any, args: argparse.Namespace, model: Module, optimizer: Any, lr_scheduler: Any
) -> tuple[Any, Any, Any]:
    """``deepspeed.initialize`` for ``strategy`` -> ``(engine, optimizer, lr_scheduler)``: ZeRO-3's leaf modules
    marked, a copy of its config (DeepSpeed 0.16, Habana's fork, pops keys out of the dict it is given) and the
    variables DeepSpeed reads set for the call; sequence parallelism's groups as its ``mpu``."""
    import deepspeed

    strategy._mark_leaf_modules(model)
    assert isinstance(strategy.config, dict)
    with strategy._runtime.deepspeed_calls():
        engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
            args=args,
            config=copy.deepcopy(strategy.config),
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
            mpu=strategy._sequence.mpu,  # sequence parallelism's groups (None: none)
        )
    strategy._sequence.engine_ready(engine)  # sequence parallelism: ZeRO-3's gradient average
    reset_zero3_trace_at_outer_forward_only(engine)
    give_bf16_optimizer_zero_grad(ds_optimizer)
    return engine, ds_optimizer, ds_scheduler
