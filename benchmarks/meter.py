"""Measuring instruments: a census of the tensors a training engine holds, a collective-bytes counter, RSS.

Tensor census
    Walks from explicit roots (the model's parameters, the DeepSpeed engine and its ZeRO optimizer, the
    inner torch optimizer) through attributes, lists and dicts, and counts every tensor *storage* once
    (deduplicated by ``untyped_storage().data_ptr()``; a view costs nothing extra, its whole base storage
    is counted). Each storage gets one category, by priority:

    ``params``     module parameters (ZeRO-3: the rank's partition ``ds_tensor`` and persistent params);
    ``optimizer``  the inner optimizer's own parameters (the fp32 master copy, when DeepSpeed keeps one)
                   and its state tensors (Adam's exp_avg / exp_avg_sq);
    ``grads``      ``.grad`` of any of those, and DeepSpeed attributes whose name says gradient;
    ``buffers``    every other tensor reachable from the engine (reduce buckets, flat copies, ...).

    A separate scan of all Python-visible tensors (``gc``) minus those alive before the model was
    built gives ``all_live``: what the census missed shows up as the difference.

Collective counter
    Wraps the ``torch.distributed`` collectives in this process and records, per call, the payload and
    the bytes one rank sends under the ring algorithms that NCCL/HCCL use ("ring bytes": all-reduce of M
    bytes sends 2M(N-1)/N, reduce-scatter and all-gather of M bytes send M(N-1)/N, ...). It must be
    installed before DeepSpeed's communication backend is created (it caches the functions).
    ``wchar_bytes`` reads what the process really wrote (``/proc/self/io``): on one host, gloo's traffic.
"""

from __future__ import annotations

import gc
import inspect
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch

CATEGORIES = ("params", "grads", "optimizer", "buffers")


# ------------------------------------------------------------------------------------------ tensors
def storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


@dataclass
class StorageInfo:
    nbytes: int
    category: str
    name: str
    host: bool = False


@dataclass
class Census:
    """Storages by pointer. ``by_device``: host/device told by ``tensor.device`` (on an accelerator);
    otherwise (CPU-only machine, where everything is "cpu") by role, through ``mark_host``."""

    by_device: bool = False
    storages: dict[int, StorageInfo] = field(default_factory=dict)

    def add(self, t: Optional[torch.Tensor], category: str, name: str) -> None:
        if t is None or not torch.is_tensor(t) or t.device.type == "meta":
            return
        ptr, nbytes = storage_key(t)
        if ptr == 0 or nbytes == 0 or ptr in self.storages:
            return
        self.storages[ptr] = StorageInfo(nbytes, category, name, self.by_device and t.device.type == "cpu")

    def mark_host_by_role(self, offload_optimizer: bool, offload_parameters: bool) -> None:
        if self.by_device:
            return
        for info in self.storages.values():
            info.host = offloaded_to_host(info.name, offload_optimizer, offload_parameters)

    def add_opaque(self, nbytes: int, category: str, name: str) -> None:
        """Bytes held out of Python's sight (DDP's C++ gradient buckets), known only by their size."""
        if nbytes > 0:
            self.storages[-1 - len(self.storages)] = StorageInfo(nbytes, category, name)

    def summary(self, top: int = 8) -> dict[str, Any]:
        """Bytes per category, host/device split, and the largest named families per category."""
        by_cat = {c: 0 for c in CATEGORIES}
        host = 0
        names: dict[str, int] = defaultdict(int)
        for info in self.storages.values():
            by_cat[info.category] += info.nbytes
            host += info.nbytes if info.host else 0
            names[f"{info.category}:{'host' if info.host else 'device'}:{_generic(info.name)}"] += info.nbytes
        total = sum(by_cat.values())
        return {
            **by_cat,
            "total": total,
            "host": host,
            "device": total - host,
            "names": dict(sorted(names.items(), key=lambda kv: -kv[1])[:top]),
        }


def _generic(name: str) -> str:
    """``optimizer.ipg_buffer[1]`` -> ``optimizer.ipg_buffer[*]``: groups a buffer family under one name."""
    out, depth = [], 0
    for ch in name:
        if ch == "[":
            depth += 1
            if depth == 1:
                out.append("[*]")
            continue
        if ch == "]":
            depth -= 1
            continue
        if depth == 0:
            out.append(ch)
    return "".join(out)


def _walkable(obj: Any) -> bool:
    mod = type(obj).__module__ or ""
    return mod.startswith("deepspeed") or isinstance(obj, torch.optim.Optimizer)


def walk_tensors(root: Any, name: str, max_depth: int = 8) -> Iterable[tuple[str, torch.Tensor]]:
    """Tensors reachable from ``root`` through attributes of DeepSpeed/optimizer objects and containers.

    Ordinary ``nn.Module`` attributes are not followed (their parameters are counted from the model);
    neither is anything else (loggers, process groups, the Trainer).
    """
    seen: set[int] = set()
    stack: list[tuple[Any, str, int]] = [(root, name, 0)]
    while stack:
        obj, path, depth = stack.pop()
        if id(obj) in seen or depth > max_depth:
            continue
        seen.add(id(obj))
        if torch.is_tensor(obj):
            yield path, obj
            if obj.is_leaf and obj.grad is not None:
                stack.append((obj.grad, path + ".grad", depth + 1))
            for k, v in getattr(obj, "__dict__", {}).items():
                if torch.is_tensor(v):
                    stack.append((v, f"{path}.{k}", depth + 1))
            continue
        if isinstance(obj, dict):
            items: Iterable[tuple[str, Any]] = ((f"{path}[{k!r}]" if not torch.is_tensor(k) else f"{path}[t]", v)
                                                for k, v in obj.items())
        elif isinstance(obj, (list, tuple)):
            items = ((f"{path}[{i}]", v) for i, v in enumerate(obj))
        elif isinstance(obj, torch.nn.Module) and not _walkable(obj):
            continue
        elif _walkable(obj):
            items = ((f"{path}.{k}", v) for k, v in vars(obj).items() if k not in ("module", "_modules"))
        else:
            continue
        for p, v in items:
            if torch.is_tensor(v) or isinstance(v, (dict, list, tuple)) or _walkable(v):
                stack.append((v, p, depth + 1))


def _category_by_name(path: str) -> str:
    """Category of a tensor found only by walking the engine: from DeepSpeed's attribute name.

    ``fp32_partitioned_groups_flat`` (ZeRO-3) and ``single_partition_of_fp32_groups`` (ZeRO-1/2) are the fp32
    master weights (optimizer states in the paper's accounting); ``*grad*`` attributes hold gradients, except
    the reduce buckets (``ipg``); everything else is a buffer.
    """
    attrs = [a.split("[", 1)[0].lower() for a in path.split(".")[1:]]
    leaf = next((a for a in reversed(attrs) if a not in ("grad", "buffer", "data")), "")
    if "fp32" in leaf and ("partition" in leaf or "group" in leaf) and attrs[-1] != "grad":
        return "optimizer"
    if any("ipg" in a or "bucket" in a for a in attrs):
        return "buffers"
    if "grad" in leaf or attrs[-1:] == ["grad"]:
        return "grads"
    return "buffers"


def inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer doing the update: DeepSpeed's ZeRO/BF16 wrappers keep it in ``.optimizer``."""
    inner = optimizer
    while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    return inner


def take_census(
    module: torch.nn.Module,
    optimizer: Any,
    engine: Optional[Any] = None,
    offload_optimizer: bool = False,
    offload_parameters: bool = False,
) -> Census:
    params = list(module.parameters())
    census = Census(by_device=any(p.device.type != "cpu" for p in params))
    inner = inner_optimizer(optimizer)
    # 1. parameters: the module's, and ZeRO-3's partitions
    for i, p in enumerate(params):
        census.add(getattr(p, "ds_tensor", None), "params", f"param[{i}].ds_tensor")
        if p.numel() > 0:
            census.add(p, "params", f"param[{i}]")
    # 2. optimizer: master copies and states
    opt_params = [q for g in getattr(inner, "param_groups", []) for q in g["params"]]
    for i, q in enumerate(opt_params):
        census.add(q, "optimizer", f"inner.param[{i}]")
    for i, state in enumerate(getattr(inner, "state", {}).values()):
        for k, v in state.items():
            census.add(v, "optimizer", f"inner.state[{i}].{k}")
    # 3. gradients of all of the above
    for i, p in enumerate(params):
        census.add(p.grad, "grads", f"param[{i}].grad")
        ds = getattr(p, "ds_tensor", None)
        census.add(getattr(ds, "grad", None), "grads", f"param[{i}].ds_tensor.grad")
    for i, q in enumerate(opt_params):
        census.add(q.grad, "grads", f"inner.param[{i}].grad")
    # 4. whatever else the engine and its optimizer wrapper hold
    roots = [("optimizer", optimizer)] + ([("engine", engine)] if engine is not None else [])
    for root_name, root in roots:
        for path, t in walk_tensors(root, root_name):
            census.add(t, _category_by_name(path), path)
    census.mark_host_by_role(offload_optimizer, offload_parameters)
    return census


# What ZeRO-Offload allocates on the host, by DeepSpeed attribute (deepspeed 0.19: stage_1_and_2.py and stage3.py
# create these with ``device=self.device``, which is "cpu" when the optimizer is offloaded; the optimizer states
# follow their fp32 master partition). Everything else is created on the accelerator.
_HOST_IF_OPTIMIZER_OFFLOADED = (
    "inner.param", "inner.state",  # fp32 master partitions (+ their fp32 gradient), Adam's states
    "single_partition_of_fp32_groups", "fp32_partitioned_groups_flat",
    "param_buffer_of_bit16_for_cpu_offload_groups", "temp_grad_buffer_for_cpu_offload",
    "grad_partitions_flat_buffer", "__param_id_to_grad_partition",  # ZeRO-3's gradient partitions
)
_HOST_IF_PARAMETERS_OFFLOADED = ("ds_tensor", "fp16_partitioned_groups_flat")


def offloaded_to_host(name: str, offload_optimizer: bool, offload_parameters: bool) -> bool:
    """On a CPU-only machine every tensor is on "cpu": tell host from device by the tensor's role."""
    keys = (_HOST_IF_OPTIMIZER_OFFLOADED if offload_optimizer else ()) + (
        _HOST_IF_PARAMETERS_OFFLOADED if offload_parameters else ())
    return any(k in name for k in keys)


def live_tensor_storages() -> dict[int, int]:
    """Every storage of a Python-visible tensor (and its .grad) in this process: ptr -> bytes."""
    out: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        objs = gc.get_objects()
        for o in objs:
            if isinstance(o, torch.Tensor):
                for t in (o, o.grad if o.is_leaf else None):
                    if t is not None and t.device.type != "meta":
                        ptr, n = storage_key(t)
                        if ptr:
                            out[ptr] = n
    return out


# ------------------------------------------------------------------------------------- collectives
def _world(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group) if group is not None else dist.get_world_size()


def _nbytes(x: Any) -> int:
    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


# op -> (argument holding the payload, factor f(N) of ring bytes sent per rank = f * payload)
_RING: dict[str, tuple[str, Callable[[int], float]]] = {
    "all_reduce": ("tensor", lambda n: 2 * (n - 1) / n),
    "all_reduce_coalesced": ("tensors", lambda n: 2 * (n - 1) / n),
    "reduce": ("tensor", lambda n: (n - 1) / n),
    "broadcast": ("tensor", lambda n: (n - 1) / n),
    "all_gather": ("tensor_list", lambda n: (n - 1) / n),
    "all_gather_into_tensor": ("output_tensor", lambda n: (n - 1) / n),
    "_all_gather_base": ("output_tensor", lambda n: (n - 1) / n),
    "all_gather_coalesced": ("output_tensor_lists", lambda n: (n - 1) / n),
    "reduce_scatter": ("input_list", lambda n: (n - 1) / n),
    "reduce_scatter_tensor": ("input", lambda n: (n - 1) / n),
    "_reduce_scatter_base": ("input", lambda n: (n - 1) / n),
    "all_to_all_single": ("input", lambda n: (n - 1) / n),
    "all_to_all": ("input_tensor_list", lambda n: (n - 1) / n),
    "send": ("tensor", lambda n: 1.0),
    "isend": ("tensor", lambda n: 1.0),
    "gather": ("tensor", lambda n: (n - 1) / n),
    "scatter": ("scatter_list", lambda n: (n - 1) / n),
}


class CollectiveCounter:
    """Counts calls, payload bytes and ring bytes per collective. ``install()`` once per process."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = defaultdict(int)
        self.payload: dict[str, int] = defaultdict(int)
        self.ring: dict[str, float] = defaultdict(float)
        self.detail: list[tuple[str, int]] = []  # (op, payload) of each call since the last clear
        self._installed = False

    def install(self) -> "CollectiveCounter":
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        if self._installed:
            return self
        for op, (arg, factor) in _RING.items():
            original = getattr(c10d, op, None) or getattr(dist, op, None)
            if original is None:
                continue
            wrapped = self._wrap(op, original, arg, factor)
            for ns in (dist, c10d):
                if getattr(ns, op, None) is original:
                    setattr(ns, op, wrapped)
        self._installed = True
        return self

    def _wrap(self, op: str, fn: Callable[..., Any], arg: str, factor: Callable[[int], float]) -> Callable[..., Any]:
        sig = inspect.signature(fn)
        counter = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = sig.bind_partial(*args, **kwargs).arguments
                payload = _nbytes(bound.get(arg))
                counter.calls[op] += 1
                counter.payload[op] += payload
                counter.ring[op] += payload * factor(_world(bound.get("group")))
                if len(counter.detail) < 200:
                    counter.detail.append((op, payload))
            except Exception:  # never let counting break training
                counter.calls[op + "?"] += 1
            return fn(*args, **kwargs)

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        wrapper.__name__ = getattr(fn, "__name__", op)
        return wrapper

    def snapshot(self) -> dict[str, Any]:
        return {"calls": dict(self.calls), "payload": dict(self.payload), "ring": dict(self.ring),
                "wchar": wchar_bytes()}


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("calls", "payload", "ring"):
        a, b = after[key], before[key]
        out[key] = {k: a[k] - b.get(k, 0) for k in a if a[k] - b.get(k, 0)}
    out["ring_total"] = sum(out["ring"].values())
    out["payload_total"] = sum(out["payload"].values())
    out["wchar"] = after["wchar"] - before["wchar"]
    return out


def wchar_bytes() -> int:
    """Bytes this process passed to write-like system calls (sockets included): /proc/self/io."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


# --------------------------------------------------------------------------------------------- RSS
def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
