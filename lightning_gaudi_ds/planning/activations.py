"""Activations are the part no formula knows: measure them with one forward/backward of one micro batch.

The module runs on one device in the training precision. Each parameter's gradient is dropped as soon as it is
accumulated (as ZeRO does when it moves gradients into its buckets), and when the module computes its own loss the
rest of its output is dropped before backward (a training step returns the loss only), so the peak above the starting
point is the activations kept for backward plus the gradients in flight. The second of two passes is measured, so that
one-time allocations (kernel workspaces, library pools) are not counted. On CUDA/HPU the device allocator's peak is
read; on CPU the C library's heap in use (``mallinfo2``: every tensor torch allocates) is sampled after each
operator, forward and backward.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_gaudi_ds._compat import TorchDispatchMode
from lightning_gaudi_ds.errors import ArgumentTypeError
from lightning_gaudi_ds.planning.memory import sequence_parallel_activation_bytes  # noqa: F401  (part of this API)
from lightning_gaudi_ds.precisions import PRECISION_DTYPES


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_reader() -> Callable[[], int] | None:
    """Bytes in use on the C heap (all arenas plus mmap'ed blocks), or None without glibc >= 2.33."""
    path = ctypes.util.find_library("c")
    libc = ctypes.CDLL(path) if path else None
    fn = getattr(libc, "mallinfo2", None)
    if fn is None:
        return None
    fn.restype = _MallInfo2

    def read() -> int:
        info = fn()
        return int(info.uordblks + info.hblkhd)

    return read


class HostPeak(TorchDispatchMode):
    """Peak C-heap bytes in use, sampled after every operator run under this mode (autograd's too)."""

    def __init__(self) -> None:
        super().__init__()
        reader = _heap_reader()
        if reader is None:
            import psutil

            process = psutil.Process()
            reader = lambda: int(process.memory_info().rss)  # noqa: E731  (coarser: freed memory may stay)
        self._read = reader
        self.start = self.peak = reader()
        self.peak_op = ""  # the operator after which the peak was seen

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        now = self._read()
        if now > self.peak:
            self.peak, self.peak_op = now, str(func)
        return out

    @property
    def delta(self) -> int:
        return max(0, self.peak - self.start)


@contextmanager
def _device_peak(device: torch.device) -> Iterator[Callable[[], int]]:
    mod = getattr(torch, device.type)  # torch.cuda / torch.hpu expose the allocator's statistics
    mod.synchronize(device)
    mod.reset_peak_memory_stats(device)
    start = mod.memory_allocated(device)
    yield lambda: int(mod.max_memory_allocated(device) - start)


def _own_loss(output: Any) -> torch.Tensor | None:
    """The loss the module computed itself: a Hugging Face output's ``loss``, or a dict's ``"loss"``."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def _loss_of(output: Any) -> torch.Tensor:
    loss = _own_loss(output)
    if loss is not None:
        return loss
    if isinstance(output, dict):
        output = next(iter(output.values()))
    if isinstance(output, (tuple, list)):
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise ArgumentTypeError(f"the module's output is {type(output).__name__}, not a tensor to take a loss of")
    return output.float().mean()


def _cast_inputs(inputs: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Every tensor of ``inputs`` (any nesting) on ``device``; floating-point ones in ``dtype``."""
    from lightning_utilities import apply_to_collection

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(device)
        return tensor.to(dtype) if tensor.is_floating_point() else tensor

    return apply_to_collection(inputs, torch.Tensor, cast)


def measure_activation_bytes(
    module: nn.Module,
    inputs: Any,
    precision: str = "bf16-mixed",
    device: torch.device | str | None = None,
) -> int:
    """Peak bytes of one forward/backward of ``module(inputs)`` above its parameters, gradients dropped.

    ``inputs``: one micro batch — a tensor, a tuple (positional arguments) or a dict (keyword arguments, a
    Hugging Face batch). The module is moved to ``device`` in the precision's parameter dtype, as DeepSpeed
    holds it. The loss is the output's ``loss`` when it has one (the rest of the output is freed before backward, as
    when ``training_step`` returns the loss), else the mean of the (first) output, which is then held through
    backward in place of what the training step's loss would keep.
    """
    dev = torch.device(device) if device is not None else next(module.parameters()).device
    dtype = getattr(torch, PRECISION_DTYPES.get(precision, "float32"))
    module.to(device=dev, dtype=dtype).train()
    handles = [p.register_post_accumulate_grad_hook(_drop_grad) for p in module.parameters() if p.requires_grad]
    inputs = _cast_inputs(inputs, dev, dtype)
    try:
        _forward_backward(module, inputs)  # warm-up: kernels' workspaces and the allocators' caches settle first
        if dev.type == "cpu":
            with HostPeak() as peak:
                _forward_backward(module, inputs)
            return peak.delta
        with _device_peak(dev) as measured:
            _forward_backward(module, inputs)
            getattr(torch, dev.type).synchronize(dev)
            return measured()
    finally:
        for handle in handles:
            handle.remove()
        module.zero_grad(set_to_none=True)


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


def _forward_backward(module: nn.Module, inputs: Any) -> None:
    if isinstance(inputs, dict):
        output = module(**inputs)
    elif isinstance(inputs, (tuple, list)):
        output = module(*inputs)
    else:
        output = module(inputs)
    loss = _own_loss(output)
    if loss is not None:
        # the module computed its loss: a training step returns it, and the rest of the output (a Hugging Face one
        # holds the logits and the key/value cache) is freed before backward
        del output
        loss.backward()
        return
    # the mean stands in for the training step's own loss, which (cross-entropy, MSE) keeps a tensor the size of the
    # output for backward: the output, held through backward, stands in for it
    _loss_of(output).backward()
