"""DeepSpeed JSON configs: load, validate, fill every ``"auto"`` from the Trainer, report every contradiction at once.

Pure ``dict -> dict``: nothing here starts or queries ``torch.distributed``. The strategy gathers the facts
(:class:`AutoContext`) and calls :func:`resolve_config`; the input dict is never modified, and a value the user
set explicitly is never overwritten: if it disagrees with the Trainer it is reported.

Where each ``"auto"`` comes from (``AutoContext`` field in brackets):

=====================================================  ===============================================================
key                                                    value
=====================================================  ===============================================================
``train_micro_batch_size_per_gpu``                     the train DataLoader's ``batch_size`` [micro_batch_size]
                                                       (built by the fit loop, after ``LightningDataModule.setup``);
                                                       else ``train_batch_size / (accumulation * world_size)``
``gradient_accumulation_steps``                        ``Trainer(accumulate_grad_batches)`` [accumulate_grad_batches]
``train_batch_size``                                   micro batch * accumulation * world size
``gradient_clipping``                                  ``Trainer(gradient_clip_val)``, ``0.0`` (off) when unset
``bf16.enabled`` / ``fp16.enabled``                    ``Trainer(precision)``: ``bf16-*`` / ``16-*`` [precision]
``optimizer.params.lr``                                module hparam ``lr`` or ``learning_rate`` [hparams]
``optimizer.params.betas``                             hparam ``betas``, or ``(adam_beta1, adam_beta2)``
``optimizer.params.eps``                               hparam ``eps`` or ``adam_epsilon``
``optimizer.params.weight_decay``                      hparam ``weight_decay``
``scheduler.params.warmup_min_lr``                     hparam ``warmup_min_lr``, else ``0.0`` (as Hugging Face)
``scheduler.params.warmup_max_lr``                     the learning rate (hparam ``lr`` / ``learning_rate``)
``scheduler.params.warmup_num_steps``                  hparam ``warmup_steps`` / ``warmup_num_steps``, or
                                                       ``ceil(warmup_ratio * total_num_steps)``
``scheduler.params.total_num_steps``                   ``Trainer.estimated_stepping_batches`` [total_steps]
``zero_optimization.reduce_bucket_size``               ``hidden**2`` [hidden_size]
``zero_optimization.allgather_bucket_size``            ``hidden**2``
``zero_optimization.stage3_prefetch_bucket_size``      ``int(0.9 * hidden**2)``
``zero_optimization.stage3_param_persistence_threshold``  ``10 * hidden``
=====================================================  ===============================================================

``hidden`` (see :func:`hidden_size`): ``config.hidden_size`` of the module or any submodule (Hugging Face models),
else the module hparam ``hidden_size``, else the smaller dimension of the largest 2-D parameter (for a transformer
that is ``d_model``: embeddings are ``vocab x d``, projections ``d x k*d``). ``hparams`` are the LightningModule's
``save_hyperparameters()`` values. An ``"auto"`` with no source is an error naming the key and how to supply it.

``gradient_accumulation_steps``, ``train_micro_batch_size_per_gpu`` and ``gradient_clipping`` are filled as if
``"auto"`` when the config leaves them out (Lightning's own strategy always sets them from the Trainer); a micro
batch that is left out and has no source is 1, as in Lightning (DeepSpeed only uses it for its bookkeeping then).

A strategy argument passed explicitly (``HPUDeepSpeedStrategy(stage=3, config=...)``) fills its key when the config
leaves it out or says ``"auto"``, and is a contradiction when the config sets a different value.
"""

from __future__ import annotations

import copy
import difflib
import functools
import importlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Union

AUTO = "auto"
ENV_VAR = "PL_DEEPSPEED_CONFIG_PATH"
CONFIG_FILENAME = "deepspeed_config.json"

ZERO = "zero_optimization"
BUCKET_KEYS = (
    f"{ZERO}.reduce_bucket_size",
    f"{ZERO}.allgather_bucket_size",
    f"{ZERO}.stage3_prefetch_bucket_size",
    f"{ZERO}.stage3_param_persistence_threshold",
)
OPTIMIZER_AUTO_KEYS = tuple(f"optimizer.params.{k}" for k in ("lr", "betas", "eps", "weight_decay"))
SCHEDULER_AUTO_KEYS = tuple(
    f"scheduler.params.{k}" for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")
)
#: Every key that may be ``"auto"``; anywhere else DeepSpeed would receive the string itself.
AUTO_KEYS: tuple[str, ...] = (
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
    "gradient_clipping",
    "bf16.enabled",
    "fp16.enabled",
    *OPTIMIZER_AUTO_KEYS,
    *SCHEDULER_AUTO_KEYS,
    *BUCKET_KEYS,
)

#: Keys Lightning always sets from the Trainer: left out of a config, they are filled as if "auto".
TRAINER_KEYS = ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "gradient_clipping")

# Top-level sections DeepSpeed reads by constant name, outside deepspeed.runtime.constants: (module, constant).
_SECTION_CONSTANTS = (
    ("deepspeed.runtime.zero.config", "ZERO_OPTIMIZATION"),
    ("deepspeed.runtime.activation_checkpointing.config", "ACT_CHKPT"),
    ("deepspeed.runtime.swap_tensor.constants", "AIO"),
    ("deepspeed.profiling.constants", "FLOPS_PROFILER"),
    ("deepspeed.autotuning.constants", "AUTOTUNING"),
    ("deepspeed.comm.constants", "COMMS_LOGGER"),
    ("deepspeed.runtime.data_pipeline.constants", "DATA_EFFICIENCY"),
    ("deepspeed.utils.config", "TIMERS"),
    ("deepspeed.datastates.config", "DATASTATES_CHECKPOINTING"),
    ("deepspeed.runtime.config", "EXPERT_PARALLEL"),
)
# Top-level keys DeepSpeed's config reads as string literals (deepspeed/runtime/config.py and
# deepspeed/compile); tests check each still occurs in DeepSpeed's source.
INLINE_KEYS = frozenset(
    {"pipeline", "hybrid_engine", "compile", "weight_quantization", "tensor_parallel", "sequence_parallel_size"}
)
_IDENTIFIER = re.compile(r"[a-z][a-z0-9_]*")

# Strategy argument -> config key it stands for (compared with, or filled into, a user config).
STRATEGY_ARG_KEYS: dict[str, str] = {
    "stage": f"{ZERO}.stage",
    "contiguous_gradients": f"{ZERO}.contiguous_gradients",
    "overlap_comm": f"{ZERO}.overlap_comm",
    "allgather_partitions": f"{ZERO}.allgather_partitions",
    "reduce_scatter": f"{ZERO}.reduce_scatter",
    "allgather_bucket_size": f"{ZERO}.allgather_bucket_size",
    "reduce_bucket_size": f"{ZERO}.reduce_bucket_size",
    "sub_group_size": f"{ZERO}.sub_group_size",
    "zero_allow_untested_optimizer": "zero_allow_untested_optimizer",
    "partition_activations": "activation_checkpointing.partition_activations",
    "cpu_checkpointing": "activation_checkpointing.cpu_checkpointing",
    "contiguous_memory_optimization": "activation_checkpointing.contiguous_memory_optimization",
    "synchronize_checkpoint_boundary": "activation_checkpointing.synchronize_checkpoint_boundary",
    "loss_scale": "fp16.loss_scale",
    "initial_scale_power": "fp16.initial_scale_power",
    "loss_scale_window": "fp16.loss_scale_window",
    "hysteresis": "fp16.hysteresis",
    "min_loss_scale": "fp16.min_loss_scale",
}


class ConfigError(ValueError):
    """A DeepSpeed config that cannot be used as given; the message lists every problem found."""


# ----------------------------------------------------------------------------------------------- load
def load_config(
    config: Union[str, Path, Mapping[str, Any], None], environ: Mapping[str, str] = os.environ
) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """Return ``(a deep copy of the config, where it came from)``; ``(None, None)`` when there is none.

    ``config`` is a JSON path or a dict; when it is None, the path in ``$PL_DEEPSPEED_CONFIG_PATH`` is read.
    """
    source = None
    if config is None and environ.get(ENV_VAR):
        config, source = environ[ENV_VAR], f"${ENV_VAR}={environ[ENV_VAR]}"
    if config is None:
        return None, None
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config)), "dict"
    if not isinstance(config, (str, Path)):
        raise ConfigError(
            f"HPUDeepSpeedStrategy(config={config!r}): expected a JSON file path or a dict, got {type(config).__name__}."
        )
    path = Path(config).expanduser()
    source = source or str(path)
    if not path.is_file():
        where = f" (from {source})" if source != str(path) else ""
        raise FileNotFoundError(
            f"DeepSpeed config file {str(path)!r}{where} does not exist. Pass an existing JSON file or a dict,"
            f" or unset {ENV_VAR}."
        )
    try:
        loaded = json.loads(path.read_text(), object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"DeepSpeed config {str(path)!r} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}."
        ) from None
    except _DuplicateKey as err:
        raise ConfigError(f"DeepSpeed config {str(path)!r} sets key {err.args[0]!r} twice; keep one.") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"DeepSpeed config {str(path)!r} must hold a JSON object, not {type(loaded).__name__}.")
    return loaded, source


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


# ------------------------------------------------------------------------------------------- validate
@functools.lru_cache(maxsize=None)
def known_keys() -> tuple[frozenset[str], frozenset[str]]:
    """``(top-level keys, zero_optimization keys)`` DeepSpeed knows, read from DeepSpeed itself.

    Top level: the string constants of ``deepspeed.runtime.constants`` (a superset: it also names a few
    sub-keys such as ``enabled``), the section constants of DeepSpeed's sub-configs, the monitor sections and
    :data:`INLINE_KEYS`. ZeRO: the fields and aliases of ``DeepSpeedZeroConfig``.
    """
    import deepspeed.runtime.constants as constants
    from deepspeed.monitor.config import DeepSpeedMonitorConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    top = {v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str) and _IDENTIFIER.fullmatch(v)}
    for module, name in _SECTION_CONSTANTS:
        try:
            top.add(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # a DeepSpeed version without that section
            pass
    top |= set(DeepSpeedMonitorConfig.model_fields) | INLINE_KEYS
    zero = set()
    for name, info in DeepSpeedZeroConfig.model_fields.items():
        zero.add(name)
        if info.alias:
            zero.add(info.alias)
    return frozenset(top), frozenset(zero)


def _removed_keys() -> tuple[Mapping[str, str], Mapping[str, str]]:
    """Keys this DeepSpeed version has removed, with DeepSpeed's own explanation."""
    import deepspeed.runtime.config as ds_config

    return (
        getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}),
        getattr(ds_config, "_REMOVED_ZERO_CONFIG_KEYS", {}),
    )


def validate_config(config: Mapping[str, Any], source: str = "dict") -> None:
    """Raise one :class:`ConfigError` listing every static problem of ``config`` (before any process trains).

    Checks: unknown or misspelled keys (top level and ``zero_optimization``, with the closest valid key),
    keys removed from DeepSpeed, a ZeRO stage outside 0-3, ``bf16`` and ``fp16`` both enabled, and ``"auto"``
    where DeepSpeed cannot take it.
    """
    top, zero = known_keys()
    removed_top, removed_zero = _removed_keys()
    problems = []
    for key in config:
        if key in removed_top:
            problems.append(f"{key}: removed from DeepSpeed. {removed_top[key]}")
        elif key not in top:
            problems.append(_unknown(key, top, ""))
    section = config.get(ZERO)
    if section is not None and not isinstance(section, (dict, bool)):
        problems.append(f"{ZERO}: expected a JSON object, got {section!r}.")
    if isinstance(section, dict):
        for key in section:
            if key in removed_zero:
                problems.append(f"{ZERO}.{key}: removed from DeepSpeed. {removed_zero[key]}")
            elif key not in zero:
                problems.append(_unknown(key, zero, f"{ZERO}."))
        stage = section.get("stage", 0)
        if stage != AUTO and (isinstance(stage, bool) or stage not in (0, 1, 2, 3)):
            problems.append(
                f"{ZERO}.stage: {stage!r} is not a ZeRO stage. Allowed: 0, 1, 2, 3"
                " (0: no sharding, 1: optimizer states, 2: + gradients, 3: + parameters)."
            )
    if _get(config, "bf16.enabled") is True and _get(config, "fp16.enabled") is True:
        problems.append(
            'bf16.enabled and fp16.enabled: both are true; DeepSpeed trains in one of them. Set both to "auto"'
            " (Trainer(precision=...) decides) or disable one."
        )
    for key in iter_auto(config):
        if key not in AUTO_KEYS:
            problems.append(f'{key}: "auto" is not accepted here (DeepSpeed would receive the string); set a value.')
    if problems:
        note = f'Keys that may be "auto": {", ".join(AUTO_KEYS)}.' if any('"auto" is not' in p for p in problems) else ""
        raise ConfigError(_report(f"DeepSpeed config ({source}) is invalid", problems, note))


def _unknown(key: str, known: frozenset[str], prefix: str) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    hint = f" Did you mean '{prefix}{close[0]}'?" if close else " Check the name against DeepSpeed's config docs."
    return f"{prefix}{key}: not a DeepSpeed config key.{hint}"


def iter_auto(config: Any, prefix: str = "") -> Iterator[str]:
    """Dotted keys (``a.b``, ``a.list[0]``) whose value is ``"auto"``."""
    if isinstance(config, Mapping):
        for key, value in config.items():
            yield from iter_auto(value, f"{prefix}{key}" if not prefix else f"{prefix}.{key}")
    elif isinstance(config, list):
        for i, value in enumerate(config):
            yield from iter_auto(value, f"{prefix}[{i}]")
    elif config == AUTO:
        yield prefix


# -------------------------------------------------------------------------------------------- resolve
@dataclass(frozen=True)
class AutoContext:
    """What the Trainer, the LightningModule and the data say; the only input of :func:`resolve_config`."""

    world_size: int = 1
    accumulate_grad_batches: int = 1
    micro_batch_size: Optional[int] = None  # the train DataLoader's batch_size
    gradient_clip_val: Optional[float] = None  # None: Trainer left it unset
    precision: str = "32-true"
    hparams: Mapping[str, Any] = field(default_factory=dict)  # LightningModule.hparams
    total_steps: Optional[int] = None  # Trainer.estimated_stepping_batches
    hidden_size: Optional[int] = None  # see hidden_size()
    strategy_args: Mapping[str, Any] = field(default_factory=dict)  # arguments the user passed explicitly
    fitting: bool = True  # False (validate/test/predict): sourceless micro batch is 1, optimizer autos stay


@dataclass(frozen=True)
class Resolved:
    config: dict[str, Any]
    filled: tuple[str, ...]  # one line per filled key: "key = value (source)"


_MISSING: Any = object()


def resolve_config(config: Mapping[str, Any], ctx: AutoContext, source: str = "dict") -> Resolved:
    """Return a new config with every ``"auto"`` filled from ``ctx``.

    Raises one :class:`ConfigError` that lists every contradiction (key, config value, Trainer value) and every
    ``"auto"`` that has no source.
    """
    cfg = copy.deepcopy(dict(config))
    filled: list[str] = []
    problems: list[str] = []
    # Values set by hand, in the config or by an explicit strategy argument: key -> "where it was set".
    origin = {key: "the config" for key in _leaves(cfg) if _get(cfg, key) != AUTO}

    def fill(key: str, value: Any, why: str) -> None:
        _set(cfg, key, value)
        filled.append(f"{key} = {_fmt(value)} ({why})")

    def check(key: str, expected: Any, why: str) -> None:
        value = _get(cfg, key)
        if key in origin and value is not _MISSING and value != AUTO and not _same(value, expected):
            problems.append(f'{key}: {origin[key]} has {_fmt(value)}, {why} gives {_fmt(expected)}; set it to "auto"')

    # 1. precision: bf16/fp16 blocks follow Trainer(precision)
    bf16, fp16 = ctx.precision.startswith("bf16"), ctx.precision.startswith("16")
    for block, wanted in (("bf16", bf16), ("fp16", fp16)):
        current = _get(cfg, f"{block}.enabled")
        if current == AUTO or (wanted and current is _MISSING):
            fill(f"{block}.enabled", wanted, f"Trainer(precision={ctx.precision!r})")
        else:
            check(f"{block}.enabled", wanted, f"Trainer(precision={ctx.precision!r})")

    # 2. explicit strategy arguments
    for key, value in strategy_arg_values(ctx.strategy_args).items():
        current = _get(cfg, key)
        label = _arg_label(key, ctx.strategy_args)
        if key.startswith("fp16.") and "fp16" not in cfg:
            continue  # no fp16 training: loss-scale arguments do not apply
        if current is _MISSING or current == AUTO:
            if value != "none":
                fill(key, value, label)
                origin[key] = label
        elif not _same(current, value):
            fix = 'set it to "auto"' if key in AUTO_KEYS else "remove the key or the argument"
            problems.append(f"{key}: the config has {_fmt(current)}, {label} gives {_fmt(value)}; {fix}")

    # 3. batch sizes. Keys the config leaves out are set from the Trainer, as Lightning's own strategy does.
    implicit = [key for key in TRAINER_KEYS if key not in cfg]
    cfg.update({key: AUTO for key in implicit})
    world, accum = ctx.world_size, ctx.accumulate_grad_batches
    if _get(cfg, "gradient_accumulation_steps") == AUTO:
        fill("gradient_accumulation_steps", accum, f"Trainer(accumulate_grad_batches={accum})")
    else:
        check("gradient_accumulation_steps", accum, f"Trainer(accumulate_grad_batches={accum})")
    micro, train = _get(cfg, "train_micro_batch_size_per_gpu"), _get(cfg, "train_batch_size")
    if micro == AUTO:
        if ctx.micro_batch_size is not None:
            fill("train_micro_batch_size_per_gpu", ctx.micro_batch_size, "train DataLoader batch_size")
        elif isinstance(train, int) and not isinstance(train, bool) and train % (accum * world) == 0:
            fill("train_micro_batch_size_per_gpu", train // (accum * world), "train_batch_size / (accumulation * world size)")
        elif "train_micro_batch_size_per_gpu" in implicit or not ctx.fitting:
            fill("train_micro_batch_size_per_gpu", 1, "no train DataLoader batch size; 1, as Lightning")
        else:
            problems.append(
                'train_micro_batch_size_per_gpu: "auto" has no source: the train DataLoader has no single batch_size'
                " (a batch_sampler without one, several loaders, or no loader). Set it in the config."
            )
    elif ctx.micro_batch_size is not None:
        check("train_micro_batch_size_per_gpu", ctx.micro_batch_size, "the train DataLoader's batch_size")
    micro = _get(cfg, "train_micro_batch_size_per_gpu")
    if isinstance(micro, int) and not isinstance(micro, bool):
        total = micro * accum * world
        why = f"micro batch {micro} x accumulation {accum} x world size {world}"
        if train == AUTO:
            fill("train_batch_size", total, why)
        else:
            check("train_batch_size", total, why)
    elif train == AUTO:
        problems.append('train_batch_size: "auto" needs train_micro_batch_size_per_gpu; set one of them.')

    # 4. gradient clipping
    clip = ctx.gradient_clip_val
    if _get(cfg, "gradient_clipping") == AUTO:
        fill("gradient_clipping", float(clip or 0.0), f"Trainer(gradient_clip_val={clip})")
    elif clip is not None:
        check("gradient_clipping", float(clip), f"Trainer(gradient_clip_val={clip})")

    # 5. optimizer / scheduler sections, from the module's hyperparameters
    hp = _hparam_values(ctx.hparams)
    total = (ctx.total_steps, "Trainer.estimated_stepping_batches") if ctx.total_steps is not None else None
    warmup = hp.get("warmup_steps")
    if warmup is None and "warmup_ratio" in hp and ctx.total_steps is not None:
        ratio = hp["warmup_ratio"][0]
        warmup = (math.ceil(ratio * ctx.total_steps), f"hparam warmup_ratio={ratio} x {ctx.total_steps} steps")
    sources: tuple[tuple[str, Optional[tuple[Any, str]], str], ...] = (
        ("optimizer.params.lr", hp.get("lr"), _HPARAM_HINT["lr"]),
        ("optimizer.params.betas", hp.get("betas"), _HPARAM_HINT["betas"]),
        ("optimizer.params.eps", hp.get("eps"), _HPARAM_HINT["eps"]),
        ("optimizer.params.weight_decay", hp.get("weight_decay"), _HPARAM_HINT["weight_decay"]),
        ("scheduler.params.warmup_max_lr", hp.get("lr"), _HPARAM_HINT["lr"]),
        ("scheduler.params.warmup_min_lr", hp.get("warmup_min_lr"), ""),
        ("scheduler.params.warmup_num_steps", warmup, _HPARAM_HINT["warmup_steps"]),
        ("scheduler.params.total_num_steps", total, "set Trainer(max_steps=...) or use a sized train DataLoader"),
    )
    for key, src, hint in sources:
        if key.split(".", 1)[0] not in cfg:
            continue
        if _get(cfg, key) != AUTO:
            if src is not None:
                check(key, src[0], src[1])
        elif src is not None:
            fill(key, src[0], src[1])
        elif key == "scheduler.params.warmup_min_lr":
            fill(key, 0.0, "default, as Hugging Face")
        elif ctx.fitting:
            problems.append(f'{key}: "auto" has no source; {hint}, or set a number in the config.')

    # 6. bucket sizes from the model
    if ctx.hidden_size:
        h = ctx.hidden_size
        sizes = bucket_sizes(h)
        for key in BUCKET_KEYS:
            if _get(cfg, key) == AUTO:
                fill(key, sizes[key], f"model hidden size {h}")
    else:
        for key in BUCKET_KEYS:
            if _get(cfg, key) == AUTO:
                problems.append(
                    f'{key}: "auto" needs the model\'s hidden size, and the model has no 2-D parameter yet (built in'
                    " configure_model?). Add `hidden_size` to the module's hyperparameters or set a number."
                )
    if problems:
        raise ConfigError(_report(f"DeepSpeed config ({source}) does not fit this Trainer", problems))
    return Resolved(cfg, tuple(filled))


_HPARAM_HINT = {
    "lr": "save `lr` with self.save_hyperparameters()",
    "betas": "save `betas` (or `adam_beta1` and `adam_beta2`) with self.save_hyperparameters()",
    "eps": "save `eps` (or `adam_epsilon`) with self.save_hyperparameters()",
    "weight_decay": "save `weight_decay` with self.save_hyperparameters()",
    "warmup_steps": "save `warmup_steps` (or `warmup_ratio`) with self.save_hyperparameters()",
}


def _hparam_values(hparams: Mapping[str, Any]) -> dict[str, tuple[Any, str]]:
    """The optimizer/scheduler values the module's hyperparameters define, each with its source."""
    out: dict[str, tuple[Any, str]] = {}

    def take(name: str, *aliases: str) -> None:
        for alias in (name, *aliases):
            if hparams.get(alias) is not None:
                out[name] = (hparams[alias], f"hparam {alias}")
                return

    take("lr", "learning_rate")
    take("eps", "adam_epsilon")
    take("weight_decay")
    take("warmup_steps", "warmup_num_steps")
    take("warmup_min_lr")
    take("warmup_ratio")
    if hparams.get("betas") is not None:
        out["betas"] = (list(hparams["betas"]), "hparam betas")
    elif hparams.get("adam_beta1") is not None and hparams.get("adam_beta2") is not None:
        out["betas"] = ([hparams["adam_beta1"], hparams["adam_beta2"]], "hparams adam_beta1, adam_beta2")
    return out


def strategy_arg_values(args: Mapping[str, Any]) -> dict[str, Any]:
    """Config key -> value for each explicitly passed strategy argument that maps onto the config."""
    out = {STRATEGY_ARG_KEYS[name]: value for name, value in args.items() if name in STRATEGY_ARG_KEYS}
    for flag, section, device_arg in (
        ("offload_optimizer", "offload_optimizer", "offload_optimizer_device"),
        ("offload_parameters", "offload_param", "offload_params_device"),
    ):
        if flag in args:
            out[f"{ZERO}.{section}.device"] = args.get(device_arg, "cpu") if args[flag] else "none"
    return out


def _arg_label(key: str, args: Mapping[str, Any]) -> str:
    names = [n for n, k in STRATEGY_ARG_KEYS.items() if k == key and n in args]
    if not names:
        names = [n for n in ("offload_optimizer", "offload_parameters") if n in args and key.endswith(".device")
                 and (n == "offload_optimizer") == (".offload_optimizer." in key)]
    return "HPUDeepSpeedStrategy(" + ", ".join(f"{n}={args[n]!r}" for n in names) + ")"


# ------------------------------------------------------------------------------------- model buckets
def bucket_sizes(hidden: int) -> dict[str, int]:
    """Hugging Face's rule for bucket sizes from the model's hidden size (elements, not bytes)."""
    return {
        f"{ZERO}.reduce_bucket_size": hidden * hidden,
        f"{ZERO}.allgather_bucket_size": hidden * hidden,
        f"{ZERO}.stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        f"{ZERO}.stage3_param_persistence_threshold": 10 * hidden,
    }


def hidden_size(module: Any) -> Optional[int]:
    """The model's hidden size: ``config.hidden_size`` of the module or a submodule (Hugging Face), else hparam
    ``hidden_size``, else the smaller dimension of the largest 2-D parameter; None when none of these exists."""
    modules = module.modules() if hasattr(module, "modules") else [module]
    for sub in modules:
        value = getattr(getattr(sub, "config", None), "hidden_size", None)
        if isinstance(value, int) and value > 0:
            return value
    value = (getattr(module, "hparams", None) or {}).get("hidden_size")
    if isinstance(value, int) and value > 0:
        return value
    best: Optional[tuple[int, int]] = None
    for param in module.parameters() if hasattr(module, "parameters") else ():
        shape = tuple(getattr(param, "ds_shape", None) or param.shape)  # ZeRO-3 partitioned parameters
        if len(shape) == 2 and (best is None or shape[0] * shape[1] > best[0]):
            best = (shape[0] * shape[1], min(shape))
    return best[1] if best else None


def bucket_hints(config: Mapping[str, Any], hidden: Optional[int]) -> list[str]:
    """One line per bucket size a user config leaves to DeepSpeed's default when the model wants far less."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = config.get(ZERO)
    if not hidden or not isinstance(zero, dict) or zero.get("stage", 0) in (0, AUTO):
        return []
    names = ("reduce_bucket_size", "stage3_prefetch_bucket_size" if zero["stage"] == 3 else "allgather_bucket_size")
    fields = {info.alias or name: info.default for name, info in DeepSpeedZeroConfig.model_fields.items()}
    wanted = bucket_sizes(hidden)
    return [
        f'{ZERO}.{name} is left to DeepSpeed\'s default of {int(fields[name]):,} elements; "auto" would size it from'
        f" the model (hidden size {hidden}): {wanted[f'{ZERO}.{name}']:,}"
        for name in names
        if name not in zero and isinstance(fields.get(name), (int, float)) and fields[name] > 10 * wanted[f"{ZERO}.{name}"]
    ]


def mark_model_buckets(config: Mapping[str, Any], explicit_args: Mapping[str, Any]) -> dict[str, Any]:
    """For Lightning's default config (no user config): bucket keys set to ``"auto"`` unless passed explicitly.

    Lightning's default buckets are 2e8 elements (400 MB each in bf16) whatever the model size.
    """
    cfg = copy.deepcopy(dict(config))
    zero = cfg.get(ZERO)
    if not isinstance(zero, dict):
        return cfg
    stage3 = zero.get("stage") == 3
    for key in BUCKET_KEYS:
        name = key.split(".", 1)[1]
        if name in explicit_args or (name.startswith("stage3_") and not stage3):
            continue
        if name == "allgather_bucket_size" and stage3:
            continue  # not used by ZeRO-3
        zero[name] = AUTO
    return cfg


# ---------------------------------------------------------------------------------------- helpers
def _get(config: Mapping[str, Any], key: str, default: Any = _MISSING) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            if part in ("bf16",) and isinstance(node, Mapping) and "bfloat16" in node:
                node = node["bfloat16"]  # DeepSpeed's older name for the bf16 block
                continue
            return default
        node = node[part]
    return node


def _set(config: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = config
    for part in parts[:-1]:
        if part == "bf16" and part not in node and "bfloat16" in node:
            part = "bfloat16"
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


def _leaves(config: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in config.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, dotted)
        else:
            yield dotted


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b and type(a) is type(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


def _fmt(value: Any) -> str:
    try:
        return json.dumps(value)  # the user wrote JSON: show true/false/null as JSON
    except (TypeError, ValueError):
        return repr(value)


def _report(title: str, problems: list[str], note: str = "") -> str:
    lines = "\n".join(f"  - {p}" for p in problems)
    count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
    return f"{title}: {count}:\n{lines}" + (f"\n{note}" if note else "")
