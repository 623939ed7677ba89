"""Hugging Face ``transformers`` models under sequence parallelism, with no change to the user's model code.

transformers' attention modules (Llama, Mistral, Mixtral, Qwen2, GPT-2 and the other families written the same way)
look their attention function up in transformers' registry (``AttentionInterface``) by the name their config gives
(``config._attn_implementation``: ``"sdpa"``, ``"eager"``, flash attention). :func:`wrap` gives the attention modules
of one model a copy of its config naming :data:`ATTENTION`, a function registered once under that name, which runs
the model's own attention function inside Ulysses' exchange (:class:`~.attention.Exchange`). The model's config, and
every other model in the process, keep their attention.

Around the outermost model's ``forward`` (an instance attribute: Lightning clears a module's hooks before a ZeRO-3
evaluation engine), each call:

- gives the model the positions of this rank's part (``position_ids``, unless the caller passed them, which were then
  split with the batch): position embeddings and rotary embeddings see where the part lies in the sequence;
- gathers the caller's 2-D ``attention_mask`` across the group: attention runs on the whole sequence, with its whole
  padding mask (the model builds a mask for its part only, which the attention function replaces);
- and its loss (``loss_function``, a causal language model's) is :func:`~.loss.causal_lm_loss`: the labels shifted
  across the split, the mean over the whole sequences, the same value on every rank.
"""

from __future__ import annotations

import copy
import inspect
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module

from lightning_gaudi_ds import _compat
from lightning_gaudi_ds.errors import ConfigError, InvalidArgumentError
from lightning_gaudi_ds.sequence.attention import Exchange
from lightning_gaudi_ds.sequence.loss import causal_lm_loss

ATTENTION = "lightning_gaudi_ds_ulysses"  # the name registered in transformers' AttentionInterface
# Attention implementations the exchange can run (flash attention: without a padding mask built here).
IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
LOSS_TYPES = (None, "ForCausalLM")  # transformers' loss_type of the models whose loss is split here


def transformers_models(model: Module) -> list[Module]:
    """The outermost ``transformers.PreTrainedModel`` instances in ``model`` (none unless transformers is imported)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:
        return []
    base = modeling.PreTrainedModel
    found: list[Module] = []
    inner: set[int] = set()
    for module in model.modules():
        if isinstance(module, base) and id(module) not in inner:
            found.append(module)
            inner.update(id(m) for m in module.modules())
    return found


_CALLS_REGISTRY: dict[type, bool] = {}


def _calls_attention_registry(cls: type) -> bool:
    """Whether ``cls.forward`` looks its attention function up in transformers' registry."""
    if cls not in _CALLS_REGISTRY:
        try:
            source = inspect.getsource(cls.forward)  # type: ignore[attr-defined]
        except (OSError, TypeError):
            source = ""
        _CALLS_REGISTRY[cls] = "ALL_ATTENTION_FUNCTIONS" in source
    return _CALLS_REGISTRY[cls]


def attention_modules(model: Module) -> list[Module]:
    """The modules of ``model`` that call transformers' attention registry (self-attention layers)."""
    return [m for m in model.modules() if hasattr(m, "config") and _calls_attention_registry(type(m))]


def _heads(config: Any) -> tuple[int, int]:
    heads = int(config.num_attention_heads)
    return heads, int(getattr(config, "num_key_value_heads", None) or heads)


def check_model(model: Module, size: int) -> list[Module]:
    """Refuse, before training, a Hugging Face model that ``size`` ranks cannot share a sequence of; returns its
    attention modules."""
    name = type(model).__name__
    modules = attention_modules(model)
    if not modules:
        raise ConfigError(
            f"sequence_parallel_size={size}: no attention module of {name} calls transformers' attention registry"
            " (AttentionInterface), where sequence parallelism puts its all-to-all. Families written that way"
            " (Llama, Mistral, Mixtral, Qwen2, GPT-2 and most recent ones) need nothing; for another model, name its"
            " attention modules: HPUDeepSpeedStrategy(sequence_parallel_modules=[...])."
        )
    implementation = _implementation(modules[0].config)
    if implementation not in IMPLEMENTATIONS:
        raise ConfigError(
            f"sequence_parallel_size={size}: {name} uses attn_implementation={implementation!r}; sequence"
            f" parallelism runs {', '.join(map(repr, IMPLEMENTATIONS))}. Load the model with"
            " attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))."
        )
    problems = []
    for config_ in {id(m.config): m.config for m in modules}.values():
        heads, kv_heads = _heads(config_)
        uneven = [f"{n} {what}" for n, what in ((heads, "attention heads"), (kv_heads, "key-value heads")) if n % size]
        if uneven:
            problems.append(" and ".join(uneven))
    if problems:
        raise ConfigError(
            f"sequence_parallel_size={size}: {name} has {'; '.join(problems)}, which {size} ranks cannot share (each"
            f" rank attends with 1/{size} of the heads). Use a sequence_parallel_size that divides the number of"
            " key-value heads."
        )
    if any(getattr(m, "reorder_and_upcast_attn", False) for m in modules) and implementation == "eager":
        raise ConfigError(f"sequence_parallel_size={size}: {name} has reorder_and_upcast_attn=True, which bypasses"
                          " the attention registry; set it to False or use attn_implementation='sdpa'.")
    loss_type = getattr(model, "loss_type", None)
    if loss_type not in LOSS_TYPES:
        raise ConfigError(
            f"sequence_parallel_size={size}: {name} computes a {loss_type} loss, which needs every position of a"
            " sequence at once; sequence parallelism splits causal language models (…ForCausalLM) and base models"
            " (…Model, with your own loss: lightning_gaudi_ds.sequence.causal_lm_loss)."
        )
    return modules


def _implementation(config: Any) -> str:
    return str(getattr(config, "_attn_implementation", None) or "eager")


@dataclass
class _State:
    """What one model's forward leaves for its attention calls (and their recomputation in backward)."""

    exchange: Exchange
    implementation: str
    padding: Tensor | None = None  # (batch, sequence) bool, None: no padding
    positions: Tensor | None = None  # (batch or 1, sequence), the whole sequence's position ids
    loss_calls: int = 0
    modules: list[Module] = field(default_factory=list)
    configs: dict[int, Any] = field(default_factory=dict)  # id(module) -> its own config


_ROUTES: weakref.WeakKeyDictionary[Module, _State] = weakref.WeakKeyDictionary()


def _attention(module: Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
               **kwargs: Any) -> tuple[Tensor, None]:
    """The function registered as :data:`ATTENTION`: the module's model's own attention inside the exchange."""
    state = _ROUTES.get(module)
    if state is None:
        raise ConfigError(
            f"{type(module).__name__} has attn_implementation={ATTENTION!r}, which only the modules of a model set"
            " up by HPUDeepSpeedStrategy(sequence_parallel_size=...) can run. Give the model another implementation."
        )
    function = _attention_function(module, state.implementation)
    window = kwargs.get("sliding_window")
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    if state.positions is not None and "position_ids" in kwargs:
        kwargs["position_ids"] = state.positions

    def local(q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # (batch, sequence, heads / K, head size)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        mask = full_mask(state.implementation, q.shape[2], padding=state.padding, causal=causal, window=window,
                         dtype=q.dtype, device=q.device)
        out, _ = function(module, q, k, v, mask, **kwargs)
        return out

    out = state.exchange(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), local)
    return out, None


def _attention_function(module: Module, implementation: str) -> Callable[..., Any]:
    if implementation == "eager":  # each modeling file has its own, the registry none
        return sys.modules[type(module).__module__].eager_attention_forward
    return _compat.attention_function(implementation)


def full_mask(implementation: str, length: int, *, padding: Tensor | None, causal: bool, window: int | None,
              dtype: torch.dtype, device: torch.device) -> Tensor | None:
    """The attention mask of the whole sequence for ``implementation`` (None where it needs none: sdpa and flash
    attention are causal themselves, flash attention takes the window itself).

    ``padding``: ``(batch, length)``, True where a token is real. sdpa gets a boolean mask, eager an additive one; a
    padded position attends to itself, so that no row is empty (its output is never used)."""
    windowed = window is not None and window < length
    if implementation.startswith("flash_attention"):
        return padding
    if padding is None and not windowed and (implementation == "sdpa" or not causal):
        return None
    query = torch.arange(length, device=device).view(-1, 1)
    keys = torch.arange(length, device=device).view(1, -1)
    allowed = torch.ones(length, length, dtype=torch.bool, device=device)
    if causal:
        allowed &= keys <= query
    if windowed:
        assert window is not None
        allowed &= keys > query - window
    mask = allowed.view(1, 1, length, length)
    if padding is not None:
        mask = (mask & padding.to(device).view(padding.shape[0], 1, 1, length)) | torch.eye(
            length, dtype=torch.bool, device=device)
    if implementation == "sdpa":
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)


class WrappedModel:
    """One Hugging Face model under sequence parallelism (see the module's docstring); :meth:`unwrap` undoes it."""

    def __init__(self, model: Module, modules: list[Module], exchange: Exchange, rank: int) -> None:
        _compat.register_attention_function(ATTENTION, _attention)
        self.model = model
        self.state = _State(exchange=exchange, implementation=_implementation(modules[0].config), modules=modules)
        copies: dict[int, Any] = {}
        for module in modules:
            self.state.configs[id(module)] = module.config
            if id(module.config) not in copies:
                copies[id(module.config)] = _compat.with_attention_implementation(copy.copy(module.config), ATTENTION)
            module.config = copies[id(module.config)]
            _ROUTES[module] = self.state
        self._had_loss = "_loss_function" in vars(model)
        self._loss = vars(model).get("_loss_function")
        model.loss_function = self._loss_function  # type: ignore[assignment]
        model.forward = _model_forward(model, self.state, exchange, rank)

    def _loss_function(self, logits: Tensor, labels: Tensor | None = None, vocab_size: int | None = None,
                       num_items_in_batch: Any = None, ignore_index: int = -100,
                       shift_labels: Tensor | None = None, **kwargs: Any) -> Tensor:
        self.state.loss_calls += 1
        groups = self.state.exchange.groups
        return causal_lm_loss(logits, labels, group=groups.group, ignore_index=ignore_index, shift_labels=shift_labels,
                              num_items_in_batch=num_items_in_batch, gradient_scale=groups.gradient_scale)

    def unwrap(self) -> None:
        model = self.model
        model.__dict__.pop("forward", None)
        if self._had_loss:
            model.loss_function = self._loss  # type: ignore[assignment]
        else:
            model.__dict__.pop("_loss_function", None)
        for module in self.state.modules:
            module.config = self.state.configs[id(module)]
            _ROUTES.pop(module, None)
        self.state.modules = []
        self.state.padding = self.state.positions = None


def _model_forward(model: Module, state: _State, exchange: Exchange, rank: int) -> Callable[..., Any]:
    forward = type(model).forward.__get__(model)
    signature = inspect.signature(forward)
    group, size = exchange.group, exchange.size

    def sequence_parallel_forward(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        arguments = bound.arguments
        extra = arguments.get(_var_keyword(signature), {})

        def get(name: str) -> Any:
            return arguments[name] if name in arguments else extra.get(name)

        tokens = get("input_ids") if get("input_ids") is not None else get("inputs_embeds")
        if tokens is None:
            raise InvalidArgumentError(
                f"{type(model).__name__} under sequence parallelism needs input_ids or inputs_embeds")
        part = tokens.shape[1]
        positions = get("position_ids")
        if positions is None:
            positions = torch.arange(rank * part, (rank + 1) * part, device=tokens.device).unsqueeze(0)
            _set(arguments, extra, signature, "position_ids", positions)
            state.positions = torch.arange(part * size, device=tokens.device).unsqueeze(0)
        else:
            state.positions = _gather(positions, group, size)
        mask = get("attention_mask")
        if mask is not None and mask.dim() != 2:
            raise InvalidArgumentError(
                f"{type(model).__name__} under sequence parallelism takes a 2-D attention_mask (batch, sequence) of"
                f" padding, not one of shape {tuple(mask.shape)}")
        padding = None if mask is None else _gather(mask.to(torch.uint8), group, size).bool()
        state.padding = None if padding is None or bool(padding.all()) else padding
        state.loss_calls = 0
        output = forward(*bound.args, **bound.kwargs)
        if get("labels") is not None and getattr(output, "loss", None) is not None and state.loss_calls == 0:
            raise ConfigError(
                f"{type(model).__name__} computed its loss without transformers' loss_function, so it cannot be"
                " split across the sequence-parallel group. Compute it from the logits with"
                " lightning_gaudi_ds.sequence.causal_lm_loss(logits, labels)."
            )
        return output

    return sequence_parallel_forward


def _var_keyword(signature: inspect.Signature) -> str:
    return next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), "")


def _set(arguments: dict[str, Any], extra: dict[str, Any], signature: inspect.Signature, name: str, value: Any) -> None:
    if name in signature.parameters:
        arguments[name] = value
    else:
        extra[name] = value
        arguments[_var_keyword(signature)] = extra


def _gather(tensor: Tensor, group: Any, size: int) -> Tensor:
    """The parts of ``tensor`` (``(batch, part, ...)``) of every rank of ``group``, in order along dimension 1."""
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts, dim=1)
