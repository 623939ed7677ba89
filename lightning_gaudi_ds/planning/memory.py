"""Bytes per rank for DeepSpeed ZeRO stages 0-3, with and without offload, and the choice of the fastest that fits.

What DeepSpeed 0.19 allocates, per rank, for Ψ trainable parameters on N data-parallel ranks (``p``: bytes of a
parameter in the training precision, 2 for bf16/fp16, 4 for fp32; ``k``: optimizer state bytes, 8 for Adam):

============  ==============================================  ==========================================
stage         at rest (optimizer step's entry)                 inside the step (peak)
============  ==============================================  ==========================================
0, half       p + p (grads) + 4 (fp32 master) + k             + 4 (fp32 gradient copy)
0, fp32       4 + 4 + k                                       (no copy)
1 and 2       p + (4 + k + p) / N  (fp32 master partition,    + (4 - p) / N (fp32 gradient partition
              moments, gradient partition)                    replaces the low-precision one)
3             (p + 4 + k + p) / N + reduce bucket             + 4 / N (fp32 gradient partition)
============  ==============================================  ==========================================

With the optimizer offloaded the fp32 master, moments and fp32 gradient partition live on the host (pinned
when ``pin_memory``), stages 1-2 add a ``p / N`` host copy of the parameters (``param_buffer_of_bit16_for_cpu
_offload_groups``) and two staging buffers of the largest parameter; stage 3 moves the gradient partition to
the host too, and with parameter offload the ``p / N`` parameter partition. These are the tensors
``benchmarks/meter.py`` counts (``stage_1_and_2.py`` / ``stage3.py``); ``benchmarks/planner.py`` holds the
formula against it. Beside the model states, transient buffers during backward: reduce buckets
(``reduce_bucket_size`` elements, two with ``overlap_comm`` in stages 1-2), and for ZeRO-3 the parameters
gathered for the running module plus the prefetch bucket (at most ``stage3_max_live_parameters``) and the
persistent parameters (below ``stage3_param_persistence_threshold``) kept whole on every rank. Inside the step,
torch's Adam adds two fp32 temporaries of the tensor it updates (ZeRO-1/2/3: one flat partition of Ψ/N
elements), and with several parameter groups ZeRO-1/2 keep their low-precision gradient buffer until the last
group has stepped. The device peak is the larger of backward (states at rest + buffers + activations) and the
step (states inside it + temporaries).

Bytes on the wire per step come from :mod:`lightning_gaudi_ds.planning.wire` (the theory ``benchmarks/wire.py``
holds against two hosts' link counters): ``comm_bytes`` is what one rank sends under ring collectives (NCCL, HCCL;
an all-reduce of M bytes sends 2M(N-1)/N, a reduce-scatter or all-gather M(N-1)/N), ``inter_node_bytes`` what
each node sends to the others under the device's own algorithm (gloo on CPU). ZeRO-1/2 reduce each gradient
slice to its owner where the config says so (``reduce_scatter`` on, ``use_multi_rank_bucket_allreduce`` off: the
strategy's CPU and CUDA default; on HPU they all-reduce, Habana's configs; :meth:`Buckets.for_model` reads the
device table). ZeRO-3 counts the backward all-gather: an upper bound, since DeepSpeed keeps gathered parameters
through backward while they are within ``stage3_max_reuse_distance``. With hpZ (``zero_hpz_partition_size`` =
devices per node) the backward all-gather stays inside each node, and every rank holds a secondary partition of
the parameters, ``p / devices`` per parameter (``ds_secondary_tensor``, on the host with parameter offload).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_gaudi_ds.errors import PlanError
from lightning_gaudi_ds.planning import wire
from lightning_gaudi_ds.planning.buckets import bucket_sizes
from lightning_gaudi_ds.planning.units import format_bytes
from lightning_gaudi_ds.precisions import HALF_PRECISIONS, PRECISIONS

# Lightning's DeepSpeedStrategy defaults, and DeepSpeed's where Lightning sets none
LIGHTNING_REDUCE_BUCKET = 200_000_000
LIGHTNING_ALLGATHER_BUCKET = 200_000_000
DS_PREFETCH_BUCKET = 50_000_000
DS_PERSISTENCE_THRESHOLD = 100_000
DS_MAX_LIVE_PARAMETERS = 1_000_000_000

OPTIMIZER_STATE_BYTES = {"adam": 8.0, "adamw": 8.0, "sgd": 4.0, "adagrad": 4.0, "lamb": 8.0}
DEFAULT_HEADROOM = 0.10

# (stage, offload_optimizer, offload_parameters), fastest first: no offload before offload, lowest stage first
CONFIGURATIONS: tuple[tuple[int, bool, bool], ...] = (
    (0, False, False), (1, False, False), (2, False, False), (3, False, False),
    (1, True, False), (2, True, False), (3, True, False), (3, True, True),
)


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know of a model. ``param_numels``: every parameter's element count when the
    model itself was seen (it decides the ZeRO-3 persistent parameters and the offload staging buffers)."""

    params: int  # trainable parameters
    frozen_params: int = 0
    hidden_size: int | None = None
    param_numels: tuple[int, ...] = ()
    name: str = ""

    @property
    def total_params(self) -> int:
        return self.params + self.frozen_params

    @property
    def largest_param(self) -> int:
        """Largest parameter's element count; without the model, one hidden x hidden matrix (or 0)."""
        if self.param_numels:
            return max(self.param_numels)
        return (self.hidden_size or 0) ** 2

    def persistent_params(self, threshold: int) -> int:
        """Elements ZeRO-3 keeps whole on every rank (parameters below the persistence threshold)."""
        return sum(n for n in self.param_numels if n < threshold)


@dataclass(frozen=True)
class Buckets:
    """DeepSpeed's bucket settings in elements, as the strategy resolves them."""

    reduce_bucket_size: int = LIGHTNING_REDUCE_BUCKET
    allgather_bucket_size: int = LIGHTNING_ALLGATHER_BUCKET
    stage3_prefetch_bucket_size: int = DS_PREFETCH_BUCKET
    stage3_param_persistence_threshold: int = DS_PERSISTENCE_THRESHOLD
    stage3_max_live_parameters: int = DS_MAX_LIVE_PARAMETERS
    overlap_comm: bool = True
    pin_memory: bool = False
    reduce_to_owner: bool = True  # ZeRO-1/2 gradients: reduce to the owning rank (else all-reduce each bucket)

    @classmethod
    def for_model(cls, hidden_size: int | None, zero_config: Mapping[str, Any] | None = None,
                  device_type: str | None = None) -> Buckets:
        """The strategy's sizes: from the hidden size when known (its ``"auto"`` rule), else Lightning's
        defaults; keys of a ``zero_optimization`` section given as numbers override both. The communication
        keys the config leaves unset (``overlap_comm``, how ZeRO-1/2 reduce gradients) take the strategy's
        defaults for ``device_type`` (the device table, :mod:`lightning_gaudi_ds.devices`; ``None``: the device
        here), for the config's stage (ZeRO-2 when it names none), else DeepSpeed's."""
        values: dict[str, Any] = {}
        if hidden_size:
            values = {k.rsplit(".", 1)[-1]: v for k, v in bucket_sizes(hidden_size).items()}
        zero = zero_config or {}
        setting = _device_zero_setting(zero, device_type)
        values["overlap_comm"] = bool(setting("overlap_comm", None))
        # DeepSpeed 0.19 all-reduces ZeRO-1/2 buckets unless reduce_scatter is on and multi-rank all-reduce off
        values["reduce_to_owner"] = bool(setting("reduce_scatter", True)) and not setting(
            "use_multi_rank_bucket_allreduce", True)
        for key, value in (zero_config or {}).items():
            if key in cls.__dataclass_fields__ and isinstance(value, (int, float, bool)):
                values[key] = type(getattr(cls, key))(value)
        for key in ("offload_optimizer", "offload_param"):
            pin = ((zero_config or {}).get(key) or {}).get("pin_memory")
            if isinstance(pin, bool):
                values["pin_memory"] = pin
        return cls(**values)


def _device_zero_setting(zero: Mapping[str, Any], device_type: str | None) -> Any:
    """``setting(key, deepspeed_default)``: the config's value, else the device table's for the config's stage,
    else DeepSpeed's default (``overlap_comm``: on for ZeRO-3 only)."""
    from lightning_gaudi_ds.devices import detect_device_type, device_spec

    stage = zero.get("stage")
    stage = stage if stage in (0, 1, 2, 3) and not isinstance(stage, bool) else 2
    defaults = device_spec(device_type or detect_device_type()).zero_defaults.get(stage, {})

    def setting(key: str, deepspeed_default: Any) -> Any:
        if isinstance(zero.get(key), bool):
            return zero[key]
        if key in defaults:
            return defaults[key][0]
        return stage == 3 if key == "overlap_comm" else deepspeed_default

    return setting


@dataclass
class Parts:
    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    buffers: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.buffers


@dataclass
class PlanRow:
    stage: int
    offload_optimizer: bool
    offload_parameters: bool
    device_bytes: int  # per rank: the larger of backward_peak_bytes and step_peak_bytes
    host_bytes: int  # per node: the offloaded states of every rank on it
    fits: bool | None  # None when the device memory is unknown
    fits_device: bool | None
    fits_host: bool | None
    model_state_bytes: int  # per rank, device + host, at the optimizer step's peak (what benchmarks/meter.py counts)
    device_model_state_bytes: int
    host_bytes_per_rank: int
    transient_bytes: int  # reduce buckets, ZeRO-3 gathered / persistent parameters and (gloo) its reduce copy
    activation_bytes: int | None
    step_temporary_bytes: int  # the torch optimizer's own temporaries during its update
    backward_peak_bytes: int  # device: states at the step's entry + transient + activations
    step_peak_bytes: int  # device: states inside the step + the optimizer's temporaries
    comm_bytes: int  # sent per rank per optimizer step (ring collectives)
    inter_node_bytes: int  # sent by each node to the others per optimizer step (the device's algorithm)
    device_parts: dict[str, int] = field(default_factory=dict)
    host_parts: dict[str, int] = field(default_factory=dict)
    label: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bytes_per_param(precision: str) -> float:
    """Bytes of one parameter (and one gradient) in the training precision."""
    if precision not in PRECISIONS:
        raise PlanError(f"precision={precision!r} is not one the planner knows. Allowed: {', '.join(PRECISIONS)}")
    return 2.0 if precision in HALF_PRECISIONS else 4.0


def optimizer_state_bytes(optimizer: str) -> float:
    key = optimizer.lower()
    if key not in OPTIMIZER_STATE_BYTES:
        raise PlanError(
            f"optimizer={optimizer!r} is not one the planner knows. Allowed: {', '.join(OPTIMIZER_STATE_BYTES)}"
        )
    return OPTIMIZER_STATE_BYTES[key]


def label(stage: int, offload_optimizer: bool, offload_parameters: bool, hpz: bool = False) -> str:
    text = f"ZeRO-{stage}" + (" + hpZ" if hpz and stage == 3 else "")
    if offload_parameters:
        return text + " + offload optimizer & params"
    return text + (" + offload optimizer" if offload_optimizer else "")


def model_states(
    stage: int,
    precision: str,
    world_size: int,
    offload_optimizer: bool = False,
    offload_parameters: bool = False,
    optimizer: str = "adamw",
    frozen_fraction: float = 0.0,
    param_groups: int = 1,
) -> tuple[Parts, Parts]:
    """(device, host) bytes per trainable parameter per rank at the optimizer step's peak.

    ``frozen_fraction``: frozen parameters per trainable one; they hold their low-precision copy only.
    ``param_groups``: the optimizer's parameter groups. ZeRO-1/2 step one group at a time, and their
    low-precision gradient partitions share one buffer, which lives until the last group has stepped.
    """
    if stage not in (0, 1, 2, 3):
        raise PlanError(f"stage={stage!r} is not a ZeRO stage. Allowed: 0, 1, 2, 3")
    if offload_parameters and not (stage == 3 and offload_optimizer):
        raise PlanError("parameter offload needs stage 3 with the optimizer offloaded too")
    if offload_optimizer and stage == 0:
        raise PlanError("ZeRO-Offload needs stage 1, 2 or 3")
    p, k, n = bytes_per_param(precision), optimizer_state_bytes(optimizer), float(world_size)
    half = p < 4
    dev, host = Parts(), Parts()
    if stage == 0:
        dev.params = p * (1 + frozen_fraction)
        dev.grads = p + (4.0 if half else 0.0)
        dev.optimizer = k + (4.0 if half else 0.0)
        return dev, host
    opt = host if offload_optimizer else dev
    opt.optimizer = (4.0 + k) / n  # fp32 master partition + moments
    opt.grads = 4.0 / n  # fp32 gradient partition (replaces the low-precision one in stages 1-2)
    if stage in (1, 2):
        dev.params = p * (1 + frozen_fraction)
        if offload_optimizer:
            host.buffers = p / n  # param_buffer_of_bit16_for_cpu_offload_groups
        elif param_groups > 1 and half:
            dev.grads += p / n
        return dev, host
    # stage 3: the low-precision gradient partition stays beside the fp32 one
    opt.grads += p / n
    (host if offload_parameters else dev).params = p * (1 + frozen_fraction) / n
    return dev, host


def step_only_bytes(stage: int, precision: str, world_size: int, offload_optimizer: bool = False,
                    param_groups: int = 1) -> float:
    """Device bytes per trainable parameter of :func:`model_states` that exist inside the optimizer step only
    (the fp32 gradient DeepSpeed builds there); before it, during backward, they are not allocated yet."""
    p, n = bytes_per_param(precision), float(world_size)
    if offload_optimizer:
        return 0.0  # the fp32 gradient partition lives on the host for good
    if stage == 0:
        return 4.0 if p < 4 else 0.0
    if stage in (1, 2):
        return (4.0 - p) / n + (p / n if param_groups > 1 and p < 4 else 0.0)
    return 4.0 / n


OPTIMIZER_TEMPORARIES = {"adam": 2, "adamw": 2, "lamb": 2, "adagrad": 1, "sgd": 0}


def step_temporary_bytes(stage: int, optimizer: str, spec: ModelSpec, world_size: int,
                         offload_optimizer: bool = False, fused: bool = False) -> int:
    """fp32 temporaries of the torch optimizer's update: Adam's single-tensor step (torch's default off CUDA)
    holds ``sqrt(v)`` and ``sqrt(v) / bias_correction`` of the tensor it updates. ZeRO-1/2/3 step one flat fp32
    partition of Ψ/N elements, ZeRO-0 one parameter at a time. DeepSpeed's CPU Adam (offload) needs none, nor
    torch's fused kernel (``fused``), which the strategy picks for Adam/AdamW on the CPU device
    (:func:`lightning_gaudi_ds.devices.fuses_adam`)."""
    if offload_optimizer or fused:
        return 0
    elements = spec.largest_param if stage == 0 else spec.params / world_size
    return int(4 * OPTIMIZER_TEMPORARIES.get(optimizer.lower(), 2) * elements)


def paper_bytes_per_param(stage: int | None, precision: str, world_size: int) -> float:
    """Model-state bytes per parameter per rank in the ZeRO paper's accounting (Rajbhandari et al., 2020), Adam:
    parameters + gradients + optimizer states of 2 + 2 + 12 bytes in mixed precision (4 + 4 + 8 in fp32), the
    part each stage shards divided by N. ``stage=None``: plain data parallel."""
    p = bytes_per_param(precision)
    g, k = p, (12.0 if p < 4 else 8.0)
    n = float(world_size)
    return {None: p + g + k, 0: p + g + k, 1: p + g + k / n, 2: p + (g + k) / n, 3: (p + g + k) / n}[stage]


def paper_split(stage: int, precision: str, world_size: int, offload_parameters: bool) -> tuple[float, float]:
    """(device, host) bytes per parameter of the paper's accounting with ZeRO-Offload: the optimizer's part
    (master weights, states, the gradient partition it steps on) on the host; with parameter offload the
    parameters' partition too."""
    total = paper_bytes_per_param(stage, precision, world_size)
    if offload_parameters:
        return 0.0, total
    device = bytes_per_param(precision) / (world_size if stage == 3 else 1)
    return device, total - device


def comm_bytes_per_param(
    stage: int, precision: str, world_size: int, reduce_to_owner: bool = True, offload_optimizer: bool = False
) -> float:
    """Bytes one rank sends per trainable parameter per optimizer step under ring collectives, all ranks on one
    host (:func:`lightning_gaudi_ds.planning.wire.step_traffic`); for ZeRO-3 an upper bound (see the module
    docstring). ``offload_optimizer`` changes no collective (measured: benchmarks/README.md, section 6)."""
    from lightning_gaudi_ds.planning.wire import step_traffic

    if world_size <= 1:
        return 0.0
    return step_traffic(stage, 1.0, world_size, precision=precision, reduce_to_owner=reduce_to_owner).sent_per_rank


def check_hpz(hpz: bool, devices: int, nodes: int) -> None:
    """hpZ (a secondary partition per node) needs several nodes of several devices."""
    if hpz and (nodes < 2 or devices < 2):
        raise PlanError(f"hpz=True needs 2 or more nodes of 2 or more devices each (here {nodes} node(s) of {devices}"
                         " device(s)): its secondary partition is the devices of one node, and it saves inter-node"
                         " bytes only")


def sequence_parallel_activation_bytes(activation_bytes: int, sequence_parallel_size: int) -> int:
    """The activations one rank holds when ``sequence_parallel_size`` ranks share each sequence (DeepSpeed-Ulysses,
    ``HPUDeepSpeedStrategy(sequence_parallel_size=K)``), from ``activation_bytes`` of the whole micro batch on one
    device: ``1/K`` of them. Every tensor kept for backward is split: along the sequence outside attention, along the
    heads inside it (where a ``(heads, sequence, sequence)`` score matrix, if any, becomes ``heads / K`` of them)."""
    if isinstance(sequence_parallel_size, bool) or not isinstance(sequence_parallel_size, int) \
            or sequence_parallel_size < 1:
        raise PlanError(f"sequence_parallel_size={sequence_parallel_size!r} must be a positive integer")
    return -(-int(activation_bytes) // sequence_parallel_size)


def plan_memory(
    model: ModelSpec | int | float,
    *,
    devices: int = 1,
    nodes: int = 1,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    device_memory: int | str | None = None,
    host_memory: int | str | None = None,
    headroom: float = DEFAULT_HEADROOM,
    activation_bytes: int | None = None,
    buckets: Buckets | None = None,
    param_groups: int = 1,
    configurations: Sequence[tuple[int, bool, bool]] = CONFIGURATIONS,
    device_type: str | None = None,
    fused_optimizer: bool | None = None,
    hpz: bool = False,
    sequence_parallel_size: int = 1,
) -> list[dict[str, Any]]:
    """Predicted bytes per rank for ZeRO stages 0-3 with and without offload, fastest configuration first.

    Args:
        model: a :class:`ModelSpec`, or the number of trainable parameters.
        devices, nodes: devices per node and nodes; the data-parallel world is their product.
        precision: Lightning's precision string. optimizer: ``adamw``/``adam`` (8 bytes of state per
            parameter), ``sgd`` (momentum), ``adagrad``, ``lamb``.
        device_memory, host_memory: bytes (or strings like ``"96GiB"``) per device and per node. ``None``
            leaves that side's ``fits`` unknown; use :func:`detect_device_memory` / :func:`detect_host_memory`.
        headroom: fraction of each memory kept free (allocator fragmentation, the framework's own use).
        activation_bytes: measured peak activation bytes of one micro batch (see
            :func:`~lightning_gaudi_ds.planning.activations.measure_activation_bytes`); ``None``: not included.
        buckets: DeepSpeed's bucket settings; default: the strategy's, sized from the model's hidden size, with
            ``device_type``'s communication defaults (``"cpu"``, ``"cuda"``, ``"hpu"``; ``None``: the device here).
        param_groups: the optimizer's parameter groups (more than one keeps ZeRO-1/2's gradient buffer
            through the step).
        fused_optimizer: whether the optimizer steps with torch's fused kernel (no temporaries); default: as the
            strategy decides for ``optimizer`` on ``device_type`` (:func:`~lightning_gaudi_ds.devices.fuses_adam`).
        hpz: the ZeRO-3 rows with ZeRO++'s hierarchical partitioning (``zero_hpz_partition_size`` = ``devices``):
            each rank holds a secondary partition of the parameters, and the backward all-gather stays in the node.
        sequence_parallel_size: ranks sharing each sequence (``HPUDeepSpeedStrategy(sequence_parallel_size=K)``):
            each holds ``1/K`` of ``activation_bytes``
            (:func:`~lightning_gaudi_ds.planning.activations.sequence_parallel_activation_bytes`); ZeRO still
            partitions the model states over every rank, so they do not change.

    The device peak is the larger of two moments: backward (the states at the step's entry, DeepSpeed's
    buckets and gathered parameters, the activations) and the optimizer step (the states inside it and the
    optimizer's temporaries).

    Returns:
        One dict per configuration (see :class:`PlanRow`).
    """
    from lightning_gaudi_ds.planning.units import parse_bytes

    spec = model if isinstance(model, ModelSpec) else ModelSpec(params=parameter_count(model))
    for name, value in (("devices", devices), ("nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name}={value!r} must be a positive integer")
    if not 0.0 <= headroom < 1.0:
        raise PlanError(f"headroom={headroom!r} must lie in [0, 1): the fraction of memory kept free")
    dev_mem = parse_bytes(device_memory, "device_memory") if device_memory is not None else None
    host_mem = parse_bytes(host_memory, "host_memory") if host_memory is not None else None
    if device_type is None:
        from lightning_gaudi_ds.devices import detect_device_type

        device_type = detect_device_type()
    buckets = buckets or Buckets.for_model(spec.hidden_size, device_type=device_type)
    if fused_optimizer is None:
        from lightning_gaudi_ds.devices import fuses_adam

        fused_optimizer = fuses_adam(device_type, optimizer)
    check_hpz(hpz, devices, nodes)
    world = devices * nodes
    if isinstance(sequence_parallel_size, bool) or not isinstance(sequence_parallel_size, int) \
            or sequence_parallel_size < 1 or world % sequence_parallel_size:
        raise PlanError(f"sequence_parallel_size={sequence_parallel_size!r} must be a positive integer dividing the"
                         f" {world} ranks (devices x nodes)")
    if activation_bytes is not None:
        activation_bytes = sequence_parallel_activation_bytes(activation_bytes, sequence_parallel_size)
    psi = float(spec.params)
    staged = _stages_reduce_input(device_type)
    frozen = spec.frozen_params / psi if psi else 0.0
    p = bytes_per_param(precision)
    rows = []
    for stage, off_opt, off_par in configurations:
        dev, host = model_states(stage, precision, world, off_opt, off_par, optimizer, frozen, param_groups)
        stage_hpz = hpz and stage == 3
        if stage_hpz:  # the secondary partition (ds_secondary_tensor): the parameters split over one node's ranks
            (host if off_par else dev).params += p * (1 + frozen) / devices
        dev_parts = {k: int(round(v * psi)) for k, v in asdict(dev).items()}
        host_parts = {k: int(round(v * psi)) for k, v in asdict(host).items()}
        transient = _transient_bytes(stage, off_opt, spec, buckets, p, world, staged)
        if off_opt and stage in (1, 2):  # staging buffers of the largest parameter, one each side
            dev_parts["buffers"] += int(spec.largest_param * p)
            host_parts["buffers"] += int(spec.largest_param * p)
        if stage == 3:
            dev_parts["buffers"] += int(buckets.reduce_bucket_size * p)  # ipg bucket, allocated once
        dev_states, host_states = sum(dev_parts.values()), sum(host_parts.values())
        step_only = int(round(step_only_bytes(stage, precision, world, off_opt, param_groups) * psi))
        temporaries = step_temporary_bytes(stage, optimizer, spec, world, off_opt, fused_optimizer)
        backward_peak = dev_states - step_only + transient + (activation_bytes or 0)
        step_peak = dev_states + temporaries
        device_bytes = max(backward_peak, step_peak)
        comm_per_param = comm_bytes_per_param(stage, precision, world, buckets.reduce_to_owner, off_opt)
        inter_node = wire.step_traffic(stage, psi, world, devices, wire.DEVICE_ALGORITHM.get(device_type, "ring"),
                                       precision, reduce_to_owner=buckets.reduce_to_owner,
                                       hpz=stage_hpz).inter_host_per_host if nodes > 1 else 0.0
        host_node = host_states * devices
        fits_dev = None if dev_mem is None else device_bytes <= dev_mem * (1 - headroom)
        fits_host = None if host_mem is None else host_node <= host_mem * (1 - headroom)
        fits = None if fits_dev is None else bool(fits_dev and fits_host is not False)
        rows.append(PlanRow(
            stage=stage, offload_optimizer=off_opt, offload_parameters=off_par,
            device_bytes=device_bytes, host_bytes=host_node, fits=fits, fits_device=fits_dev, fits_host=fits_host,
            model_state_bytes=dev_states + host_states, device_model_state_bytes=dev_states,
            host_bytes_per_rank=host_states, transient_bytes=transient, activation_bytes=activation_bytes,
            step_temporary_bytes=temporaries, backward_peak_bytes=backward_peak, step_peak_bytes=step_peak,
            comm_bytes=int(round(comm_per_param * psi)), inter_node_bytes=int(round(inter_node)),
            device_parts=dev_parts, host_parts=host_parts, label=label(stage, off_opt, off_par, stage_hpz),
        ).to_dict())
    for row in rows:
        row.update(params=spec.params, frozen_params=spec.frozen_params, world_size=world, devices=devices,
                   nodes=nodes, precision=precision, optimizer=optimizer, device_memory=dev_mem,
                   host_memory=host_mem, headroom=headroom, buckets=asdict(buckets), device_type=device_type,
                   fused_optimizer=fused_optimizer, hpz=hpz, sequence_parallel_size=sequence_parallel_size)
    return rows


def _transient_bytes(stage: int, offload_optimizer: bool, spec: ModelSpec, b: Buckets, p: float, world: int,
                     staged: bool = False) -> int:
    """Device bytes that exist during backward only: reduce buckets; for ZeRO-3 the gathered parameters, and with
    ``staged`` (gloo) the copy its collectives make of the gradients being reduced."""
    if stage == 0:
        return 0
    if stage in (1, 2):
        # in the gradients' dtype (DeepSpeed's grad_accum_dtype default); a second bucket with overlap_comm
        return int(b.reduce_bucket_size * p * (2 if b.overlap_comm else 1))
    persistent = spec.persistent_params(b.stage3_param_persistence_threshold) if world > 1 else 0
    gathered = min(b.stage3_max_live_parameters, b.stage3_prefetch_bucket_size + spec.largest_param)
    gathered = min(gathered, spec.total_params)
    # ZeRO-3 reduces one bucket at a time (a parameter larger than the bucket alone); gloo has no reduce-scatter (nor
    # an in-place bf16 all-reduce) and works on a copy of it: measured on 2 CPU ranks, the peak grows by the bucket's
    # bytes during each reduction (benchmarks/boundary.py)
    reduced = min(max(b.reduce_bucket_size, spec.largest_param), spec.total_params) if staged and world > 1 else 0
    return int((gathered + persistent + reduced) * p)


def _stages_reduce_input(device_type: str) -> bool:
    """Whether the device's process-group backend copies what it reduces (gloo: CPU)."""
    from lightning_gaudi_ds.devices import DEVICES

    spec = DEVICES.get(device_type)
    return spec is not None and spec.backend == "gloo"


def fastest_fitting(rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The first row that fits (rows come fastest first): the one choice ``plan`` prints and ``stage="auto"``
    trains with; None when nothing fits or the device memory is unknown."""
    return next((row for row in rows if row["fits"]), None)


def choose(rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """:func:`fastest_fitting`; raises ``ValueError`` saying what would fit when nothing does."""
    if any(r["fits"] is None for r in rows):
        raise PlanError("the device memory is unknown: pass device_memory (e.g. '24GiB') to choose a configuration")
    row = fastest_fitting(rows)
    if row is None:
        raise PlanError(no_fit_message(rows))
    return row


def no_fit_message(rows: Sequence[Mapping[str, Any]]) -> str:
    """Why nothing fits, and what would: more devices, offload, NVMe."""
    r0 = rows[0]
    dev_limit = r0["device_memory"] * (1 - r0["headroom"])
    host_limit = None if r0["host_memory"] is None else r0["host_memory"] * (1 - r0["headroom"])
    smallest = min(rows, key=lambda r: r["device_bytes"])
    lines = [f"No ZeRO configuration fits {r0['params']:,} parameters on {r0['world_size']} device(s) of"
             f" {format_bytes(r0['device_memory'])} ({r0['headroom']:.0%} headroom kept)."]
    for r in rows:
        host = f", host {format_bytes(r['host_bytes'])}/node" if r["host_bytes"] else ""
        lines.append(f"  {r['label']}: device {format_bytes(r['device_bytes'])}/rank{host}")
    hints = []
    z3 = next((r for r in rows if r["stage"] == 3 and not r["offload_optimizer"]), None)
    if z3 is not None:
        # everything but the bucket, and in backward the gathered parameters and activations, shrinks as 1/N
        fixed = int(z3["device_parts"]["buffers"])
        if z3["backward_peak_bytes"] >= z3["step_peak_bytes"]:
            fixed += z3["transient_bytes"] + (z3["activation_bytes"] or 0)
        sharded = z3["device_bytes"] - fixed
        if dev_limit > fixed and sharded > 0:
            need = int(-(-sharded * r0["world_size"] // (dev_limit - fixed)))
            hints.append(f"ZeRO-3 fits on about {need} devices of this size (devices x nodes)")
    if smallest["fits_device"] and smallest["fits_host"] is False and host_limit is not None:
        hints.append(f"{smallest['label']} fits the device but needs {format_bytes(smallest['host_bytes'])} of host"
                     f" memory per node (usable {format_bytes(host_limit)}): offload to NVMe"
                     " (remote_device='nvme', nvme_path=...) or use more nodes")
    elif not smallest["fits_device"]:
        hints.append("even with everything offloaded the device's share does not fit: activations or buckets"
                     " dominate; lower the micro batch, use activation checkpointing or smaller buckets")
    if not any(r["offload_optimizer"] for r in rows):
        hints.append("allow offload (offload_optimizer / offload_parameters)")
    return "\n".join(lines + ["What would fit: " + "; ".join(hints) + "." if hints else ""]).rstrip()


def parameter_count(value: Any) -> int:
    """``value`` (a number such as 7e9) as a whole, positive parameter count; ``ValueError`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or value != int(value):
        raise PlanError(f"params={value!r} must be a positive whole number of parameters, e.g. 7e9")
    return int(value)


NO_DEVICE_MEMORY = ("no accelerator here to read the device memory from, so whether each configuration fits is"
                     " unknown (\"?\"); pass --device-memory, the memory of one device (e.g. --device-memory 96GB)")


def assumed_line(row: Mapping[str, Any]) -> str:
    """The device the rows assume, and whether the optimizer's step temporaries are counted."""
    name = row["optimizer"]
    if row.get("fused_optimizer"):
        temps = f"{name}'s step temporaries not counted (the strategy steps it with torch's fused kernel)"
    elif OPTIMIZER_TEMPORARIES.get(name.lower(), 2):
        temps = f"{name}'s step temporaries counted (torch's per-tensor step; none with offload's CPU Adam)"
    else:
        temps = f"{name}'s step makes no temporaries"
    return f"device assumed: {row['device_type']}; {temps}"


def _split(row: Mapping[str, Any]) -> str:
    size = row.get("sequence_parallel_size", 1)
    return f", 1/{size} per rank: sequence parallelism" if size > 1 else ""


def format_table(rows: Sequence[dict[str, Any]], name: str = "") -> str:
    """The planner's rows (:func:`choose`) as the text table ``lightning-gaudi-ds plan`` and ``stage="auto"`` print."""
    fb = format_bytes
    r0 = rows[0]
    head = (f"{name + ': ' if name else ''}{r0['params']:,} trainable parameters"
            + (f" (+{r0['frozen_params']:,} frozen)" if r0["frozen_params"] else "")
            + f", {r0['world_size']} rank(s) ({r0['devices']} device(s) x {r0['nodes']} node(s)), {r0['precision']},"
            f" {r0['optimizer']}; device memory {fb(r0['device_memory'])}, host memory {fb(r0['host_memory'])}/node,"
            f" {r0['headroom']:.0%} kept free\n" + assumed_line(r0))
    multi_node = r0["nodes"] > 1
    cols: tuple[str, ...] = ("configuration", "device/rank", "peak in", "params", "grads", "optim", "buffers",
                             "transient", "step temps", "host/node", "fits", "sent/rank/step")
    cols += ("sent/node/step",) if multi_node else ()
    table = [cols]
    for r in rows:
        d = r["device_parts"]
        fits = {True: "yes", False: "no", None: "?"}[r["fits"]]
        if r["fits"] is False and r["fits_device"]:
            fits = "no (host)"
        phase = "backward" if r["backward_peak_bytes"] >= r["step_peak_bytes"] else "step"
        row_cells: tuple[str, ...] = (
            r["label"], fb(r["device_bytes"]), phase, fb(d["params"]), fb(d["grads"]), fb(d["optimizer"]),
            fb(d["buffers"]), fb(r["transient_bytes"]), fb(r["step_temporary_bytes"]), fb(r["host_bytes"]), fits,
            fb(r["comm_bytes"]))
        table.append(row_cells + ((fb(r["inter_node_bytes"]),) if multi_node else ()))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(cols))]
    lines = [head, ""]
    for i, row in enumerate(table):
        pairs = enumerate(zip(row, widths, strict=True))
        cells = [str(c).ljust(w) if j == 0 else str(c).rjust(w) for j, (c, w) in pairs]
        lines.append("  ".join(cells))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    b = r0["buckets"]
    act = r0["activation_bytes"]
    lines += ["", f"buckets (elements): reduce {b['reduce_bucket_size']:,}, allgather {b['allgather_bucket_size']:,},"
              f" ZeRO-3 prefetch {b['stage3_prefetch_bucket_size']:,}, persistence threshold"
              f" {b['stage3_param_persistence_threshold']:,}; overlap_comm {b['overlap_comm']}",
              "activations: " + (f"{fb(act)} (measured, one micro batch{_split(r0)}) included" if act is not None
                                 else "not included (use --measure-activations)")]
    if multi_node:
        lines.append(f"sent/node/step: bytes each node sends to the others per optimizer step"
                     f" ({wire.DEVICE_ALGORITHM.get(r0['device_type'], 'ring')} collectives, ZeRO-3 counting the"
                     " backward all-gather)" + ("; hpZ: the secondary partition counted in params" if r0.get("hpz")
                                                else ""))
    fastest = fastest_fitting(rows)
    if fastest is not None:
        lines.append(f"fastest that fits: {fastest['label']}")
    elif r0["device_memory"] is not None:
        lines.append(no_fit_message(rows))
    else:
        lines.append(f"fits: {NO_DEVICE_MEMORY}")
    return "\n".join(lines)
