"""What a strategy does for sequence parallelism, as one object with an entry point per hook: the Trainer's and
Fabric's ``HPUDeepSpeedStrategy`` each hold one (``strategy.sequence_parallel``) and call it; with
``sequence_parallel_size=1`` every entry point gives its input back.

=============================  ==================================================================================
entry point                    where the strategy calls it
=============================  ==================================================================================
``SequenceParallel.create``    ``__init__``: the argument and the config's ``sequence_parallel_size`` checked
``before_launch``              once the world size is known, before any process starts
``start``                      after the process group started: the groups built (collective)
``check_trainer``              at set-up: ``trainer.predict`` refused
``sampler_kwargs``             ``distributed_sampler_kwargs``: the loader's replicas are the ``world / K`` groups
``sharded_context``            ZeRO-3's ``model_sharded_context`` / ``module_sharded_context``: ``zero.Init(mpu=...)``
``wrap`` / ``unwrap``          before ``deepspeed.initialize`` / at teardown: the model's attention (and loss)
``mpu``                        ``deepspeed.initialize(mpu=...)`` (engine/process.py)
``engine_ready``               after ``deepspeed.initialize``: ZeRO-3's gradient average
``shard``                      each batch (the Trainer's ``batch_to_device``)
``process_dataloader``         Fabric's ``setup_dataloaders``: loaders whose batches come split
``teardown``                   the strategy's teardown
=============================  ==================================================================================
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.nn import Module

from lightning_gaudi_ds import _compat
from lightning_gaudi_ds.errors import ConfigError
from lightning_gaudi_ds.sequence import attention, hf
from lightning_gaudi_ds.sequence.batch import shard_batch
from lightning_gaudi_ds.sequence.groups import ParallelUnit, SequenceGroups

CONFIG_KEY = "sequence_parallel_size"  # DeepSpeed's own config key, read as the argument

_active: list[SequenceParallel] = []  # the set-up strategies' (causal_lm_loss finds its group here)


def active_groups() -> SequenceGroups | None:
    """The sequence-parallel groups of the strategy whose model is set up in this process (None: none is)."""
    return _active[-1].groups if _active else None


class SequenceParallel:
    """One strategy's sequence parallelism: ``size`` ranks per sequence (1: none), the user's own attention module
    classes, and once started, this rank's groups."""

    def __init__(self, size: int = 1, modules: tuple[type[Module], ...] = ()) -> None:
        self.size = size
        self.modules = modules
        self.groups: SequenceGroups | None = None
        self.mpu: ParallelUnit | None = None
        self._wrapped: list[Any] = []

    @classmethod
    def create(cls, size: Any, modules: Sequence[type[Module] | str] | type[Module] | str | None,
               config: Mapping[str, Any] | None, *, serving: bool = False) -> SequenceParallel:
        """``HPUDeepSpeedStrategy(sequence_parallel_size=size, sequence_parallel_modules=modules)`` with the
        strategy's loaded ``config`` (whose ``sequence_parallel_size`` counts as the argument); ``serving``: the
        strategy was given tensor-parallel serving arguments."""
        value = _checked_size(size, "HPUDeepSpeedStrategy(sequence_parallel_size={!r})")
        in_config = (config or {}).get(CONFIG_KEY)
        if in_config is not None:
            in_config = _checked_size(in_config, f'the DeepSpeed config\'s "{CONFIG_KEY}": {{!r}}')
            if value is not None and value != in_config:
                raise ConfigError(
                    f"HPUDeepSpeedStrategy(sequence_parallel_size={value}) and the DeepSpeed config's"
                    f' "{CONFIG_KEY}": {in_config} disagree; set one of them.'
                )
        resolved = value or in_config or 1
        classes = attention.module_classes(modules)
        if classes and resolved == 1:
            rank_zero_info("HPUDeepSpeedStrategy(sequence_parallel_modules=...) is ignored with"
                           " sequence_parallel_size=1: every rank attends over its whole sequences.")
        if resolved > 1 and serving:
            raise ConfigError(
                f"HPUDeepSpeedStrategy(sequence_parallel_size={resolved}) with tensor-parallel serving"
                " (tensor_parallel=..., dtype=..., ...): the two split the model in different ways and cannot be"
                " combined. Serve with tensor_parallel and sequence_parallel_size=1, or train with"
                " sequence_parallel_size and no serving arguments."
            )
        return cls(resolved, classes)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    # ------------------------------------------------------------------------------ before any process starts
    def before_launch(self, world_size: int) -> None:
        """Refuse a world ``size`` does not divide, or a DeepSpeed without Ulysses' attention."""
        if not self.enabled:
            return
        if world_size % self.size:
            fits = [k for k in range(2, world_size + 1) if world_size % k == 0]
            raise ConfigError(
                f"HPUDeepSpeedStrategy(sequence_parallel_size={self.size}) does not divide the {world_size}"
                f" processes (devices x num_nodes): each sequence is shared by {self.size} ranks. Use a size that"
                f" divides {world_size} ({', '.join(map(str, fits)) or 'none above 1'}), or change devices."
            )
        missing = _compat.ulysses_missing()
        if missing:
            raise ConfigError(
                f"HPUDeepSpeedStrategy(sequence_parallel_size={self.size}) needs DeepSpeed's Ulysses attention"
                f" (deepspeed.sequence.layer.DistributedAttention), which this DeepSpeed lacks ({missing}). Install"
                " DeepSpeed 0.16 or later (Habana's fork 1.20 or later on Gaudi)."
            )

    def data_parallel_size(self, world_size: int) -> int:
        """The number of sequences trained at once (``world_size / K``): DeepSpeed's data-parallel size."""
        return max(1, world_size // self.size)

    # --------------------------------------------------------------------------------- the process group
    def start(self) -> None:
        """Build this rank's groups (every rank calls it once the default process group exists)."""
        if not self.enabled or self.groups is not None:
            return
        _compat.reset_autotp_kv_heads()
        self.groups = SequenceGroups.build(self.size)
        self.mpu = ParallelUnit(self.groups)

    def check_trainer(self, trainer: Any) -> None:
        """``trainer.predict`` would return each rank's part of every sequence: refused, naming what to do."""
        if not self.enabled or trainer is None:
            return
        from lightning.pytorch.trainer.states import TrainerFn

        if trainer.state.fn == TrainerFn.PREDICTING:
            raise ConfigError(
                f"trainer.predict with HPUDeepSpeedStrategy(sequence_parallel_size={self.size}): each rank would"
                f" return 1/{self.size} of every sequence's outputs. Predict with sequence_parallel_size=1 (the"
                " checkpoint loads at any size) or serve with tensor_parallel={'tp_size': N}; fit, validate and test"
                " run sequence-parallel."
            )

    def sampler_kwargs(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The distributed sampler's ``num_replicas`` and ``rank``: the ``K`` ranks of a group read the same
        samples."""
        if not self.enabled:
            return dict(kwargs)
        return {**kwargs, "num_replicas": kwargs["num_replicas"] // self.size, "rank": kwargs["rank"] // self.size}

    # ------------------------------------------------------------------------------------- the model
    def wrap(self, model: Module) -> None:
        """Put Ulysses' exchange around the attention of ``model`` (its Hugging Face models' and the modules of
        ``sequence_parallel_modules``); a model whose attention cannot be found is refused."""
        if not self.enabled or self._wrapped:
            return
        assert self.groups is not None, "SequenceParallel.start() runs before wrap()"
        exchange = attention.Exchange(self.groups)
        wrapped: list[Any] = []
        if self.modules:
            modules = attention.find_modules(model, self.modules)
            attention.check_declared_heads(modules, self.size)
            wrapped.append(attention.WrappedModules(modules, exchange))
        for hf_model in hf.transformers_models(model):
            if self.modules and any(isinstance(m, self.modules) for m in hf_model.modules()):
                continue  # the user named its attention modules
            modules = hf.check_model(hf_model, self.size)
            wrapped.append(hf.WrappedModel(hf_model, modules, exchange, self.groups.rank))
        if not wrapped:
            raise ConfigError(
                f"HPUDeepSpeedStrategy(sequence_parallel_size={self.size}): {type(model).__name__} has no Hugging Face"
                " model whose attention sequence parallelism knows, and no sequence_parallel_modules were given. Name"
                " your attention modules: HPUDeepSpeedStrategy(sequence_parallel_modules=[MyAttention]), whose"
                " forward takes query, key and value (batch, heads, sequence, head size) first."
            )
        self._wrapped = wrapped
        _active.append(self)

    def unwrap(self) -> None:
        for wrapped in self._wrapped:
            wrapped.unwrap()
        self._wrapped = []
        if self in _active:
            _active.remove(self)

    def engine_ready(self, engine: Any) -> None:
        """After ``deepspeed.initialize``. ZeRO-3 reduce-scatters some gradient buckets averaging over every rank,
        ignoring sequence parallelism, and others over ``world / K`` (DeepSpeed 0.16 to 0.19): its engine is made to
        average every bucket over every rank, and each rank's part of the loss back-propagates ``K`` times its
        gradient, which comes to the average over the ``world / K`` sequences in both."""
        if not self.enabled or self.groups is None:
            return
        stage3 = int(engine.zero_optimization_stage()) == 3 and engine.optimizer is not None
        self.groups.gradient_scale = float(self.size) if stage3 else 1.0
        if stage3:
            _compat.zero3_average_over_every_rank(engine.optimizer)

    def sharded_context(self, start: Callable[[], AbstractContextManager[Any]], config: Any, remote_device: Any,
                        *, enabled: bool) -> AbstractContextManager[Any]:
        """ZeRO-3's partitioned construction (``enabled``: at stage 3): the base strategy's (``start``), or with
        sequence parallelism Lightning's ``deepspeed.zero.Init`` given the ``mpu`` as well (its config's batch sizes
        count ``world / K`` ranks, which DeepSpeed checks)."""
        if not enabled or not self.enabled or self.mpu is None:
            return start()
        return _zero_init(config, remote_device, self.mpu)

    # ------------------------------------------------------------------------------------- batches
    def shard(self, batch: Any) -> Any:
        """This rank's part of every sequence of ``batch``."""
        if not self.enabled:
            return batch
        assert self.groups is not None
        return shard_batch(batch, self.size, self.groups.rank)

    def process_dataloader(self, dataloader: Any) -> Any:
        """Fabric's loaders: one that yields each batch already split (its attributes are the loader's)."""
        if not self.enabled:
            return dataloader
        return sharding_loader(dataloader, self.shard)

    # ------------------------------------------------------------------------------------- the end
    def teardown(self) -> None:
        """The model's attention as it was, and DeepSpeed's module-global ``groups.mpu`` (which the engine set to
        this ``mpu``) cleared: a later engine without sequence parallelism in this process must not find it."""
        self.unwrap()
        if self.mpu is not None:
            _compat.forget_mpu(self.mpu)


@contextlib.contextmanager
def _zero_init(config: Any, remote_device: Any, mpu: ParallelUnit) -> Iterator[None]:
    import deepspeed

    with deepspeed.zero.Init(enabled=True, remote_device=remote_device, config_dict_or_path=config, mpu=mpu):
        yield


def sharding_loader(dataloader: Any, shard: Callable[[Any], Any]) -> Any:
    """A copy of ``dataloader`` whose iteration yields each batch through ``shard``: an instance of a subclass of
    its class, sharing its attributes (``dataset``, ``sampler``, ``batch_size``, ... as Fabric and user code read
    them)."""
    cls = type(dataloader)
    sharded = copy.copy(dataloader)
    sharded.__class__ = _SHARDING_CLASSES.get(cls) or _SHARDING_CLASSES.setdefault(cls, type(
        f"Sharding{cls.__name__}", (cls,), {"__iter__": _sharded_iter, "__module__": __name__}))
    sharded.__dict__[_SHARD] = shard
    return sharded


_SHARD = "_lightning_gaudi_ds_shard"
_SHARDING_CLASSES: dict[type, type] = {}


def _sharded_iter(self: Any) -> Iterator[Any]:
    shard = self.__dict__[_SHARD]
    for batch in super(type(self), self).__iter__():
        yield shard(batch)


def _checked_size(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where.format(value)}: pass the number of ranks that share each sequence, a whole number"
                          " >= 1 (1: no sequence parallelism), dividing devices x num_nodes.")
    return value
