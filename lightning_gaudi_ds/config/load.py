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
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_gaudi_ds._compat import deepspeed_removed_config_keys
from lightning_gaudi_ds.config.keys import AUTO, AUTO_KEYS, ZERO, get, report

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
_IDENTIFIER = re.compile(r"[a-z][a-z0-9_]*")


class ConfigError(MisconfigurationException, ValueError):
    """A DeepSpeed config, strategy argument or Trainer setting that cannot be used as given; the message lists every
    problem found. A ``MisconfigurationException``, as Lightning raises in the same situations, and a ``ValueError``."""


class ConfigNotFoundError(ConfigError, FileNotFoundError):
    """The DeepSpeed config path does not exist (Lightning: ``MisconfigurationException``)."""


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
            f"HPUDeepSpeedStrategy(config={config!r}): expected a JSON file path or a dict,"
            f" got {type(config).__name__}."
        )
    path = Path(config).expanduser()
    source = source or str(path)
    if not path.is_file():
        where = f" (from {source})" if source != str(path) else ""
        raise ConfigNotFoundError(
            f"You passed in a path to a DeepSpeed config but the path does not exist: {str(path)!r}{where}. Pass an"
            f" existing JSON file or a dict, or unset {ENV_VAR}."
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
    top, zero = known_keys()
    removed_top, removed_zero = deepspeed_removed_config_keys()
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
    if get(config, "bf16.enabled") is True and get(config, "fp16.enabled") is True:
        problems.append(
            'bf16.enabled and fp16.enabled: both are true; DeepSpeed trains in one of them. Set both to "auto"'
            " (Trainer(precision=...) decides) or disable one."
        )
    for key in iter_auto(config):
        if key not in AUTO_KEYS:
            problems.append(f'{key}: "auto" is not accepted here (DeepSpeed would receive the string); set a value.')
    if problems:
        misplaced_auto = any('"auto" is not' in p for p in problems)
        note = f'Keys that may be "auto": {", ".join(AUTO_KEYS)}.' if misplaced_auto else ""
        raise ConfigError(report(f"DeepSpeed config ({source}) is invalid", problems, note))


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
