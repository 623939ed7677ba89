"""Ulysses' all-to-all around attention: before it, each rank of a sequence-parallel group holds its part of the
sequence for every head; the exchange gives it the whole sequence for ``1/K`` of the heads, attention runs as
without the split, and the reverse exchange gives each rank its part of the sequence back, for every head.

The exchange is DeepSpeed's ``DistributedAttention`` (``deepspeed.sequence.layer``, present in Habana's fork and in
upstream DeepSpeed; see :func:`lightning_gaudi_ds._compat.ulysses_attention`), its backward the reverse exchange.
:class:`Exchange` runs any attention function inside it; :func:`wrap_modules` puts it around the user's own
attention modules (``HPUDeepSpeedStrategy(sequence_parallel_modules=[...])``), :mod:`.hf` around Hugging Face
models' attention.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module

from lightning_gaudi_ds import _compat
from lightning_gaudi_ds._classes import module_classes as _module_classes
from lightning_gaudi_ds.errors import ArgumentTypeError, ConfigError
from lightning_gaudi_ds.sequence.groups import SequenceGroups

# The layouts of query, key and value a user's attention module may take: (batch, heads, sequence, head size) as
# torch's scaled_dot_product_attention, or (batch, sequence, heads, head size).
LAYOUTS = ("bhsd", "bshd")
LAYOUT_ATTRIBUTE = "sequence_parallel_layout"


def _run(query: Tensor, key: Tensor, value: Tensor, attention: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
    return attention(query, key, value)


class Exchange:
    """Attention over the whole sequence from this rank's part of it: ``query``, ``key``, ``value`` of shape
    ``(batch, part, heads, head size)`` in, ``attention(q, k, v)`` called with ``(batch, sequence, heads / K, head
    size)`` (it returns the same shape), ``(batch, part, heads, head size)`` out."""

    def __init__(self, groups: SequenceGroups) -> None:
        self.groups, self.group, self.size = groups, groups.group, groups.size
        self._layer = _compat.ulysses_attention(_run, groups.group)

    def __call__(self, query: Tensor, key: Tensor, value: Tensor,
                 attention: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
        counts = {"query": query.shape[2], "key": key.shape[2], "value": value.shape[2]}
        uneven = {name: n for name, n in counts.items() if n % self.size}
        if uneven:
            raise ConfigError(
                f"sequence_parallel_size={self.size}: attention has {_heads(uneven)}, which {self.size} ranks cannot"
                f" share (each rank attends with 1/{self.size} of the heads). Use a sequence_parallel_size that"
                f" divides {', '.join(map(str, sorted(set(counts.values()))))}."
            )
        # DeepSpeed 0.16 (Habana's fork) exchanges a tensor (and its gradient) only when the heads on each rank divide
        # by K as well: every tensor travels cut into finer heads (the same memory) until they do, joined after.
        fq, fk, fv = (self._finer(t) for t in (query, key, value))

        def local(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return _finer_heads(attention(_whole_heads(q, fq), _whole_heads(k, fk), _whole_heads(v, fv)), fq)

        out = _exchange(self._layer, _finer_heads(query, fq), _finer_heads(key, fk), _finer_heads(value, fv), local)
        return _whole_heads(out, fq)

    def _finer(self, tensor: Tensor) -> int:
        """How many parts each head of ``tensor`` (``(batch, sequence, heads, head size)``) travels in."""
        heads, size = tensor.shape[2], tensor.shape[3]
        parts = self.size // math.gcd(heads // self.size, self.size)
        if size % parts:
            raise ConfigError(
                f"sequence_parallel_size={self.size}: {heads} heads of size {size}: each rank's {heads // self.size}"
                f" heads cannot be exchanged in {self.size} even parts. Use a sequence_parallel_size that divides"
                f" {heads // self.size}."
            )
        return parts


def _finer_heads(tensor: Tensor, parts: int) -> Tensor:
    return tensor if parts == 1 else tensor.reshape(*tensor.shape[:2], tensor.shape[2] * parts, -1)


def _whole_heads(tensor: Tensor, parts: int) -> Tensor:
    return tensor if parts == 1 else tensor.reshape(*tensor.shape[:2], tensor.shape[2] // parts, -1)


@torch.compiler.disable  # DeepSpeed's all-to-all fills a buffer it allocated: compiled, its gradient would be lost
def _exchange(layer: Module, query: Tensor, key: Tensor, value: Tensor, attention: Callable[..., Tensor]) -> Tensor:
    return layer(query, key, value, 0, None, attention)


def _heads(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {name} heads" for name, n in counts.items())


def module_classes(value: Sequence[type[Module] | str] | type[Module] | str | None) -> tuple[type[Module], ...]:
    """``HPUDeepSpeedStrategy(sequence_parallel_modules=...)`` as module classes (import paths imported)."""
    classes = _module_classes(
        value, "sequence_parallel_modules", "Give the classes (or import paths) of your attention modules: modules"
        " whose forward takes query, key and value first and returns the attention output (see"
        " lightning_gaudi_ds.sequence).")
    for cls in classes:
        layout = getattr(cls, LAYOUT_ATTRIBUTE, "bhsd")
        if layout not in LAYOUTS:
            raise ConfigError(
                f"{cls.__name__}.{LAYOUT_ATTRIBUTE} = {layout!r}: sequence parallelism knows {LAYOUTS[0]!r}"
                f" ((batch, heads, sequence, head size), the default) and {LAYOUTS[1]!r}."
            )
    return classes


def find_modules(model: Module, classes: tuple[type[Module], ...]) -> list[Module]:
    """Every instance of ``classes`` in ``model``; a class the model lacks is a ``ConfigError`` naming close ones."""
    found = [m for m in model.modules() if isinstance(m, classes)]
    missing = [c.__name__ for c in classes if not any(isinstance(m, c) for m in found)]
    if missing:
        has = sorted({type(m).__name__ for m in model.modules()})
        close = sorted({n for name in missing for n in difflib.get_close_matches(name, has, n=3, cutoff=0.5)})
        listed = f"close names it has: {', '.join(close)}" if close else f"its module classes: {', '.join(has[:12])}"
        raise ConfigError(
            f"HPUDeepSpeedStrategy(sequence_parallel_modules=...): {type(model).__name__} has no"
            f" {', '.join(missing)} module ({listed}). Name the class of the modules that compute attention from"
            " query, key and value."
        )
    return found


_HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "n_head", "num_key_value_heads", "num_kv_heads")


def check_declared_heads(modules: list[Module], size: int) -> None:
    """Refuse, before training, attention modules whose declared head counts (``num_heads``, ``num_key_value_heads``
    and the like, where they have them) ``size`` does not divide; others are checked at their first call."""
    for module in modules:
        counts = {name: getattr(module, name) for name in _HEAD_ATTRIBUTES
                  if isinstance(getattr(module, name, None), int) and not isinstance(getattr(module, name), bool)}
        uneven = {name: n for name, n in counts.items() if n % size}
        if uneven:
            raise ConfigError(
                f"sequence_parallel_size={size}: {type(module).__name__} has "
                + ", ".join(f"{name}={n}" for name, n in uneven.items())
                + f", which {size} ranks cannot share (each rank attends with 1/{size} of the heads). Use a"
                " sequence_parallel_size that divides the number of heads."
            )


class WrappedModules:
    """The user's attention modules with the exchange around their ``forward`` (an instance attribute, removed by
    :meth:`unwrap`: hooks would not do, as Lightning clears a module's hooks before a ZeRO-3 evaluation engine)."""

    def __init__(self, modules: list[Module], exchange: Exchange) -> None:
        self.modules = modules
        for module in modules:
            module.forward = _wrapped_forward(module, exchange)

    def unwrap(self) -> None:
        for module in self.modules:
            module.__dict__.pop("forward", None)
        self.modules = []


def _wrapped_forward(module: Module, exchange: Exchange) -> Callable[..., Any]:
    forward = type(module).forward.__get__(module)
    heads_second = getattr(module, LAYOUT_ATTRIBUTE, "bhsd") == "bhsd"

    def sequence_parallel_forward(query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Any:
        def local(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if heads_second:
                out = forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), *args, **kwargs)
                return _tensor_output(module, out).transpose(1, 2)
            return _tensor_output(module, forward(q, k, v, *args, **kwargs))

        if heads_second:
            out = exchange(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), local)
            return out.transpose(1, 2)
        return exchange(query, key, value, local)

    return sequence_parallel_forward


def _tensor_output(module: Module, out: Any) -> Tensor:
    if not isinstance(out, Tensor):
        raise ArgumentTypeError(
            f"{type(module).__name__}.forward returned {type(out).__name__}: under sequence parallelism an attention"
            " module listed in sequence_parallel_modules returns one tensor, shaped as its query."
        )
    return out
