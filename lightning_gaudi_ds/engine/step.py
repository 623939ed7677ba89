"""What surrounds each of the strategy's calls into the DeepSpeed engine (a training, evaluation or optimizer step,
a backward pass): HPU lazy mode's graph breaks, DeepSpeed's own deprecation warnings silenced, contiguous activation
checkpoint buffers emptied after a forward without a backward."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from lightning_gaudi_ds.engine import checkpointing
from lightning_gaudi_ds.engine.device import DeviceRuntime

_P = ParamSpec("_P")
_R = TypeVar("_R")


@contextlib.contextmanager
def third_party_deprecations_silenced() -> Iterator[None]:
    """Inside the strategy's own calls only: DeepSpeed's ZeRO collectives call torch's deprecated
    ``all_gather_into_tensor`` and (ZeRO-3's gradients) ``reduce_scatter_tensor``: a FutureWarning per rank, and
    again after every call (leaving ``catch_warnings`` resets which warnings were shown), that the user can do nothing
    about."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TORCH_DEPRECATED_COLLECTIVES, category=FutureWarning)
        yield


# torch 2.13's deprecated names of the collectives DeepSpeed 0.16-0.19 calls
_TORCH_DEPRECATED_COLLECTIVES = r".*(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


@contextlib.contextmanager
def step(
    runtime: DeviceRuntime, *, graph_break: bool = True, evaluation_config: Mapping[str, Any] | None = None
) -> Iterator[None]:
    """Around one engine call. ``graph_break``: end the HPU lazy-mode graph after the call (backward, optimizer
    step); ``evaluation_config``: a validation/test/predict step under this DeepSpeed config, with a graph break
    before and after it and the activation checkpoint buffers reset after its forward."""
    if evaluation_config is not None:
        runtime.graph_break()
    with third_party_deprecations_silenced():
        yield
    if graph_break or evaluation_config is not None:
        runtime.graph_break()
    if evaluation_config is not None:
        checkpointing.reset_after_forward(evaluation_config)


class EngineCaller(Protocol):
    """What :func:`engine_call` reads of the strategy whose method it makes."""

    _runtime: DeviceRuntime
    config: Any


def engine_call(
    method: Callable[Concatenate[Any, _P], _R], *, graph_break: bool = True, evaluation: bool = False
) -> Callable[Concatenate[EngineCaller, _P], _R]:
    """A strategy method that runs the base class's ``method`` (``DeepSpeedStrategy.backward``: looked up as
    ``super()`` would, on each call) inside :func:`step` with the strategy's ``_runtime``; ``evaluation``: under the
    strategy's ``config`` (validation, test, predict)."""
    name = method.__name__

    @functools.wraps(method)
    def call(strategy: EngineCaller, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        owner = next(cls for cls in type(strategy).__mro__ if cls.__dict__.get(name) is call)
        with step(strategy._runtime, graph_break=graph_break,
                  evaluation_config=strategy.config if evaluation else None):
            return getattr(super(owner, strategy), name)(*args, **kwargs)

    return call
