"""Fill every ``"auto"`` of a DeepSpeed config from the Trainer and report every contradiction at once.

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
``zero_optimization.overlap_comm``, ``reduce_scatter``,   the device table's ``zero_defaults`` for the device type and
``contiguous_gradients``, ``use_multi_rank_bucket_allreduce``  ZeRO stage [device_type, zero_defaults]; filled also
                                                       when left out; a key the device has no default for is
                                                       left to DeepSpeed
=====================================================  ===============================================================

``hidden`` (see :func:`hidden_size`): ``config.hidden_size`` of the module or any submodule (Hugging Face models),
else the module hparam ``hidden_size``, else the smaller dimension of the largest 2-D parameter (for a transformer
that is ``d_model``: embeddings are ``vocab x d``, projections ``d x k*d``). ``hparams`` are the LightningModule's
``save_hyperparameters()`` values. An ``"auto"`` with no source is an error naming the key and how to supply it.

``gradient_accumulation_steps``, ``train_micro_batch_size_per_gpu`` and ``gradient_clipping`` are filled as if
``"auto"`` when the config leaves them out (Lightning's own strategy always sets them from the Trainer); a micro
batch that is left out and has no source is 1, as in Lightning (DeepSpeed only uses it for its bookkeeping then).

``HPUDeepSpeedStrategy(logging_batch_size_per_gpu=N)`` sets the micro batch to ``N`` whatever the loader's batch size,
as in Lightning: DeepSpeed only counts it for its throughput logging and ``train_batch_size``.

A strategy argument passed explicitly (``HPUDeepSpeedStrategy(stage=3, config=...)``) fills its key when the config
leaves it out or says ``"auto"``, and is a contradiction when the config sets a different value.
"""


from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_gaudi_ds.config.keys import (
    AUTO,
    AUTO_KEYS,
    BUCKET_KEYS,
    CONFIG_FILENAME,
    DEVICE_TUNED_KEYS,
    HPZ_KEY,
    MISSING,
    STRATEGY_ARG_KEYS,
    TRAINER_KEYS,
    ZERO,
    fmt,
    get,
    leaves,
    report,
    same,
    set_key,
    without_disabled_offload,
)
from lightning_gaudi_ds.config.load import ConfigError, load_config, validate_config
from lightning_gaudi_ds.config.sizing import bucket_hints, bucket_sizes, mark_model_buckets

_DEFAULT_SOURCE = "built from HPUDeepSpeedStrategy's arguments"


@dataclass(frozen=True)
class AutoContext:
    """What the Trainer, the LightningModule and the data say; the only input of :func:`resolve_config`."""

    world_size: int = 1
    accumulate_grad_batches: int = 1
    micro_batch_size: int | None = None  # the train DataLoader's batch_size
    gradient_clip_val: float | None = None  # None: Trainer left it unset
    precision: str = "32-true"
    hparams: Mapping[str, Any] = field(default_factory=dict)  # LightningModule.hparams
    total_steps: int | None = None  # Trainer.estimated_stepping_batches
    hidden_size: int | None = None  # see hidden_size()
    strategy_args: Mapping[str, Any] = field(default_factory=dict)  # arguments the user passed explicitly
    fitting: bool = True  # False (validate/test/predict): sourceless micro batch is 1, optimizer autos stay
    logging_batch_size: int | None = None  # HPUDeepSpeedStrategy(logging_batch_size_per_gpu=N)
    device_type: str | None = None  # "cpu" | "cuda" | "hpu": whose zero_defaults these are
    zero_defaults: Mapping[int, Mapping[str, tuple[Any, str]]] = field(default_factory=dict)  # devices.DeviceSpec
    devices_per_node: int | None = None  # the launch's ranks per node: hpZ's "auto" (config/zeropp.py)


@dataclass(frozen=True)
class Resolved:
    config: dict[str, Any]
    filled: tuple[str, ...]  # one line per filled key: "key = value (source)"
    notes: tuple[str, ...] = ()  # what the user should hear about once (a value that differs from the Trainer's)


class _Resolution:
    """The config being resolved, the keys filled so far and the problems found so far."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.cfg = copy.deepcopy(dict(config))
        self.filled: list[str] = []
        self.problems: list[str] = []
        self.notes: list[str] = []
        # Values set by hand, in the config or by an explicit strategy argument: key -> "where it was set".
        self.origin = {key: "the config" for key in leaves(self.cfg) if get(self.cfg, key) != AUTO}

    def get(self, key: str) -> Any:
        return get(self.cfg, key)

    def fill(self, key: str, value: Any, why: str) -> None:
        set_key(self.cfg, key, value)
        self.filled.append(f"{key} = {fmt(value)} ({why})")

    def check(self, key: str, expected: Any, why: str) -> None:
        value = get(self.cfg, key)
        if key in self.origin and value is not MISSING and value != AUTO and not same(value, expected):
            self.problems.append(
                f'{key}: {self.origin[key]} has {fmt(value)}, {why} gives {fmt(expected)}; set it to "auto"'
            )


def resolve_config(config: Mapping[str, Any], ctx: AutoContext, source: str = "dict") -> Resolved:
    """Return a new config with every ``"auto"`` filled from ``ctx``.

    Raises one :class:`ConfigError` that lists every contradiction (key, config value, Trainer value) and every
    ``"auto"`` that has no source.
    """
    r = _Resolution(config)
    for section in (_precision, _strategy_arguments, _batch_sizes, _gradient_clipping, _optimizer_and_scheduler,
                    _buckets, _device_defaults, _hpz):
        section(r, ctx)
    if r.problems:
        raise ConfigError(report(f"DeepSpeed config ({source}) does not fit this Trainer", r.problems))
    return Resolved(r.cfg, tuple(r.filled), tuple(r.notes))


def _precision(r: _Resolution, ctx: AutoContext) -> None:
    """bf16/fp16 blocks follow Trainer(precision)."""
    bf16, fp16 = ctx.precision.startswith("bf16"), ctx.precision.startswith("16")
    why = f"Trainer(precision={ctx.precision!r})"
    for block, wanted in (("bf16", bf16), ("fp16", fp16)):
        key = f"{block}.enabled"
        current = r.get(key)
        if current == AUTO or (wanted and current is MISSING):
            r.fill(key, wanted, why)
        elif key in r.origin and current is not MISSING and not same(current, wanted):
            trainer_precision = {"bf16": "'bf16-mixed'", "fp16": "'16-mixed'"}[block] if current else "'32-true'"
            if current is True and not (bf16 or fp16):  # a 32-bit Trainer: the config's block wins, as in Lightning's
                rank_zero_warn(
                    f"{key}: {r.origin[key]} has true and wins over {why}, as in Lightning's DeepSpeedStrategy:"
                    f" DeepSpeed trains in {block} and nothing casts the inputs for it; pass"
                    f" Trainer(precision={trainer_precision}) to say so, or set the key to \"auto\"."
                )
                continue
            # Otherwise Lightning's DeepSpeedStrategy would train in a mix of both (or fail in DeepSpeed): refused.
            r.problems.append(
                f'{key}: {r.origin[key]} has {fmt(current)}, {why} gives {fmt(wanted)}; set it to "auto" (the Trainer'
                f" decides) or pass Trainer(precision={trainer_precision}). Lightning's DeepSpeedStrategy would"
                " silently train in the config's precision; HPUDeepSpeedStrategy refuses instead."
            )


def _strategy_arguments(r: _Resolution, ctx: AutoContext) -> None:
    """Explicit strategy arguments fill a key the config leaves out, and contradict one it sets differently."""
    for key, value in strategy_arg_values(ctx.strategy_args).items():
        current = r.get(key)
        label = _arg_label(key, ctx.strategy_args)
        if key.startswith("fp16.") and "fp16" not in r.cfg:
            continue  # no fp16 training: loss-scale arguments do not apply
        if current is MISSING or current == AUTO:
            if value != "none":
                r.fill(key, value, label)
                r.origin[key] = label
        elif not same(current, value):
            fix = 'set it to "auto"' if key in AUTO_KEYS else "remove the key or the argument"
            r.problems.append(f"{key}: the config has {fmt(current)}, {label} gives {fmt(value)}; {fix}")


def _batch_sizes(r: _Resolution, ctx: AutoContext) -> None:
    """Keys the config leaves out are set from the Trainer, as Lightning's own strategy does."""
    implicit = [key for key in TRAINER_KEYS if key not in r.cfg]
    r.cfg.update({key: AUTO for key in implicit})
    world, accum = ctx.world_size, ctx.accumulate_grad_batches
    if r.get("gradient_accumulation_steps") == AUTO:
        r.fill("gradient_accumulation_steps", accum, f"Trainer(accumulate_grad_batches={accum})")
    else:
        r.check("gradient_accumulation_steps", accum, f"Trainer(accumulate_grad_batches={accum})")
    micro, train = r.get("train_micro_batch_size_per_gpu"), r.get("train_batch_size")
    if micro == AUTO:
        if ctx.micro_batch_size is not None:
            r.fill("train_micro_batch_size_per_gpu", ctx.micro_batch_size, "train DataLoader batch_size")
        elif isinstance(train, int) and not isinstance(train, bool) and train % (accum * world) == 0:
            r.fill("train_micro_batch_size_per_gpu", train // (accum * world),
                   "train_batch_size / (accumulation * world size)")
        elif "train_micro_batch_size_per_gpu" in implicit or not ctx.fitting:
            r.fill("train_micro_batch_size_per_gpu", 1, "no train DataLoader batch size; 1, as Lightning")
        else:
            r.problems.append(
                'train_micro_batch_size_per_gpu: "auto" has no source: the train DataLoader has no single batch_size'
                " (a batch_sampler without one, several loaders, or no loader). Set it in the config."
            )
    elif ctx.logging_batch_size is not None:
        # As in Lightning: the argument sets DeepSpeed's micro batch, which DeepSpeed only uses for its throughput
        # logging and batch-size bookkeeping; training still runs on the loader's batches.
        if ctx.micro_batch_size is not None and ctx.micro_batch_size != micro:
            r.notes.append(
                f"DeepSpeed's train_micro_batch_size_per_gpu is {micro}"
                f" (HPUDeepSpeedStrategy(logging_batch_size_per_gpu={ctx.logging_batch_size})), the train"
                f" DataLoader's batch_size is {ctx.micro_batch_size}: DeepSpeed's throughput logging and its"
                " train_batch_size count the former; training runs on the loader's batches."
            )
    elif ctx.micro_batch_size is not None:
        r.check("train_micro_batch_size_per_gpu", ctx.micro_batch_size, "the train DataLoader's batch_size")
    micro = r.get("train_micro_batch_size_per_gpu")
    if isinstance(micro, int) and not isinstance(micro, bool):
        total = micro * accum * world
        why = f"micro batch {micro} x accumulation {accum} x world size {world}"
        if train == AUTO:
            r.fill("train_batch_size", total, why)
        else:
            r.check("train_batch_size", total, why)
    elif train == AUTO:
        r.problems.append('train_batch_size: "auto" needs train_micro_batch_size_per_gpu; set one of them.')


def _gradient_clipping(r: _Resolution, ctx: AutoContext) -> None:
    clip = ctx.gradient_clip_val
    if r.get("gradient_clipping") == AUTO:
        r.fill("gradient_clipping", float(clip or 0.0), f"Trainer(gradient_clip_val={clip})")
    elif clip is not None:
        r.check("gradient_clipping", float(clip), f"Trainer(gradient_clip_val={clip})")


def _optimizer_and_scheduler(r: _Resolution, ctx: AutoContext) -> None:
    """Optimizer/scheduler sections, from the module's hyperparameters and the Trainer's step count."""
    hp = _hparam_values(ctx.hparams)
    total = (ctx.total_steps, "Trainer.estimated_stepping_batches") if ctx.total_steps is not None else None
    warmup = hp.get("warmup_steps")
    if warmup is None and "warmup_ratio" in hp and ctx.total_steps is not None:
        ratio = hp["warmup_ratio"][0]
        warmup = (math.ceil(ratio * ctx.total_steps), f"hparam warmup_ratio={ratio} x {ctx.total_steps} steps")
    sources: tuple[tuple[str, tuple[Any, str] | None, str], ...] = (
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
        if key.split(".", 1)[0] not in r.cfg:
            continue
        if r.get(key) != AUTO:
            if src is not None:
                r.check(key, src[0], src[1])
        elif src is not None:
            r.fill(key, src[0], src[1])
        elif key == "scheduler.params.warmup_min_lr":
            r.fill(key, 0.0, "default, as Hugging Face")
        elif ctx.fitting:
            r.problems.append(f'{key}: "auto" has no source; {hint}, or set a number in the config.')


def _buckets(r: _Resolution, ctx: AutoContext) -> None:
    """Bucket sizes from the model's hidden size."""
    h = ctx.hidden_size
    sizes = bucket_sizes(h) if h else {}
    for key in BUCKET_KEYS:
        if r.get(key) != AUTO:
            continue
        if h:
            r.fill(key, sizes[key], f"model hidden size {h}")
        else:
            r.problems.append(
                f'{key}: "auto" needs the model\'s hidden size, and the model has no 2-D parameter yet (built in'
                " configure_model?). Add `hidden_size` to the module's hyperparameters or set a number."
            )


def _device_defaults(r: _Resolution, ctx: AutoContext) -> None:
    """Communication settings tuned per device, for the ZeRO stage in force, where the user set none."""
    stage = r.get(f"{ZERO}.stage")
    defaults = ctx.zero_defaults.get(stage, {}) if isinstance(stage, int) and not isinstance(stage, bool) else {}
    for key in DEVICE_TUNED_KEYS:
        current = r.get(key)
        if current is not MISSING and current != AUTO or ZERO not in r.cfg:
            continue
        name = key.split(".", 1)[1]
        no_scatter = r.get(f"{ZERO}.reduce_scatter") is False
        if name == "use_multi_rank_bucket_allreduce" and current is MISSING and no_scatter:
            continue  # without reduce_scatter every bucket is all-reduced: the switch has no effect
        if name in defaults:
            value, why = defaults[name]
            r.fill(key, value, f"{ctx.device_type} default for ZeRO-{stage}: {why}")
        elif current == AUTO:
            del r.cfg[ZERO][name]
            r.filled.append(f"{key} = DeepSpeed's default (no {ctx.device_type} default for ZeRO-{stage})")


def _hpz(r: _Resolution, ctx: AutoContext) -> None:
    """ZeRO++ hpZ's secondary partition: "auto" is the devices of one node (lightning_gaudi_ds/config/zeropp.py)."""
    if r.get(HPZ_KEY) != AUTO:
        return
    if ctx.devices_per_node:
        r.fill(HPZ_KEY, ctx.devices_per_node, "the devices of one node, hpZ's secondary partition")
    else:
        r.problems.append(f'{HPZ_KEY}: "auto" needs the devices per node, known once the Trainer (or Fabric) has'
                          " chosen them.")


def drop_device_tuned(config: Mapping[str, Any], explicit_args: Mapping[str, Any]) -> dict[str, Any]:
    """For Lightning's default config (no user config): the device-tuned keys Lightning filled from its argument
    defaults are removed, unless passed explicitly, so that the device's defaults fill them."""
    cfg = copy.deepcopy(dict(config))
    zero = cfg.get(ZERO)
    if isinstance(zero, dict):
        for key in DEVICE_TUNED_KEYS:
            name = key.split(".", 1)[1]
            if name not in explicit_args:
                zero.pop(name, None)
    return cfg


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


# ------------------------------------------------------------------------------- the strategy's state
class ConfigResolver:
    """A strategy's DeepSpeed config across Trainer calls.

    Holds where the config came from, the strategy arguments the caller set, and the config as it stood before
    its first resolution: every later resolution (a fit after validate, a new Trainer, ZeRO-3's second pass once
    ``configure_model`` has built the parameters) starts from it again, never from an already-filled config.
    """

    def __init__(self, explicit_args: Mapping[str, Any]) -> None:
        self.explicit_args = dict(explicit_args)
        self.source: str | None = None  # None: no user config; Lightning's default, built from the arguments
        self._base: dict[str, Any] | None = None
        self._unpublished: tuple[Resolved, list[str]] | None = None

    def load(self, config: Any) -> dict[str, Any] | None:
        """Load and validate the user's config (see :func:`load_config`); None when there is none."""
        loaded, self.source = load_config(config)
        if loaded is not None:
            validate_config(loaded, self.source or "dict")
        return loaded

    def start(self, current: Mapping[str, Any], hidden: int | None) -> dict[str, Any]:
        """A fresh copy of the unresolved config. For Lightning's default config (no user config) the bucket
        sizes become ``"auto"``, so they come from the model's hidden size rather than Lightning's 2e8."""
        if self._base is None:
            self._base = copy.deepcopy(without_disabled_offload(current))
        base = self._base
        if self.source is None:
            base = drop_device_tuned(base, self.explicit_args)
            if hidden:
                base = mark_model_buckets(base, self.explicit_args)
        return copy.deepcopy(base)

    def resolve(self, config: Mapping[str, Any], ctx: AutoContext) -> dict[str, Any]:
        """:func:`resolve_config`, comparing a user config with the explicit strategy arguments; a fit's result is
        kept for :meth:`take_unpublished`."""
        user = self.source is not None
        logging_batch = self.explicit_args.get("logging_batch_size_per_gpu")
        ctx = dataclasses.replace(
            ctx, strategy_args=self.explicit_args if user else {},
            logging_batch_size=logging_batch if isinstance(logging_batch, int) else None,
        )
        resolved = resolve_config(config, ctx, self.source or _DEFAULT_SOURCE)
        if ctx.fitting:
            hints = bucket_hints(config, ctx.hidden_size) if user else []
            self._unpublished = (resolved, [*resolved.notes, *hints])
        return resolved.config

    def add_filled(self, line: str) -> None:
        """A default chosen after resolution (the optimizer's, once ``configure_optimizers`` ran): logged and
        published with the last fit's filled keys."""
        if self._unpublished is not None:
            resolved, hints = self._unpublished
            self._unpublished = (dataclasses.replace(resolved, filled=(*resolved.filled, line)), hints)

    def take_unpublished(self) -> tuple[Resolved, list[str]] | None:
        """The last fit's resolved config and bucket hints, once."""
        pending, self._unpublished = self._unpublished, None
        return pending


def write_resolved(resolved: Resolved, directory: str | Path) -> Path:
    """Write the resolved config as ``<directory>/deepspeed_config.json`` (to reproduce the run); return the path."""
    path = Path(directory) / CONFIG_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(resolved.config, indent=2, default=repr) + "\n")
    return path


def explicit_arguments(cls: type, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The ``arguments`` whose value differs from the default of ``cls``'s ``__init__`` (the most derived class's
    default wins): a set argument can contradict a config, a default cannot. LightningCLI/jsonargparse passes
    every argument, defaults included, so an argument passed with its default value counts as not set."""
    defaults = _init_defaults(cls)
    return {k: v for k, v in arguments.items() if not _is_default(v, defaults.get(k, _NO_DEFAULT))}


_NO_DEFAULT = object()


def _init_defaults(cls: type) -> dict[str, Any]:
    defaults: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        for name, param in inspect.signature(inspect.unwrap(init)).parameters.items():
            if param.default is not inspect.Parameter.empty:
                defaults[name] = param.default
    return defaults


def _is_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    try:
        return type(value) is type(default) and bool(value == default)
    except Exception:  # noqa: BLE001  (an exotic __eq__: count the argument as set)
        return False


def publish_resolved(resolved: Resolved, hints: list[str], log_dir: str | Path, *, rank_zero: bool) -> None:
    """Log the resolved config once (``rank_zero``: on rank 0) and write it into ``log_dir``, to reproduce the run."""
    if rank_zero:
        from lightning.pytorch.utilities.rank_zero import rank_zero_info

        path = write_resolved(resolved, log_dir)
        # One line per fact; the whole config stays in the file (it can be megabytes).
        filled = "".join(f"\n  {line}" for line in resolved.filled) or " nothing"
        rank_zero_info(f"DeepSpeed config resolved (written to {path}); filled:{filled}")
        for hint in hints:
            rank_zero_info(hint)
