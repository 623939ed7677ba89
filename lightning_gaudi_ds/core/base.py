"""What the Trainer's and Fabric's ``HPUDeepSpeedStrategy`` share, as one mixin placed before Lightning's
``DeepSpeedStrategy`` (the Trainer's or Fabric's): the arguments taken and checked, the registered names, the checks
before launch, DeepSpeed's accelerator made the strategy's device, the process group (bounded rendezvous, JIT-op
start-up, ended at exit), ``deepspeed.initialize`` with the device rank, the config's resolution from the facts as
values, ``zero_stage``, and ZeRO-3's leaf modules.

Lightning's two ``DeepSpeedStrategy`` classes name what this reads the same way (``root_device``, ranks,
``cluster_environment``, ``config``); their private attributes (``_timeout``, ``_num_nodes``, ``_launcher``) are read
through :mod:`lightning_gaudi_ds._compat`. DeepSpeed is imported inside the methods that use it: importing it picks
DeepSpeed's global accelerator, which must wait until ``setup_environment`` has chosen the device.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.fabric.utilities.seed import reset_seed
from torch.nn import Module

from lightning_gaudi_ds import _compat, hf, hpu
from lightning_gaudi_ds.config import offloads_optimizer, zeropp
from lightning_gaudi_ds.config.resolve import explicit_arguments
from lightning_gaudi_ds.config.state import LossScale, Placement, StrategyConfig
from lightning_gaudi_ds.config.validate import check_arguments, check_before_launch, check_device_indices
from lightning_gaudi_ds.core.options import Options
from lightning_gaudi_ds.devices import DeviceSpec, device_spec
from lightning_gaudi_ds.engine import checkpointing, shutdown
from lightning_gaudi_ds.engine.device import DeviceRuntime, reduce_on_device
from lightning_gaudi_ds.errors import SetupError
from lightning_gaudi_ds.jit_ops.locks import op_cache
from lightning_gaudi_ds.jit_ops.startup import prepare_startup
from lightning_gaudi_ds.launch import envvars
from lightning_gaudi_ds.launch.environments import check_launcher_world_size, launcher_num_nodes, resolve_environment
from lightning_gaudi_ds.launch.rendezvous import bounded_rendezvous, waiting_message
from lightning_gaudi_ds.sequence import SequenceParallel

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from torch import Tensor


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


class DeepSpeedCore:
    """The mixin under both strategies; the class after it in the MRO is Lightning's (or Fabric's)
    ``DeepSpeedStrategy``, whose attributes it reads. Each strategy says what its precision is
    (:attr:`_precision_name`)."""

    # Lightning's DeepSpeedStrategy (Trainer's and Fabric's) provides these.
    if TYPE_CHECKING:
        config: Any
        zero_stage_3: bool
        parallel_devices: list[torch.device] | None
        cluster_environment: ClusterEnvironment | None
        remote_device: str | None
        loss_scale: float
        loss_scale_window: int
        min_loss_scale: int
        initial_scale_power: int
        hysteresis: int
        _process_group_backend: str | None

        @property
        def root_device(self) -> torch.device: ...
        num_nodes: int
        @property
        def num_processes(self) -> int: ...
        @property
        def world_size(self) -> int: ...
        @property
        def global_rank(self) -> int: ...
        @property
        def local_rank(self) -> int: ...
        @property
        def is_global_zero(self) -> bool: ...
        def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    _resolver: StrategyConfig
    _runtime: DeviceRuntime
    _sequence: SequenceParallel
    #: Whether the strategy serves a tensor-parallel model (which sequence parallelism cannot be combined with).
    _serves_tensor_parallel: bool = False

    # ------------------------------------------------------------------------------------------ arguments
    def _check_arguments(self, arguments: dict[str, Any], options: Options) -> None:
        """Before Lightning's ``__init__`` (which loads the config through ``_load_config``): the arguments checked
        (:func:`~lightning_gaudi_ds.config.validate.check_arguments`) and the config's state made.

        ``arguments``: those named like Lightning's ``DeepSpeedStrategy`` arguments (``stage``, ``config``, offload,
        ``remote_device``, ...), the rest by keyword; ``arguments["stage"]`` becomes the stage Lightning builds its
        config with (2, a placeholder until setup, for ``stage="auto"``); ``options``: the package's own."""
        self._options = options
        auto_stage = check_arguments(
            stage=arguments["stage"], hpu_mode=options.hpu_mode, torch_compile=options.torch_compile,
            offload_optimizer=arguments["offload_optimizer"], offload_parameters=arguments["offload_parameters"],
            measure_activations=options.measure_activations, number_checkpoints=options.number_checkpoints,
            remote_device=arguments["remote_device"], device_memory=options.device_memory, config=arguments["config"],
        )
        zeropp.check_argument(options.hpz, arguments["stage"], arguments["config"])
        explicit = explicit_arguments(type(self), {**arguments, "number_checkpoints": options.number_checkpoints})
        if auto_stage is not None:
            arguments["stage"] = 2
            explicit.pop("stage")
        self._resolver = StrategyConfig(explicit, auto_stage, options.hpz)

    def _adopt_arguments(self, *, config: Any, offload_parameters: bool) -> None:
        """After Lightning's ``__init__`` built or loaded the config: the config checked, the device's state made."""
        options = self._options
        assert isinstance(self.config, dict)
        self._resolver.adopt(self.config, user_config=config is not None, offload_parameters=offload_parameters)
        if options.number_checkpoints is not None:
            checkpointing.set_number_checkpoints(self.config, options.number_checkpoints)
        self._runtime = DeviceRuntime(requested_mode=options.hpu_mode, requested_compile=options.torch_compile)
        self._leaf_modules = hf.leaf_module_classes(options.zero3_leaf_modules)
        self._sequence = SequenceParallel.create(options.sequence_parallel_size, options.sequence_parallel_modules,
                                                 self.config, serving=self._serves_tensor_parallel)
        self._resolver.sequence_parallel_size = self._sequence.size

    @property
    def _precision_name(self) -> str:
        """The precision string of the Trainer's precision plugin (or Fabric's precision)."""
        raise NotImplementedError

    @property
    def device_spec(self) -> DeviceSpec:
        """The device-table row of this strategy's root device."""
        return device_spec(self.root_device)

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

    @property
    def sequence_parallel(self) -> SequenceParallel:
        """Sequence parallelism (``sequence_parallel_size``): its size, this rank's groups once started, and
        ``shard(batch)`` for batches the strategy does not see (see :mod:`lightning_gaudi_ds.sequence`)."""
        return self._sequence

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # with sequence parallelism, the K ranks of a group read the same samples
        return self._sequence.sampler_kwargs(super().distributed_sampler_kwargs)  # type: ignore[misc]

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage of the resolved DeepSpeed config (0-3)."""
        assert isinstance(self.config, dict)
        return self._resolver.zero_stage(self.config)

    @classmethod
    def register_strategies(cls, strategy_registry: _compat._StrategyRegistry) -> None:
        """Every name of :data:`REGISTERED` for this class (overriding earlier entries of that name)."""
        for name, description, kwargs in REGISTERED:
            strategy_registry.register(name, cls, description=description, override=True, **kwargs)

    # ------------------------------------------------------------------------- the config, resolved
    def _placement(self) -> Placement:
        devices = self.parallel_devices
        return Placement(device=self.root_device if devices else None, world_size=self.world_size,
                         devices=len(devices) if devices else 0, nodes=self.num_nodes)

    def _resolve_config(self, module: Module | None, precision: str, **facts: Any) -> dict[str, Any]:
        """The config as loaded, every ``"auto"`` filled from ``module``, ``precision``, the devices and ``facts``
        (:meth:`StrategyConfig.resolve_with`)."""
        assert isinstance(self.config, dict)
        loss_scale = LossScale(self.loss_scale, self.loss_scale_window, self.min_loss_scale, self.initial_scale_power,
                               self.hysteresis)
        return self._resolver.resolve_with(self.config, module, precision, self._placement(), loss_scale, **facts)

    def _choose_stage(self, module: Module | None, precision: str) -> None:
        """``stage="auto"``: the configuration chosen for ``module``, agreed on every rank (a no-op otherwise)."""
        assert isinstance(self.config, dict)
        self._resolver.choose(self.config, module, precision, self._placement(), self)

    # ------------------------------------------------------------------------------------- launch
    def _configure_launcher(self) -> None:
        # The Trainer's (Fabric's) constructor, once accelerator and precision are known: checked before any process
        # starts, the Gaudi execution mode fixed and given to the ranks Lightning's launcher starts.
        self._before_launch()
        super()._configure_launcher()  # type: ignore[misc]
        mode = self._runtime.mode
        if mode is not None:
            _compat.start_children_with(_compat.launcher_of(self), lambda: hpu.rank_env(mode))

    def _before_launch(self) -> None:
        assert self.parallel_devices is not None and isinstance(self.config, dict)
        check_before_launch(
            devices=self.parallel_devices, precision=self._precision_name, num_nodes=self.num_nodes,
            cluster_environment=self.cluster_environment, auto_stage=self._resolver.auto, config=self.config,
            config_source=self._resolver.source,
        )
        self._runtime.at_trainer(self.parallel_devices[0].type)
        self._sequence.before_launch(len(self.parallel_devices) * self.num_nodes)

    def _adopt_launcher(self) -> None:
        """Before the ranks are set (the Trainer's constructor calls ``set_world_ranks`` before
        ``_configure_launcher``): adopt DeepSpeed's launcher (Lightning takes it for a single-node launch), take the
        node count of a restart on fewer hosts (``LIGHTNING_GAUDI_DS_NUM_NODES``) over ``num_nodes``, and refuse a
        launcher whose process count disagrees with devices x num_nodes, before anything starts."""
        self.cluster_environment = resolve_environment(self.cluster_environment)
        nodes = launcher_num_nodes(self.num_nodes)
        if nodes != self.num_nodes:  # a restart on fewer hosts (spawn --min_nodes): the launcher's count wins
            rank_zero_info(f"{envvars.NUM_NODES.name}={nodes}: this restart runs on {nodes} node(s), not"
                           f" num_nodes={self.num_nodes}; hosts were left out (spawn --min_nodes).")
            _compat.set_num_nodes(self, nodes)
        if self.parallel_devices is not None:
            check_launcher_world_size(self.cluster_environment, self.num_processes, self.num_nodes)

    # ----------------------------------------------------------------------------- process group
    def _prepare_device(self, set_world_ranks: Callable[[], None]) -> None:
        """In ``setup_environment``, before the process group starts: DeepSpeed's accelerator made the device's, and
        the device prepared; on an HPU, HCCL set up before the device is touched."""
        if not self.parallel_devices:  # Lightning's DDP code would fail on `assert self.parallel_devices`
            raise SetupError(
                f"{type(self).__name__}.setup_environment() found no devices (parallel_devices="
                f"{self.parallel_devices!r}): Fabric and the Trainer set them from `accelerator` and `devices`. Pass"
                " the strategy to Fabric(strategy=...) or Trainer(strategy=...), or set `parallel_devices` (for"
                " example [torch.device('cpu')] * 2) before calling it yourself."
            )
        spec = device_spec(self.root_device)
        self._runtime.before_accelerator_selected(spec.device_type, self.num_processes)
        previous = _compat.set_deepspeed_accelerator(spec.deepspeed_accelerator)
        if previous is not None:
            rank_zero_info(f"DeepSpeed accelerator: {spec.deepspeed_accelerator} (was {previous})")
        self._runtime.after_accelerator_selected(spec.device_type)
        if spec.device_type == "hpu":
            set_world_ranks()
            hpu.init_distributed(self.world_size, self.global_rank, self.local_rank)

    def _start_distributed(self, set_world_ranks: Callable[[], None]) -> None:
        """Lightning's ``setup_distributed`` for DeepSpeed, with the device-index check only where devices have an
        index (CUDA), and the JIT-op start-up on every rank before DeepSpeed builds anything (stale build locks
        cleared; :meth:`_shm_comm` decides whether the CPU shm comm op is loaded)."""
        assert self.parallel_devices is not None
        check_device_indices(self.parallel_devices)
        reset_seed()
        set_world_ranks()
        prepare_startup(device_spec(self.root_device).deepspeed_accelerator, offloads_optimizer(self.config),
                        self.world_size, shm_comm=self._shm_comm(), local_size=self._runtime.local_size)
        with self._runtime.deepspeed_calls():
            self._init_deepspeed_distributed()
        self._sequence.start()  # sequence parallelism: its process groups (a collective)

    def _shm_comm(self) -> str | None:
        """The ``LIGHTNING_GAUDI_DS_SHM_COMM`` mode this run needs; None leaves the user's (or the default)."""
        return None

    def _init_deepspeed_distributed(self) -> None:
        # Lightning's, with the rendezvous bounded by LIGHTNING_GAUDI_DS_RENDEZVOUS_TIMEOUT and announced while it
        # waits (a second node that was never started would otherwise hang silently for the process group's 30
        # minutes); the group's own timeout applies once it has formed. A group this started ends at exit
        # (lightning_gaudi_ds.engine.shutdown), its C++ threads joined before finalization.
        limit = envvars.read(envvars.RENDEZVOUS_TIMEOUT)
        timeout = _compat.process_group_timeout(self)
        env = self.cluster_environment
        assert env is not None
        what = waiting_message(self.global_rank, self.world_size, self.num_nodes, self.num_processes,
                               env.main_address, env.main_port)

        def set_timeout(value: timedelta) -> None:
            _compat.set_process_group_timeout_of(self, value)

        started = not torch.distributed.is_initialized()
        # Announced across nodes only: on one node the other ranks are starting (imports take seconds).
        bounded_rendezvous(super()._init_deepspeed_distributed,  # type: ignore[misc]
                           what, timeout if timeout is not None else default_pg_timeout, set_timeout, limit=limit,
                           announce=self.local_rank == 0 and self.num_nodes > 1)
        shutdown.end_at_exit(started)

    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or self.device_spec.backend

    # ------------------------------------------------------------------------------------------ engine
    def _set_deepspeed_activation_checkpointing(self) -> None:
        # Lightning's drops the number of checkpoints and synchronize_checkpoint_boundary: DeepSpeed reads the section.
        assert isinstance(self.config, dict)
        checkpointing.configure(self.config)

    def _deepspeed_args(self) -> argparse.Namespace:
        """Lightning passes ``root_device.index``, which is None on CPU and HPU; DeepSpeed needs the local rank."""
        index = self.root_device.index
        return argparse.Namespace(device_rank=self.local_rank if index is None else index)

    def _deepspeed_initialize(
        self, model: Module, optimizer: Any, lr_scheduler: Any
    ) -> tuple[DeepSpeedEngine, Any, Any]:
        """``deepspeed.initialize`` -> ``(engine, optimizer, lr_scheduler)``: ZeRO-3's leaf modules marked, a copy of
        the config (DeepSpeed 0.16, Habana's fork, pops keys out of the dict it is
        given), the variables DeepSpeed reads set for the call; the engine compiled if asked."""
        import deepspeed

        self._mark_leaf_modules(model)
        assert isinstance(self.config, dict)
        with self._runtime.deepspeed_calls(), zeropp.engine_group(self.config):  # ZeRO++ hpZ's group, this engine's
            engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
                args=self._deepspeed_args(),
                config=copy.deepcopy(self.config),
                model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad],
                optimizer=optimizer,
                lr_scheduler=lr_scheduler,
                dist_init_required=False,
                mpu=self._sequence.mpu,  # sequence parallelism's groups (None: none)
            )
        self._sequence.engine_ready(engine)  # sequence parallelism: ZeRO-3's gradient average
        _compat.reset_zero3_trace_at_outer_forward_only(engine)
        _compat.complete_zero3_gathers(model)
        _compat.give_bf16_optimizer_zero_grad(ds_optimizer)
        self._runtime.compile_engine(engine)
        return engine, ds_optimizer, ds_scheduler

    def _zero_init_context(self, start: Callable[[], AbstractContextManager[Any]]) -> ExitStack:
        """The base strategy's sharded-construction context (``start``: ZeRO-3's ``zero.Init``) with transformers
        told (:func:`hf.zero3_loading`), entered in the op cache: ``zero.Init`` builds ZeRO-Infinity's NVMe swapper as
        it starts, which loads the async_io and pin_memory ops where the set-up built them (outside it, torch's shared
        default: a JIT build there, and a hang on its lock if that build is killed)."""
        with ExitStack() as stack, op_cache():  # a failing start leaves nothing entered
            stack.enter_context(hf.loading_errors_named())
            config = self.config if self.zero_stage_3 else None
            stack.enter_context(hf.zero3_loading(config))
            with zeropp.engine_group(config, zero_init=True):  # ZeRO++ hpZ: a new group for this zero.Init
                # sequence parallelism: zero.Init given its groups as mpu
                stack.enter_context(self._sequence.sharded_context(start, self.config, self.remote_device,
                                                                   enabled=self.zero_stage_3))
            if self.zero_stage_3:  # gloo: transformers' ZeRO-3 loading gathers whole before rank 0 writes
                _compat.complete_zero3_gathers()
            return stack.pop_all()

    def _mark_leaf_modules(self, model: Module) -> None:
        if self._leaf_modules and self.zero_stage_3:
            hf.mark_leaf_modules(model, self._leaf_modules)
        elif self._leaf_modules and not getattr(self, "_leaf_modules_ignored", False):
            self._leaf_modules_ignored = True
            names = ", ".join(c.__name__ for c in self._leaf_modules)
            rank_zero_warn(f"HPUDeepSpeedStrategy(zero3_leaf_modules=[{names}]) is ignored at ZeRO stage"
                           f" {self.config['zero_optimization']['stage']}: leaf modules matter only under ZeRO-3"
                           " (stage=3), where they are gathered whole. Drop the argument, or run stage 3.")

    def _reduce(self, reduce: Callable[..., Tensor], tensor: Tensor | Any, group: Any | None, reduce_op: Any) -> Tensor:
        """The base strategy's ``reduce`` (Trainer) or ``all_reduce`` (Fabric), as hccl can run it."""
        return reduce_on_device(reduce, self._get_process_group_backend(), self.root_device, self.world_size,
                                tensor, group, reduce_op)

    def teardown(self) -> None:
        super().teardown()  # type: ignore[misc]
        self._runtime.teardown()
        self._sequence.teardown()  # sequence parallelism: the model's attention as it was

