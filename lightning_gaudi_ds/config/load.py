"""Load a DeepSpeed config (JSON path, dict or ``$PL_DEEPSPEED_CONFIG_PATH``) and check it statically: unknown,
misspelled or removed keys, a bad ZeRO stage, ``"auto"`` where DeepSpeed cannot take it. Every problem is
reported at once, when the strategy is constructed, before any process starts.
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
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from lightning_gaudi_ds._compat import (
    deepspeed_reads_config_key,
    deepspeed_removed_config_keys,
    deepspeed_version,
    precision_config_models,
)
from lightning_gaudi_ds.config.keys import (
    AUTO,
    AUTO_KEYS,
    MAX_PROBLEMS,
    MISSING,
    ZERO,
    get,
    offloads_optimizer,
    offloads_parameters,
    report,
    short,
    without_disabled_offload,
)
from lightning_gaudi_ds.errors import (  # noqa: F401  (importable from here too)
    ConfigError,
    ConfigNotFoundError,
    InvalidArgumentError,
)

ENV_VAR = "PL_DEEPSPEED_CONFIG_PATH"

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
# Keys of INLINE_KEYS this package reads itself, so that they act on any DeepSpeed: the strategy's sequence
# parallelism (lightning_gaudi_ds.sequence; DeepSpeed 0.16 reads no such key).
READ_BY_THE_PACKAGE = frozenset({"sequence_parallel_size"})
_IDENTIFIER = re.compile(r"[a-z][a-z0-9_]*")


# ----------------------------------------------------------------------------------------------- load
def load_config(
    config: str | Path | Mapping[str, Any] | None, environ: Mapping[str, str] = os.environ
) -> tuple[dict[str, Any] | None, str | None]:
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
            f"HPUDeepSpeedStrategy(config={short(repr(config))}): expected a JSON file path or a dict,"
            f" got {type(config).__name__}."
        )
    path = Path(config).expanduser()
    source = source or str(path)
    try:
        path.is_file()
    except OSError as err:  # e.g. a whole JSON document passed as the "path": name too long
        raise ConfigNotFoundError(f"DeepSpeed config path {_quoted(str(path))} cannot be read ({err.strerror}). Pass"
                                  " the path of a JSON file, or the config itself as a dict.") from None
    if not path.is_file():
        where = f" (from {_quoted(source)[1:-1]})" if source != str(path) else ""
        if path.is_dir():
            raise ConfigError(f"DeepSpeed config path {_quoted(str(path))}{where} is a directory; pass the JSON file in"
                              f" it (e.g. {str(path / 'ds_config.json')!r}) or a dict.")
        relative = "" if path.is_absolute() else f" A relative path is read from the current directory, {os.getcwd()}."
        raise ConfigNotFoundError(
            f"You passed in a path to a DeepSpeed config but the path does not exist: {_quoted(str(path))}{where}."
            f" Pass an existing JSON file or a dict, or unset {ENV_VAR}.{relative}"
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


def _quoted(text: str, limit: int = 200) -> str:
    """``repr`` of a path, cut: a "path" can be a pasted config of megabytes."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


class _DuplicateKey(InvalidArgumentError):
    """A key twice in one JSON object (turned into a ConfigError naming the file and the key)."""


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


# ------------------------------------------------------------------------------------------- validate
@functools.cache
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


def validate_config(config: Mapping[str, Any], source: str = "dict") -> None:
    """Raise one :class:`ConfigError` listing every static problem of ``config`` (before any process trains).

    Checks: unknown or misspelled keys (top level and ``zero_optimization``, with the closest valid key),
    keys removed from DeepSpeed, a ZeRO stage outside 0-3, ``bf16`` and ``fp16`` both enabled, and ``"auto"``
    where DeepSpeed cannot take it.
    """
    problems = config_problems(config)
    if problems:
        misplaced_auto = any('"auto" is not' in p for p in problems)
        note = f'Keys that may be "auto": {", ".join(AUTO_KEYS)}.' if misplaced_auto else ""
        raise ConfigError(report(f"DeepSpeed config ({source}) is invalid", problems, note))


def config_problems(config: Mapping[str, Any]) -> list[str]:
    """What :func:`validate_config` reports, one ``"dotted.key: problem"`` line each."""
    top, zero = known_keys()
    removed_top, removed_zero = deepspeed_removed_config_keys()
    problems: list[str] = []
    for key in config:
        if key in removed_top:
            problems.append(f"{key}: removed from DeepSpeed. {removed_top[key]}")
        elif key not in top:
            problems.append(_unknown(key, top, "", suggest=len(problems) < MAX_PROBLEMS))
        elif key in INLINE_KEYS and key not in READ_BY_THE_PACKAGE and not deepspeed_reads_config_key(key):
            problems.append(f"{key}: DeepSpeed {deepspeed_version()} does not read this key (later releases do), so"
                            " it would have no effect. Remove it, or install a DeepSpeed that reads it.")
    section = config.get(ZERO)
    if section is not None and not isinstance(section, dict):
        fix = ' DeepSpeed\'s old boolean form means {"stage": 1}; write that.' if isinstance(section, bool) else ""
        problems.append(f"{ZERO}: expected a JSON object such as {{\"stage\": 2}}, got {short(section)}.{fix}")
    if isinstance(section, dict):
        for key in section:
            if key in removed_zero:
                problems.append(f"{ZERO}.{key}: removed from DeepSpeed. {removed_zero[key]}")
            elif key not in zero:
                problems.append(_unknown(key, zero, f"{ZERO}.", suggest=len(problems) < MAX_PROBLEMS))
        stage = section.get("stage", 0)
        if stage != AUTO and (isinstance(stage, bool) or stage not in (0, 1, 2, 3)):
            problems.append(
                f"{ZERO}.stage: {stage!r} is not a ZeRO stage. Allowed: 0, 1, 2, 3"
                " (0: no sharding, 1: optimizer states, 2: + gradients, 3: + parameters)."
            )
        elif stage in (0, 1, 2) and offloads_parameters(config):
            problems.append(
                f"{ZERO}.offload_param: parameter offload needs ZeRO stage 3, and stage {stage} would train without"
                " offloading anything. Set stage 3, or remove offload_param (offload_optimizer works with stages 1-2)."
            )
    if get(config, "bf16.enabled") is True and get(config, "fp16.enabled") is True:
        problems.append(
            'bf16.enabled and fp16.enabled: both are true; DeepSpeed trains in one of them. Set both to "auto"'
            " (Trainer(precision=...) decides) or disable one."
        )
    problems += _value_problems(config)
    problems += _section_problems(config)
    problems += _optimizer_problems(config)
    for key in iter_auto(config):
        if key not in AUTO_KEYS:
            problems.append(f'{key}: "auto" is not accepted here (DeepSpeed would receive the string); set a value.')
    return problems


# Top-level keys the strategy reads or resolves: (kind, lowest allowed value, what the value means).
_NUMBERS: dict[str, tuple[type, float, str]] = {
    "train_micro_batch_size_per_gpu": (int, 1, "samples per rank per step"),
    "gradient_accumulation_steps": (int, 1, "micro batches per optimizer step"),
    "train_batch_size": (int, 1, "samples per optimizer step over all ranks"),
    "gradient_clipping": (float, 0, "the gradient norm to clip to; 0 turns clipping off"),
    "steps_per_print": (int, 1, "steps between DeepSpeed's progress lines"),
}


def _value_problems(config: Mapping[str, Any]) -> list[str]:
    """Types and ranges of the top-level numbers the strategy reads or fills (DeepSpeed reads them unchecked)."""
    problems = []
    for key, (kind, low, meaning) in _NUMBERS.items():
        value = config.get(key, MISSING)
        if value is MISSING or value == AUTO:
            continue
        number = not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
        if not number or not math.isfinite(value) or value < low:
            allowed = "a whole number" if kind is int else "a finite number"
            auto = ' or "auto"' if key in AUTO_KEYS else ""
            problems.append(f"{key}: {short(value)} is not allowed; pass {allowed} >= {low:g}{auto} ({meaning}).")
    for key in ("bf16.enabled", "fp16.enabled"):  # pydantic would read "yes" or 1 as true
        value = get(config, key)
        if value is not MISSING and value != AUTO and not isinstance(value, bool):
            problems.append(f'{key}: {short(value)} is not a boolean; write true, false or "auto" (Trainer(precision='
                            "...) decides).")
    count = get(config, "activation_checkpointing.number_checkpoints")
    if count is not MISSING and count is not None and (isinstance(count, bool) or not isinstance(count, int)
                                                        or count < 1):
        problems.append(f"activation_checkpointing.number_checkpoints: {short(count)} is not allowed; pass a whole"
                        " number >= 1 (deepspeed.checkpointing.checkpoint calls per forward pass) or leave it out.")
    for section in ("optimizer", "scheduler"):
        block = config.get(section, MISSING)
        if block is MISSING or block is None:
            continue
        if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
            problems.append(f'{section}: expected {{"type": "<name>", "params": {{...}}}}, got {short(block)}.')
        elif not isinstance(block.get("params", {}), Mapping):
            problems.append(f"{section}.params: expected a JSON object of keyword arguments, got"
                            f" {short(block['params'])}.")
    return problems


def _section_models() -> dict[str, Any]:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return {ZERO: DeepSpeedZeroConfig, **precision_config_models()}


def _section_problems(config: Mapping[str, Any]) -> list[str]:
    """Nested keys and value types of the sections DeepSpeed checks with its own pydantic models, checked with
    those models now rather than after the process group started."""
    from pydantic import ValidationError

    problems = []
    for name, model in _section_models().items():
        section = (without_disabled_offload(config) if name == ZERO else config).get(name)
        if not isinstance(section, Mapping):
            if name != ZERO and section is not None:
                problems.append(f"{name}: expected a JSON object such as {{\"enabled\": true}}, got {short(section)}.")
            continue
        try:
            model(**_without_auto(section))
        except ValidationError as err:
            for error in err.errors():
                loc = [str(part) for part in error["loc"]]
                if name == ZERO and len(loc) == 1 and (error["type"] == "extra_forbidden" or loc[0] == "stage"):
                    continue  # reported by the key and stage checks, with DeepSpeed's removed keys
                problems.append(_pydantic_problem(name, model, loc, error))
        except (AssertionError, TypeError, ValueError) as err:  # a model validator's assertion: DeepSpeed's own words
            problems.append(f"{name}: {err}")
    return problems


def _without_auto(section: Mapping[str, Any]) -> dict[str, Any]:
    # "auto" is filled at setup; DeepSpeed's models would see the string.
    return {k: _without_auto(v) if isinstance(v, Mapping) else v for k, v in section.items() if v != AUTO}


def _pydantic_problem(name: str, model: Any, loc: list[str], error: Mapping[str, Any]) -> str:
    key = ".".join([name, *loc])
    if error["type"] == "extra_forbidden":
        fields = _model_keys(_model_at(model, loc[:-1]))
        return _unknown(loc[-1], frozenset(fields), f"{'.'.join([name, *loc[:-1]])}.")
    return f"{key}: {short(error.get('input'))} is not valid: {error['msg']}."


def _model_at(model: Any, loc: list[str]) -> Any:
    """The pydantic model of a nested section (``offload_optimizer`` -> its config class)."""
    import typing

    from pydantic import BaseModel

    for part in loc:
        info = model.model_fields.get(part) or next(
            (f for f in model.model_fields.values() if f.alias == part), None)
        if info is None:
            return None
        candidates = [info.annotation, *typing.get_args(info.annotation)]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return model


def _model_keys(model: Any) -> set[str]:
    if model is None:
        return set()
    return {n for n in model.model_fields} | {f.alias for f in model.model_fields.values() if f.alias}


# DeepSpeed's optimizer names -> the keyword arguments it passes on from optimizer.params, as
# (module, class) candidates; adam/adamw also take the flags DeepSpeed pops first.
_DS_ADAM_FLAGS = frozenset({"torch_adam", "adam_w_mode", "fp32_optimizer_states"})


def _optimizer_class(kind: str, params: Mapping[str, Any], config: Mapping[str, Any]) -> type | None:
    import torch

    kind = kind.lower()
    if kind in ("adam", "adamw"):
        if params.get("torch_adam"):
            return torch.optim.AdamW
        if offloads_optimizer(config):
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam
    if kind == "adagrad":
        return torch.optim.Adagrad
    if kind == "lamb":
        from deepspeed.ops.lamb import FusedLamb

        return FusedLamb
    if kind == "lion":
        from deepspeed.ops.lion import FusedLion

        return FusedLion
    return next((c for n, c in vars(torch.optim).items() if n.lower() == kind and isinstance(c, type)), None)


def _optimizer_problems(config: Mapping[str, Any]) -> list[str]:
    """``optimizer.params`` keys checked against the signature of the optimizer DeepSpeed will build."""
    import inspect

    block = config.get("optimizer")
    if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
        return []
    params = block.get("params") or {}
    if not isinstance(params, Mapping):
        return []
    try:
        cls = _optimizer_class(block["type"], params, config)
    except ImportError:
        return []
    if cls is None:
        return []
    signature = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.values()):
        return []
    allowed = {n for n in signature if n not in ("params", "model_params")}
    if block["type"].lower() in ("adam", "adamw"):
        allowed |= _DS_ADAM_FLAGS
    problems = []
    for key in params:
        if key not in allowed:
            close = difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=0.6)
            hint = f" Did you mean 'optimizer.params.{close[0]}'?" if close else ""
            problems.append(f"optimizer.params.{key}: not an argument of {cls.__name__} (DeepSpeed's"
                            f" {block['type']!r} optimizer here).{hint} Allowed: {', '.join(sorted(allowed))}.")
    return problems


def check_nvme(config: Mapping[str, Any], arg_values: Mapping[str, Any], source: str | None = None) -> None:
    """Refuse NVMe offload that DeepSpeed would fail on minutes later, after creating directories: a missing,
    non-directory or unwritable ``nvme_path``, or no libaio for DeepSpeed's async_io op.

    ``arg_values`` are the config keys the strategy's arguments fill (an offload device of ``"nvme"``); ``source``
    is where the user's config came from, None for the config Lightning builds from the strategy's arguments.
    """
    problems = []
    for section in ("offload_optimizer", "offload_param"):
        key = f"{ZERO}.{section}"
        device = get(config, f"{key}.device", None)
        if device in (None, AUTO):
            device = arg_values.get(f"{key}.device")
        if str(device).lower() != "nvme":
            continue
        path = get(config, f"{key}.nvme_path", None)
        how = (f"set {key}.nvme_path in the config ({source})" if source is not None else
               "pass HPUDeepSpeedStrategy(nvme_path=...) (LightningCLI: --trainer.strategy.nvme_path), Lightning's"
               " default '/local_nvme' is only a placeholder")
        if not isinstance(path, str) or not path:
            problems.append(f"{key}.nvme_path: NVMe offload needs a directory on a local NVMe drive; {how}.")
            continue
        where = Path(path)
        if not where.exists():
            problems.append(f"{key}.nvme_path={path!r} does not exist (DeepSpeed would create it and fail later);"
                            f" create it on a local NVMe drive or {how}.")
        elif not where.is_dir():
            problems.append(f"{key}.nvme_path={path!r} is not a directory; {how}.")
        elif not os.access(where, os.W_OK | os.X_OK):
            problems.append(f"{key}.nvme_path={path!r} is not writable by this user; {how}.")
    if _nvme_requested(config, arg_values) and not libaio_available():
        problems.append(
            "NVMe offload swaps through DeepSpeed's async_io op, which needs libaio, and this machine has none:"
            " install it (`apt-get install libaio-dev`, or `conda install -c conda-forge libaio`), then check"
            " `ds_report` lists async_io as compatible. Or offload to CPU (device 'cpu')."
        )
    if problems:
        raise ConfigError(report(f"NVMe offload ({source or 'HPUDeepSpeedStrategy arguments'})", problems))


def _nvme_requested(config: Mapping[str, Any], arg_values: Mapping[str, Any]) -> bool:
    for section in ("offload_optimizer", "offload_param"):
        key = f"{ZERO}.{section}.device"
        device = get(config, key, None)
        if str(arg_values.get(key) if device in (None, AUTO) else device).lower() == "nvme":
            return True
    return False


def libaio_available() -> bool:
    """Whether libaio (the library DeepSpeed's async_io op links) can be loaded."""
    import ctypes.util

    return ctypes.util.find_library("aio") is not None


def check_activation_checkpointing(config: Mapping[str, Any], source: str = "dict") -> None:
    """Refuse contiguous activation checkpointing that DeepSpeed would reject at the first training step.

    DeepSpeed sizes its contiguous checkpoint buffers from ``number_checkpoints`` (checkpointed calls per forward
    pass) and only partitions into them with ``partition_activations``; Lightning configures it with neither.
    """
    section = config.get("activation_checkpointing")
    if not isinstance(section, Mapping) or not section.get("contiguous_memory_optimization"):
        return
    problems = []
    count = section.get("number_checkpoints")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        got = "" if count is None else f" (got {count!r})"
        problems.append(
            "activation_checkpointing.number_checkpoints: contiguous_memory_optimization needs the number of"
            f" deepspeed.checkpointing.checkpoint calls in one forward pass{got}, to size its buffers. Set"
            ' "number_checkpoints": N in the config\'s activation_checkpointing section, or pass'
            " HPUDeepSpeedStrategy(number_checkpoints=N)."
        )
    if not section.get("partition_activations"):
        problems.append(
            "activation_checkpointing.partition_activations: contiguous_memory_optimization only works with"
            " partitioned activations; set partition_activations to true (HPUDeepSpeedStrategy("
            "partition_activations=True)), or turn contiguous_memory_optimization off."
        )
    if problems:
        raise ConfigError(report(f"DeepSpeed config ({source}): activation checkpointing", problems))


def _unknown(key: str, known: frozenset[str], prefix: str, suggest: bool = True) -> str:
    # Suggestions only for the problems an error shows: 200,000 unknown keys must not take minutes.
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6) if suggest else []
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
