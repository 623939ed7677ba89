"""Where the planner's parameter counts come from: a number, a module class path, a Hugging Face config, a module.

Modules are built on the meta device (``configure_model`` too), so nothing is allocated whatever the size.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_gaudi_ds.errors import PlanError
from lightning_gaudi_ds.planning.buckets import hidden_size
from lightning_gaudi_ds.planning.memory import ModelSpec


def spec_from_module(module: nn.Module, name: str = "") -> ModelSpec:
    """Count a module's parameters (each shared parameter once; ZeRO-3 partitions by their full size)."""
    trainable, frozen, numels = 0, 0, []
    for param in module.parameters():
        n = int(getattr(param, "ds_numel", 0) or param.numel())
        numels.append(n)
        if param.requires_grad:
            trainable += n
        else:
            frozen += n
    return ModelSpec(params=trainable, frozen_params=frozen, hidden_size=hidden_size(module),
                     param_numels=tuple(numels), name=name or type(module).__name__)


def import_class(target: str) -> type:
    """``pkg.module:Class`` (or ``pkg.module.Class``) to the class; ``ValueError`` naming what is missing."""
    module_name, sep, attr = target.partition(":")
    if not sep and _is_module(target):  # `examples.train_lm`: the class is missing, not the module
        mod = importlib.import_module(target)
        classes = sorted(f"{target}:{n}" for n, v in vars(mod).items() if isinstance(v, type)
                         and issubclass(v, nn.Module) and v.__module__ == mod.__name__ and not n.startswith("_"))
        there = f" The torch.nn.Module classes there: {', '.join(classes)}" if classes else " It defines no nn.Module."
        raise PlanError(f"--model {target!r} is a module; add ':ClassName' to name the model class in it.{there}")
    if not sep:
        module_name, _, attr = target.rpartition(".")
    if not module_name or not attr:
        raise PlanError(f"--model {target!r} is not a class path. Use 'package.module:ClassName'")
    try:
        mod = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise PlanError(
            f"--model {target!r}: module {err.name!r} not found. Check the spelling, that the package is installed,"
            " or that its directory is on PYTHONPATH (run from the project root)"
        ) from err
    obj: Any = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n, v in vars(mod).items() if isinstance(v, type) and not n.startswith("_"))
            raise PlanError(f"--model {target!r}: {module_name!r} has no attribute {attr!r}."
                             f" Classes there: {', '.join(public) or 'none'}")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        raise PlanError(f"--model {target!r} is {type(obj).__name__} {obj!r}, not a torch.nn.Module subclass")
    return obj


def _is_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent that is no package, or not importable: not a module path
        return False


def build_on_meta(cls: type, init_args: Mapping[str, Any] | None = None, target: str = "") -> nn.Module:
    """Instantiate ``cls(**init_args)`` and run its ``configure_model`` on the meta device."""
    init_args = dict(init_args or {})
    target = target or f"{cls.__module__}:{cls.__qualname__}"
    try:
        inspect.signature(cls).bind(**init_args)
    except TypeError as err:
        params = inspect.signature(cls).parameters.values()
        required = [p.name for p in params if p.default is p.empty
                    and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in init_args]
        needs = f" It needs: {', '.join(required)}." if required else ""
        raise PlanError(
            f"--model {target}: cannot be built with --init-args {json.dumps(init_args)} ({err}).{needs}"
            f" Pass them as JSON, e.g. --init-args '{json.dumps({n: '...' for n in required} or {})}'"
        ) from err
    with torch.device("meta"):
        module = cls(**init_args)
        configure = getattr(module, "configure_model", None)
        if callable(configure):
            configure()
    return module


# Sizes of a Hugging Face config (and GPT-2's names for them) that must be whole numbers >= 1.
_HF_SIZES = ("hidden_size", "n_embd", "d_model", "num_hidden_layers", "n_layer", "num_attention_heads", "n_head",
             "num_key_value_heads", "intermediate_size", "vocab_size", "max_position_embeddings", "n_positions")


def load_hf_config(path: str | Path) -> Any:
    """A Hugging Face config from a local ``config.json`` (or its directory); nothing is downloaded."""
    try:
        from transformers import AutoConfig
    except ImportError as err:
        raise PlanError("--hf-config needs the `transformers` package: pip install transformers") from err
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    if not file.is_file():
        raise PlanError(f"--hf-config {str(path)!r}: no such file. Give a local config.json (or its directory)")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise PlanError(f"--hf-config {str(file)!r} is not valid JSON: {err}") from err
    model_type = raw.pop("model_type", None) if isinstance(raw, dict) else None
    if not model_type:
        raise PlanError(f"--hf-config {str(file)!r} has no 'model_type' (e.g. \"llama\", \"gpt2\")")
    for key in _HF_SIZES:
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise PlanError(f"--hf-config {str(file)!r}: {key}={value!r} is not allowed; a model size is a whole"
                             " number >= 1")
    try:
        return AutoConfig.for_model(model_type, **raw)
    except ValueError as err:
        raise PlanError(f"--hf-config {str(file)!r}: {err}") from err


def build_hf_on_meta(config: Any) -> nn.Module:
    """The causal-LM (else base) model of a Hugging Face config, on the meta device."""
    from transformers import AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError:
            return AutoModel.from_config(config)


def spec_from_hf_config(path: str | Path) -> ModelSpec:
    config = load_hf_config(path)
    return spec_from_module(build_hf_on_meta(config), name=f"{type(config).__name__} ({path})")


def unbuilt_copy(module: nn.Module) -> nn.Module:
    """A copy of a module without its Trainer, its parameters and buffers on the meta device (nothing is
    allocated, nothing is shared with the original)."""
    memo: dict[int, Any] = {}
    for param in module.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    for buffer in module.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    from lightning_gaudi_ds._compat import attached_trainer

    trainer = attached_trainer(module)
    if trainer is not None:
        memo[id(trainer)] = None
    return copy.deepcopy(module, memo)


def spec_before_configure_model(module: nn.Module) -> ModelSpec:
    """Count the parameters ``configure_model`` will create, building a copy of the module on the meta device.

    Lightning's ZeRO-3 builds the model inside ``deepspeed.zero.Init``; the stage must be known before that.
    """
    probe = unbuilt_copy(module)
    configure = getattr(probe, "configure_model", None)
    if callable(configure):
        with torch.device("meta"):
            configure()
    return spec_from_module(probe, name=type(module).__name__)
