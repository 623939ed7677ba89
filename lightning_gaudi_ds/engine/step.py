"""What surrounds each of the strategy's calls into the DeepSpeed engine (a training, evaluation or optimizer step,
a backward pass): HPU lazy mode's graph breaks, DeepSpeed's own deprecation warnings silenced, contiguous activation
checkpoint buffers emptied after a forward without a backward."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from lightning_gaudi_ds.engine import checkpointing
from lightning_gaudi_ds.engine.device import DeviceRuntime


@contextlib.contextmanager
def third_party_deprecations_silenced() -> Iterator[None]:
    """Inside the strategy's own calls only: DeepSpeed's ZeRO collectives call torch's deprecated
    ``all_gather_into_tensor`` (a FutureWarning per rank on every run), which the user can do nothing about."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor` is deprecated", category=FutureWarning)
        yield


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
