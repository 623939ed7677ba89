"""Inference engines: tensor parallelism with DeepSpeed's inference engine (``deepspeed.init_inference``), and
the optimizer-less ZeRO engine Lightning evaluates with otherwise (:func:`init_zero_engine`).

``trainer.predict`` / ``validate`` / ``test`` with ``HPUDeepSpeedStrategy(tensor_parallel={"tp_size": N})``: the
module's large matrices are split across N ranks (DeepSpeed's AutoTP for model families it knows, such as Hugging
Face Llama; an ``injection_policy`` for the user's own modules). Every rank of a tensor-parallel group computes the
same outputs, so the ranks of a group must see the same batches; with tp_size below the world size the groups
(consecutive ranks) are data-parallel replicas.

Everything here works on plain values (settings, a module, a world size, a precision string); the strategy gathers
them and calls in. Errors are :class:`~lightning_gaudi_ds.errors.ConfigError` (Lightning's
``MisconfigurationException``) and name the argument to change.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn import Module

from lightning_gaudi_ds._classes import import_class
from lightning_gaudi_ds._compat import (
    autotp_parse,
    autotp_policy_names,
    complete_zero3_gathers,
    lm_head_allreduce,
    model_states_name,
    remove_module_hooks,
    reset_zero3_trace_at_outer_forward_only,
    tensor_parallel_config_keys,
    tensor_parallel_layer_class,
)
from lightning_gaudi_ds.checkpoint import io as ckpt_io
from lightning_gaudi_ds.checkpoint.read import read_full_checkpoint
from lightning_gaudi_ds.config import zeropp
from lightning_gaudi_ds.errors import CheckpointNotFoundError, ConfigError
from lightning_gaudi_ds.precisions import PRECISION_DTYPES

#: Keyword arguments of ``HPUDeepSpeedStrategy`` (and keys of its config dict) that select DeepSpeed's inference
#: engine, as lightning-habana named them.
INFERENCE_KEYS = (
    "tensor_parallel",
    "dtype",
    "replace_with_kernel_inject",
    "injection_policy",
    "replace_method",
    "enable_cuda_graph",
)
# DeepSpeedTPConfig fields the strategy builds (the groups); the user may set the others.
_TP_BUILT = ("tp_group", "mpu")
_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32, "32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "16": torch.float16,
}
_PRECISION_DTYPES: dict[str, torch.dtype] = {
    "32": torch.float32, **{precision: getattr(torch, name) for precision, name in PRECISION_DTYPES.items()},
}
InjectionPolicy = dict[type, tuple[str, ...]]
_EXAMPLE_POLICY = 'injection_policy={Block: ("attn.proj", "mlp.2")}'


@dataclasses.dataclass(frozen=True)
class InferenceSettings:
    """What the user asked of DeepSpeed's inference engine, validated (``None``: not given)."""

    tp_size: int = 1
    tp_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    dtype: torch.dtype | None = None
    replace_with_kernel_inject: bool = False
    injection_policy: InjectionPolicy | None = None
    replace_method: str | None = None
    enable_cuda_graph: bool = False

    @property
    def tensor_parallel(self) -> bool:
        return self.tp_size > 1


# ------------------------------------------------------------------------------------------------ parsing
def split_config(config: Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """``(config without the inference keys, the inference keys)``: the rest is a DeepSpeed training config."""
    if config is None:
        return None, {}
    rest = {k: v for k, v in config.items() if k not in INFERENCE_KEYS}
    return rest, {k: config[k] for k in INFERENCE_KEYS if k in config}


def serving_requested(arguments: Mapping[str, Any]) -> bool:
    """Whether a strategy's keyword ``arguments`` configure DeepSpeed's inference engine: one of its arguments given,
    or one of its keys in the DeepSpeed config (``config``, else ``PL_DEEPSPEED_CONFIG_PATH``)."""
    if any(arguments.get(key) is not None for key in INFERENCE_KEYS):
        return True
    from lightning_gaudi_ds.config import load_config

    config = load_config(arguments.get("config"))[0]
    return config is not None and any(key in config for key in INFERENCE_KEYS)


def settings_from(args: Mapping[str, Any], config_part: Mapping[str, Any]) -> InferenceSettings | None:
    """Merge the strategy's keyword arguments with the same keys from its config; ``None`` if neither sets any.

    A key given in both places with different values is a contradiction: all of them are reported in one error.
    """
    given = {k: v for k, v in args.items() if k in INFERENCE_KEYS and v is not None}
    clashes = [
        f"{key}: argument {given[key]!r}, config {config_part[key]!r}"
        for key in INFERENCE_KEYS
        if key in given and key in config_part and not _same_setting(key, given[key], config_part[key])
    ]
    if clashes:
        raise ConfigError(
            "HPUDeepSpeedStrategy: the inference settings contradict the DeepSpeed config:\n  "
            + "\n  ".join(clashes) + "\nSet each in one place (argument or config), or give both the same value."
        )
    merged = {**config_part, **given}
    if not merged:
        return None
    tp = _tensor_parallel(merged.get("tensor_parallel"))
    dtype = parse_dtype(merged["dtype"], "dtype") if merged.get("dtype") is not None else None
    policy = parse_injection_policy(merged.get("injection_policy"))
    kernel_inject = _flag(merged, "replace_with_kernel_inject")
    if policy and kernel_inject:
        raise ConfigError(
            "HPUDeepSpeedStrategy: `injection_policy` and `replace_with_kernel_inject=True` exclude each other"
            " (DeepSpeed either splits your modules with the policy or swaps in its own fused kernels)."
            " Drop one of them."
        )
    replace_method = merged.get("replace_method")
    if replace_method not in (None, "auto"):
        raise ConfigError(
            f"HPUDeepSpeedStrategy(replace_method={replace_method!r}): DeepSpeed only knows 'auto' (and no longer"
            " needs it). Remove the argument."
        )
    return InferenceSettings(
        tp_size=tp.pop("tp_size", 1),
        tp_options=tp,
        dtype=dtype,
        replace_with_kernel_inject=kernel_inject,
        injection_policy=policy,
        replace_method=replace_method,
        enable_cuda_graph=_flag(merged, "enable_cuda_graph"),
    )


def _same_setting(key: str, a: Any, b: Any) -> bool:
    try:
        if key == "dtype":
            return parse_dtype(a, key) == parse_dtype(b, key)
        if key == "injection_policy":
            return parse_injection_policy(a) == parse_injection_policy(b)
        if key == "tensor_parallel":
            return _tensor_parallel(a) == _tensor_parallel(b)
    except ConfigError:
        return False
    return bool(a == b)


def _flag(settings: Mapping[str, Any], key: str) -> bool:
    value = settings.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"HPUDeepSpeedStrategy({key}={value!r}): expected True or False.")
    return value


def _tensor_parallel(value: Any) -> dict[str, Any]:
    if value is None:
        return {"tp_size": 1}
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"HPUDeepSpeedStrategy(tensor_parallel={value!r}): expected a dict such as {{'tp_size': 2}}."
        )
    allowed = [k for k in tensor_parallel_config_keys() if k not in _TP_BUILT]
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        from lightning_gaudi_ds._compat import deepspeed_version

        raise ConfigError(
            f"HPUDeepSpeedStrategy(tensor_parallel={dict(value)!r}): unknown key(s) {unknown}; DeepSpeed"
            f" {deepspeed_version()} allows: {', '.join(allowed)}. The tensor-parallel groups are built by the"
            " strategy (consecutive ranks)."
        )
    size = value.get("tp_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(
            f"HPUDeepSpeedStrategy(tensor_parallel={{'tp_size': {size!r}}}): tp_size must be a positive integer"
            " (the number of ranks each model is split across)."
        )
    if value.get("enabled") is False:
        size = 1
    return {**{k: v for k, v in value.items() if k != "enabled"}, "tp_size": size}


def parse_dtype(value: Any, where: str = "dtype") -> torch.dtype:
    """A ``torch.dtype`` from a dtype or its name (``"bf16"``, ``"torch.bfloat16"``, ``"fp32"``, ...)."""
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str) and value.lower().removeprefix("torch.") in _DTYPES:
        dtype = _DTYPES[value.lower().removeprefix("torch.")]
    else:
        dtype = None
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(
            f"HPUDeepSpeedStrategy({where}={value!r}): not a dtype tensor-parallel inference runs in. Allowed:"
            " torch.float32, torch.bfloat16, torch.float16 (or 'fp32', 'bf16', 'fp16')."
        )
    return dtype


def parse_injection_policy(value: Any) -> InjectionPolicy | None:
    """``{module class: (names of the linear layers whose outputs are all-reduced, ...)}``.

    A class may be given as a dotted import path (``"my_pkg.model.Block"``) so that the policy can live in a YAML
    or JSON config; a single layer name may be a string.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping) or not value:
        raise ConfigError(
            f"HPUDeepSpeedStrategy(injection_policy={value!r}): expected a non-empty dict mapping a module class"
            f" (or its import path) to the names of its row-parallel linear layers, e.g. {_EXAMPLE_POLICY}."
        )
    policy: InjectionPolicy = {}
    for key, names in value.items():
        cls = import_class(key, "injection_policy=...") if isinstance(key, str) else key
        if not (isinstance(cls, type) and issubclass(cls, Module)):
            raise ConfigError(
                f"HPUDeepSpeedStrategy(injection_policy=...): key {key!r} is not a torch.nn.Module subclass."
            )
        layer_names = (names,) if isinstance(names, str) else tuple(names or ())
        if not layer_names or not all(isinstance(n, str) and n for n in layer_names):
            raise ConfigError(
                f"HPUDeepSpeedStrategy(injection_policy=...): {cls.__name__} maps to {names!r}; expected the names"
                f" of linear layers inside it (a string or a list of strings), e.g. {_EXAMPLE_POLICY}."
            )
        policy[cls] = layer_names
    return policy


# ------------------------------------------------------------------------------------------ validation
def serving_settings(
    args: Mapping[str, Any], config_part: Mapping[str, Any], zero_args: Mapping[str, Any], config: Any
) -> InferenceSettings | None:
    """:func:`settings_from`, checked against the strategy's ZeRO arguments (``zero_args``) and ``config``."""
    settings = settings_from(args, config_part)
    if settings is not None:
        check_zero_options(settings, zero_args, config)
    return settings


def before_launch(
    settings: InferenceSettings | None, devices: Sequence[torch.device], num_nodes: int, precision: str
) -> torch.dtype | None:
    """Before any process starts: the world checked against ``tp_size``; the engine's dtype (None: no engine)."""
    if settings is None:
        return None
    check_world(settings, len(devices) * num_nodes, devices[0].type)
    return resolve_dtype(settings, precision)


def check_zero_options(settings: InferenceSettings, explicit_args: Mapping[str, Any], config: Any) -> None:
    """ZeRO settings that cannot apply to a tensor-parallel model (which must be built whole, then split)."""
    if not settings.tensor_parallel:
        return
    problems = [
        f"{name}={explicit_args[name]!r}"
        for name in ("offload_optimizer", "offload_parameters", "remote_device")
        if explicit_args.get(name)
    ]
    if explicit_args.get("stage") in (3, "auto"):
        problems.append(f"stage={explicit_args['stage']!r}")
    zero = config.get("zero_optimization") if isinstance(config, Mapping) else None
    if isinstance(zero, Mapping) and explicit_args.get("config") is not None:
        if zero.get("stage") == 3:
            problems.append('config "zero_optimization.stage": 3')
        problems += [f'config "zero_optimization.{k}"' for k in ("offload_param", "offload_optimizer") if zero.get(k)]
    if problems:
        raise ConfigError(
            f"HPUDeepSpeedStrategy(tensor_parallel={{'tp_size': {settings.tp_size}}}) serves a model split by"
            f" DeepSpeed's inference engine, which ZeRO's {', '.join(problems)} cannot apply to (ZeRO-3 and offload"
            " partition the parameters of a model being trained). Remove them for inference; weights trained with"
            " any ZeRO stage load through `ckpt_path=`."
        )


def resolve_dtype(settings: InferenceSettings, precision: str) -> torch.dtype:
    """The engine's dtype: the Trainer's precision, or ``dtype`` when it agrees with it."""
    trainer_dtype = _PRECISION_DTYPES.get(str(precision))
    if trainer_dtype is None:
        raise ConfigError(
            f"Tensor-parallel inference runs in fp32, bf16 or fp16; Trainer(precision={precision!r}) is none of"
            f" them. Use one of {', '.join(repr(p) for p in _PRECISION_DTYPES if '-' in p)}."
        )
    if settings.dtype is not None and settings.dtype != trainer_dtype:
        names = {torch.float32: "32-true", torch.bfloat16: "bf16-true", torch.float16: "16-true"}
        raise ConfigError(
            f"HPUDeepSpeedStrategy(dtype={settings.dtype}) contradicts Trainer(precision={precision!r}), which"
            f" casts every batch to {trainer_dtype}. Drop `dtype` (the precision decides), or use"
            f" Trainer(precision={names[settings.dtype]!r})."
        )
    return trainer_dtype


def check_world(settings: InferenceSettings, world_size: int, device_type: str) -> None:
    """tp_size against the processes the Trainer will start, and device-specific options; before any starts."""
    tp = settings.tp_size
    if tp > world_size:
        raise ConfigError(
            f"HPUDeepSpeedStrategy(tensor_parallel={{'tp_size': {tp}}}) needs {tp} processes; the Trainer starts"
            f" {world_size} (devices x num_nodes). Set Trainer(devices={tp}) or a smaller tp_size."
        )
    if world_size % tp:
        raise ConfigError(
            f"HPUDeepSpeedStrategy(tensor_parallel={{'tp_size': {tp}}}) does not divide the {world_size} processes"
            f" the Trainer starts into tensor-parallel groups. Use a tp_size that divides {world_size}, or"
            f" Trainer(devices=...) x num_nodes a multiple of {tp}."
        )
    if settings.enable_cuda_graph and device_type == "cpu":
        raise ConfigError(
            "HPUDeepSpeedStrategy(enable_cuda_graph=True): graphs are captured on CUDA (CUDA graphs) and Gaudi (HPU"
            " graphs), not on CPU. Remove the argument, or run on accelerator='cuda' / 'hpu'."
        )
    if settings.enable_cuda_graph and device_type == "cuda" and settings.tensor_parallel:
        raise ConfigError(
            "HPUDeepSpeedStrategy(enable_cuda_graph=True) with tp_size > 1: DeepSpeed does not capture CUDA graphs"
            " of a tensor-parallel model. Remove enable_cuda_graph, or use tp_size=1."
        )
    if settings.replace_with_kernel_inject and device_type == "cpu":
        raise ConfigError(
            "HPUDeepSpeedStrategy(replace_with_kernel_inject=True): DeepSpeed's fused inference kernels are CUDA"
            " kernels. On CPU use replace_with_kernel_inject=False (AutoTP or an injection_policy)."
        )


def check_splittable(model: Module, settings: InferenceSettings) -> None:
    """Raise before DeepSpeed touches ``model`` if it cannot be split as asked (and say what to pass)."""
    if settings.replace_with_kernel_inject or is_split(model):
        return  # a module split by an earlier predict/validate/test in this process: DeepSpeed leaves it as it is
    if settings.injection_policy:  # at tp_size 1 too: a policy that names nothing in the model is a mistake
        _check_policy(model, settings.injection_policy)
        return
    if not settings.tensor_parallel:
        return
    hf = _contains_transformers_model(model)
    reason = None
    if not hf:
        reason = "it recognises Hugging Face transformers models only, and this model contains none"
    else:
        try:
            autotp_parse(model)
        except AssertionError as err:
            reason = str(err)
    if reason:
        raise ConfigError(
            f"DeepSpeed's AutoTP cannot split {type(_unwrap(model)).__name__} ({reason}). Pass"
            " `HPUDeepSpeedStrategy(injection_policy={LayerClass: (names of the linear layers whose outputs are"
            f" summed across ranks, ...)}})`, e.g. {_EXAMPLE_POLICY} for examples/train_lm.py."
            + _policy_candidates(model)
        )


def _check_policy(model: Module, policy: InjectionPolicy) -> None:
    problems = []
    for cls, names in policy.items():
        instances = [m for m in model.modules() if type(m) is cls]
        if not instances:
            problems.append(f"{cls.__name__}: the model has no module of this class")
            continue
        linear = {n for n, m in instances[0].named_modules() if isinstance(m, torch.nn.Linear)}
        for name in names:
            if not any(n == name or n.endswith("." + name) for n in linear):
                problems.append(f"{cls.__name__}: no linear layer named {name!r} (its linear layers: {sorted(linear)})")
    if problems:
        raise ConfigError(
            "HPUDeepSpeedStrategy(injection_policy=...) does not match the model:\n  " + "\n  ".join(problems)
        )


def _policy_candidates(model: Module) -> str:
    seen: dict[str, list[str]] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            for child in module:
                names = [n for n, m in child.named_modules() if isinstance(m, torch.nn.Linear)]
                if names:
                    seen.setdefault(type(child).__name__, names)
    return "".join(f"\n  {cls}: linear layers {names}" for cls, names in seen.items())


def _unwrap(model: Module) -> Module:
    inner = getattr(model, "_forward_module", None)  # Lightning's wrapper around the LightningModule
    return inner if isinstance(inner, Module) else model


def _split_inner_lm_heads(model: Module, group: Any, settings: InferenceSettings) -> None:
    """Split the output projection (``lm_head``) of models nested in ``model`` by input columns, as DeepSpeed does
    for the top-level module only: a Hugging Face model inside a LightningModule would otherwise keep its whole
    vocabulary matrix on every rank. A head tied to an input embedding stays whole (splitting it would untie it
    and hold the embedding plus half a copy)."""
    embeddings = {m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for module in model.modules():
        head = getattr(module, "lm_head", None)
        if module is model or type(head) is not torch.nn.Linear or head.weight.data_ptr() in embeddings:
            continue
        grain = settings.tp_options.get("tp_grain_size", 64)  # DeepSpeedTPConfig's default
        module.lm_head = lm_head_allreduce(head, group, getattr(module, "config", None), grain)


def _transformers_config(model: Module) -> Any:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    return next((m.config for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def _contains_transformers_model(model: Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return any(isinstance(m, PreTrainedModel) for m in model.modules())


# --------------------------------------------------------------------------------------------- engine
def init_engine(
    model: Module, settings: InferenceSettings, dtype: torch.dtype, device_type: str, world_size: int
) -> Any:
    """``deepspeed.init_inference`` on ``model`` (after :func:`check_splittable`); returns the engine.

    On Gaudi ``enable_cuda_graph`` means HPU graphs, as in lightning-habana: DeepSpeed's CUDA graph code is left
    off and the split module is wrapped with ``habana_frameworks``' ``wrap_in_hpu_graph``.
    """
    import deepspeed

    check_splittable(model, settings)
    # A module split by an earlier run in this process keeps its tensor-parallel layers (and their group): wrap it
    # without splitting again, which DeepSpeed's parser would refuse (it finds no nn.Linear left to split).
    tp_size = 1 if is_split(model) else settings.tp_size
    tp_config: dict[str, Any] = {**settings.tp_options, "tp_size": tp_size}
    if 1 < tp_size < world_size:
        # DeepSpeed alone builds one group, of ranks 0..tp_size-1: give it this rank's group of consecutive ranks.
        mpu = _TensorParallelGroup.new(tp_size)
        tp_config.update(mpu=mpu, tp_group=mpu.group)
    config: dict[str, Any] = {
        "tensor_parallel": tp_config,
        "dtype": dtype,
        "replace_with_kernel_inject": settings.replace_with_kernel_inject,
        "enable_cuda_graph": settings.enable_cuda_graph and device_type == "cuda",
    }
    if settings.injection_policy and tp_size > 1:
        config["injection_policy"] = {
            cls: autotp_policy_names(next(m for m in model.modules() if type(m) is cls), names)
            for cls, names in settings.injection_policy.items()
        }
    # AutoTP sizes each rank's share by whole key/value heads read from ``model.config`` (a Hugging Face config);
    # without one it cuts in blocks of tp_grain_size elements, which can split a head. A LightningModule holding a
    # transformers model has no ``config`` of its own: lend it the inner model's while DeepSpeed splits.
    lent = _transformers_config(model) if not hasattr(model, "config") else None
    if lent is not None:
        model.config = lent
    try:
        engine = deepspeed.init_inference(model, config=config)
    finally:
        if lent is not None:
            del model.config
    if tp_size > 1 and not settings.replace_with_kernel_inject:
        _split_inner_lm_heads(engine.module, engine.mp_group, settings)
    if settings.enable_cuda_graph and device_type == "hpu":
        from lightning_gaudi_ds import hpu

        engine.module = hpu.wrap_in_hpu_graph(engine.module)
    return engine


def init_zero_engine(model: Module, config: Mapping[str, Any], args: Any, *, zero_stage_3: bool) -> Any:
    """A DeepSpeed engine without optimizer for ``validate``/``test``/``predict`` (no tensor parallelism): the
    config's precision block and, at ZeRO-3, its partitioning; returns the engine.

    Lightning 2.6.6's ``DeepSpeedStrategy._initialize_deepspeed_inference`` with two changes: ``args`` carries the
    device rank (CPU and HPU devices have no index), and a ZeRO-3 config without ``zero_allow_untested_optimizer``
    gets True rather than a KeyError.
    """
    import deepspeed

    inference_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
    for key in ("fp16", "bf16"):
        if key in config:
            inference_config[key] = copy.deepcopy(config[key])  # DeepSpeed 0.16 edits the config it is given
    if zero_stage_3:
        inference_config["zero_allow_untested_optimizer"] = config.get("zero_allow_untested_optimizer", True)
        inference_config["zero_optimization"] = copy.deepcopy(config["zero_optimization"])
    remove_module_hooks(model)
    with zeropp.engine_group(inference_config):  # ZeRO++ hpZ: DeepSpeed's process-wide group made this config's
        engine, _, _, _ = deepspeed.initialize(
            args=args,
            config=inference_config,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )
    reset_zero3_trace_at_outer_forward_only(engine)
    complete_zero3_gathers(model)
    return engine


@dataclasses.dataclass(frozen=True)
class _TensorParallelGroup:
    """This rank's tensor-parallel group among consecutive blocks of ``tp_size`` ranks (DeepSpeed's ``mpu``
    protocol); the data-parallel replicas are the blocks."""

    group: Any
    size: int

    @classmethod
    def new(cls, tp_size: int) -> _TensorParallelGroup:
        """A collective: every rank calls it (``torch.distributed.new_subgroups`` builds every block's group)."""
        import torch.distributed as dist

        group, _ = dist.new_subgroups(group_size=tp_size)
        return cls(group, tp_size)

    def get_model_parallel_group(self) -> Any:
        return self.group

    def get_model_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self.group)

    def get_model_parallel_world_size(self) -> int:
        return self.size


def is_split(module: Module) -> bool:
    """Whether DeepSpeed's tensor-parallel layers already replaced some of ``module``'s layers."""
    layer = tensor_parallel_layer_class()
    return any(isinstance(m, layer) for m in module.modules())


def load_weights(module: Module, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
    """Load the whole weights of :func:`load_full_state_dict` into a module that is not split yet."""
    if is_split(module):
        raise ConfigError(
            f"ckpt_path= with tensor parallelism: this {type(module).__name__} was already split across ranks by an"
            " earlier trainer.predict/validate/test, and whole weights cannot be loaded into it. Pass a new instance"
            " of the module together with ckpt_path, or leave ckpt_path out to keep the weights it has."
        )
    module.load_state_dict(checkpoint["state_dict"], strict=strict)


def shm_comm_mode(settings: InferenceSettings | None, world_size: int, current: str | None) -> str | None:
    """The ``LIGHTNING_GAUDI_DS_SHM_COMM`` mode a run needs, or ``None`` to leave ``current`` (the user's) as it is.

    Split layers sum through ``deepspeed.comm.inference_all_reduce``, which DeepSpeed's CPU shm op speeds up:
    with one tensor-parallel group it is loaded unless the user chose ``off``. Its kernel reduces over every rank
    whatever the group (shm.cpp), so with several groups it must stay off.
    """
    if settings is None or not settings.tensor_parallel:
        return None
    if settings.tp_size == world_size:
        return None if current is not None else "on"
    if current not in (None, "off"):
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(f"LIGHTNING_GAUDI_DS_SHM_COMM={current} ignored: DeepSpeed's shm all-reduce ignores the"
                       f" tensor-parallel group, and {world_size // settings.tp_size} groups share this run;"
                       " torch.distributed all-reduces instead.")
    return "off"


def sampler_kwargs(world_size: int, global_rank: int, tp_size: int) -> dict[str, int]:
    """DistributedSampler arguments: the ranks of one tensor-parallel group read the same samples."""
    return {"num_replicas": max(1, world_size // tp_size), "rank": global_rank // tp_size}


# ------------------------------------------------------------------------------------------ checkpoints
def checkpoint_hparams(path: str | os.PathLike[str], weights_only: bool | None = None) -> dict[str, Any]:
    """The LightningModule's saved hyperparameters (``save_hyperparameters``) of a sharded or single-file checkpoint,
    without reading any optimizer shard; ``weights_only`` as in ``torch.load`` (None: torch's default, True). A sharded
    checkpoint is validated first, as training does (an unfinished or truncated save is refused by name)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"ckpt_path={str(path)!r}: no such checkpoint file or directory.")
    opt_in = "pass `weights_only=False` to checkpoint_hparams"
    if path.is_dir():
        info = ckpt_io.validate_checkpoint(path, weights_only=weights_only, opt_in=opt_in)
        path = info.tag_dir / model_states_name(info.zero_stage, 0)
    return dict(ckpt_io.load_file(path, weights_only, opt_in).get("hyper_parameters") or {})


def load_full_state_dict(path: str | os.PathLike[str], weights_only: bool | None = None) -> dict[str, Any]:
    """The full (unsharded, fp32) state dict of a checkpoint, as a Lightning checkpoint dict.

    ``path`` is a sharded DeepSpeed checkpoint directory written by this strategy (any ZeRO stage and world size;
    validated and merged in memory by :func:`lightning_gaudi_ds.checkpoint.read.read_full_checkpoint`), or one file
    (``lightning-gaudi-ds convert``'s fp32 export, or a plain Lightning checkpoint). ``weights_only``: Lightning's
    switch (None: torch's default, True); when it resolves to True every file is read through torch's safe
    unpickler first (see :func:`lightning_gaudi_ds.checkpoint.verify_files`).
    """
    path = Path(path)
    if path.is_file():
        checkpoint = ckpt_io.load_file(path, weights_only)
        if "state_dict" not in checkpoint:  # a bare state dict
            checkpoint = {"state_dict": checkpoint}
        return checkpoint
    if not path.is_dir():
        raise CheckpointNotFoundError(f"ckpt_path={str(path)!r}: no such checkpoint file or directory.")
    return read_full_checkpoint(path, weights_only=weights_only)
