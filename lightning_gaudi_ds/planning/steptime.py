"""Samples per second per ZeRO configuration before renting the machines: ``lightning-gaudi-ds plan --step-time``.

The step time is the sum of what one rank does, nothing overlapped (Habana's and this package's CPU defaults turn
``overlap_comm`` off; on a GPU with it on, read the result as a lower bound on samples/s):

- **compute**: the model's FLOPs per sample x micro batch / (the device's peak matrix FLOP/s x ``efficiency``);
- **communication**: for every collective of the step (:func:`lightning_gaudi_ds.planning.wire.step_collectives`),
  the bytes one rank sends inside its node over the device's intra-node bandwidth, and the bytes each node sends to
  the others over its devices' inter-node links; a ring runs at its slowest link, so the larger of the two. On a CPU
  (gloo) the bytes a rank sends per collective over the rate measured for that operation;
- **optimizer step**: the bytes Adam reads and writes per element of the rank's partition over the memory
  bandwidth: 28 for torch's fused AdamW in fp32 (parameter, gradient, two moments read; parameter and moments
  written), 40 with mixed precision (the low-precision gradient read and copied to fp32, the updated parameter copied
  back to low precision), 84 for torch's per-tensor AdamW (its 8 passes: 52 bytes read, 32 written);
- **offload**: the gradient partition to the host and the updated parameters back over PCIe, the optimizer at the
  host's memory bandwidth; with parameters offloaded, each forward and backward fetches them too.

``efficiency`` is the fraction of the peak the model's kernels reach (1: the peak, an upper bound on samples/s). The
``cpu`` row holds this machine's rates measured by ``benchmarks/hardware.py``, per second of CPU time, so that its
predictions are CPU seconds per step per rank, what a rank on a core of its own takes. ``benchmarks/steptime.py``
holds the model against this machine's measured runs and against optimum-habana's published Gaudi figures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_gaudi_ds.errors import PlanError
from lightning_gaudi_ds.planning import wire
from lightning_gaudi_ds.precisions import HALF_PRECISIONS, PRECISIONS

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """One device type's rates (per device, each direction of a link), each with where it comes from."""

    name: str
    peak_flops: dict[str, float]  # "bf16" / "fp32": dense matrix FLOP/s
    memory_bandwidth: float  # bytes/s
    intra_node_bandwidth: float  # bytes/s a device sends to the others of its node
    inter_node_bandwidth: float  # bytes/s a device sends out of its node
    devices_per_node: int
    algorithm: wire.Algorithm
    source: str
    host_transfer_bandwidth: float = 0.0  # bytes/s between device and host (PCIe), for offload; 0: the same memory
    host_memory_bandwidth: float = 0.0  # bytes/s of host memory per device, for the offloaded optimizer
    collective_rates: dict[str, float] = field(default_factory=dict)  # gloo: op -> bytes a rank sends per second


#: Sources: Intel, "Intel Gaudi 3 AI Accelerator: Architected for Gen AI Training and Inference" (Hot Chips 2024,
#: R. Kaplan), table "Gaudi Product Generations": Gaudi 2 BF16 432 TFLOPs, HBM 2.46 TB/s, PCIe 64 GB/s
#: bidirectional; Gaudi 3 BF16 1835 TFLOPs, HBM 3.67 TB/s, PCIe 128 GB/s bidirectional. Habana's Gaudi 2 and Gaudi 3
#: white papers: 24 RoCE ports per card (Gaudi 2 100 GbE, Gaudi 3 200 GbE), 21 of them joining the 8 cards of a
#: server all-to-all and 3 leaving it. NVIDIA, "H100 Tensor Core GPU" datasheet (SXM5): BF16 989.4 TFLOPS dense, FP32
#: 66.9 TFLOPS, HBM3 3.35 TB/s, NVLink 900 GB/s (both directions), PCIe Gen5 128 GB/s (both directions); NVIDIA DGX
#: H100 datasheet: 8 x 400 Gb/s ConnectX-7 for the compute fabric, one per GPU. Host memory: two Xeon sockets per
#: 8-device server, Intel ARK: Xeon Platinum 8380 (Gaudi 2 servers) 204.8 GB/s per socket, 8480+ (Gaudi 3, DGX H100)
#: 307.2 GB/s per socket, shared by 8 devices.
HARDWARE: dict[str, Hardware] = {
    "gaudi2": Hardware(
        "Intel Gaudi 2 (HLS-Gaudi2: 8 cards)", {"bf16": 432e12}, 2.46e12, 21 * 100e9 / 8, 3 * 100e9 / 8, 8,
        "ring", "Intel Hot Chips 2024 (Gaudi 3 talk, generations table); Gaudi 2 white paper (24 x 100 GbE, 21 in"
        " the server, 3 out)", host_transfer_bandwidth=32e9, host_memory_bandwidth=2 * 204.8e9 / 8),
    "gaudi3": Hardware(
        "Intel Gaudi 3 (HLS-Gaudi3: 8 cards)", {"bf16": 1835e12}, 3.67e12, 21 * 200e9 / 8, 3 * 200e9 / 8, 8,
        "ring", "Intel Hot Chips 2024 (Gaudi 3 talk); Gaudi 3 white paper (24 x 200 GbE, 21 in the server, 3 out)",
        host_transfer_bandwidth=64e9, host_memory_bandwidth=2 * 307.2e9 / 8),
    "h100": Hardware(
        "NVIDIA H100 SXM5 (DGX H100: 8 GPUs)", {"bf16": 989.4e12, "fp32": 66.9e12}, 3.35e12, 450e9, 400e9 / 8, 8,
        "ring", "NVIDIA H100 datasheet (SXM5); DGX H100 datasheet (8 x 400 Gb/s ConnectX-7)",
        host_transfer_bandwidth=64e9, host_memory_bandwidth=2 * 307.2e9 / 8),
    # This machine, measured by `python benchmarks/hardware.py` (benchmarks/results/hardware.json; a test keeps the
    # two equal): per second of a process's CPU time, 1 torch thread, gloo between two processes on the host.
    # Its "peak" is the achieved rate of training matmuls: forward and backward of Linear(1024, 1024) on a micro-batch
    # of 16 (bf16 under autocast, fp32), 6 FLOPs per weight per sample.
    "cpu": Hardware(
        "this machine's CPU (AMD EPYC, AVX2, 1 core per rank)", {"bf16": 2.65e+09, "fp32": 2.35e+10},
        2.12e+10, 0.0, 0.0, 1, "gloo", "benchmarks/results/hardware.json (python benchmarks/hardware.py)",
        collective_rates={"all_reduce": 8.12e+08, "all_gather": 4.16e+08, "reduce": 5.19e+08}),
}

#: Bytes Adam reads and writes per element it updates (see the module docstring).
FUSED_ADAM_BYTES, MIXED_ADAM_BYTES, PER_TENSOR_ADAM_BYTES = 28.0, 40.0, 84.0


@dataclass(frozen=True)
class Workload:
    """What one step trains: ``params`` trainable parameters, ``flops_per_sample`` (forward and backward, and the
    recomputation with activation checkpointing), ``micro_batch`` samples per rank, ``precision``."""

    params: float
    flops_per_sample: float
    micro_batch: int
    precision: str = "bf16-mixed"
    persistent_params: float = 0.0  # ZeRO-3's parameters kept whole (below the persistence threshold)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise PlanError(f"precision={self.precision!r} is not one the model knows. Allowed:"
                             f" {', '.join(PRECISIONS)}")
        for name in ("params", "flops_per_sample", "micro_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not value > 0:
                raise PlanError(f"{name}={value!r} must be > 0")


def transformer_flops_per_sample(params: float, layers: int, hidden: int, seq_len: int,
                                 activation_checkpointing: bool = False) -> float:
    """Training FLOPs of one sequence of a decoder transformer (Kaplan et al., 2020): a forward pass is 2 FLOPs per
    parameter per token plus the attention's 2·layers·seq_len·hidden per token; backward twice the forward, and
    activation checkpointing runs the forward once more."""
    forward = seq_len * (2 * params + 2 * layers * seq_len * hidden)
    return forward * (4 if activation_checkpointing else 3)


@dataclass
class StepTime:
    configuration: str
    seconds: float
    compute: float
    communication: float
    optimizer: float
    offload: float
    samples_per_second: float
    inter_node_bytes_per_node: float
    sent_per_rank: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _peak(hw: Hardware, precision: str) -> float:
    kind = "bf16" if precision in HALF_PRECISIONS else "fp32"
    if kind not in hw.peak_flops:
        raise PlanError(f"{hw.name}: no {kind} peak in the table (it has {', '.join(hw.peak_flops)}); train in"
                         f" {' or '.join(hw.peak_flops)}")
    return hw.peak_flops[kind]


def _communication(traffic: wire.Traffic, hw: Hardware, devices: int, nodes: int) -> float:
    world = devices * nodes
    seconds = 0.0
    for collective, inter, intra in traffic.parts:
        per_rank = (inter + intra) / world
        if hw.collective_rates:  # gloo on a CPU: measured per operation (reduce-scatter is an all-reduce there)
            op = {"reduce_to_owner": "reduce", "reduce_scatter": "all_reduce"}.get(collective.op, collective.op)
            seconds += per_rank / hw.collective_rates[op]
            continue
        inside = (intra / world) / hw.intra_node_bandwidth if intra else 0.0
        across = (inter / nodes) / (devices * hw.inter_node_bandwidth) if inter else 0.0
        seconds += max(inside, across)
    return seconds


def step_time(
    workload: Workload,
    hardware: Hardware | str,
    stage: int | None,
    *,
    devices: int,
    nodes: int = 1,
    offload_optimizer: bool = False,
    offload_parameters: bool = False,
    hpz: bool = False,
    reduce_to_owner: bool = True,
    backward_allgather: bool = True,
    fused_optimizer: bool = True,
    efficiency: float = 1.0,
) -> StepTime:
    """The predicted step of ``workload`` on ``devices`` x ``nodes`` of ``hardware`` (a :data:`HARDWARE` key or row)
    at ZeRO ``stage`` (None: Lightning's DDP). ``reduce_to_owner``: ZeRO-1/2's gradient path (the device's default:
    :meth:`~lightning_gaudi_ds.planning.memory.Buckets.for_model`); ``backward_allgather``: ZeRO-3 gathers again in
    backward; ``fused_optimizer``: Adam steps with one fused kernel (DeepSpeed's, or torch's ``fused=True``)."""
    hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
    if not 0 < efficiency <= 1:
        raise PlanError(f"efficiency={efficiency!r} must lie in (0, 1]: the fraction of the peak FLOP/s reached")
    world = devices * nodes
    p = wire.element_bytes(workload.precision)
    half = workload.precision in HALF_PRECISIONS
    compute = workload.flops_per_sample * workload.micro_batch / (_peak(hw, workload.precision) * efficiency)
    traffic = wire.step_traffic(
        stage, workload.params, world, devices, hw.algorithm, workload.precision, reduce_to_owner=reduce_to_owner,
        **({"hpz": hpz, "backward_allgather": backward_allgather, "persistent_params": workload.persistent_params}
           if stage == 3 else {}))
    communication = _communication(traffic, hw, devices, nodes) if world > 1 else 0.0
    elements = workload.params / (world if stage else 1)
    per_element = (MIXED_ADAM_BYTES if half and stage is not None else FUSED_ADAM_BYTES) if fused_optimizer \
        else PER_TENSOR_ADAM_BYTES
    offload = 0.0
    if offload_optimizer and hw.host_transfer_bandwidth:
        optimizer = elements * per_element / hw.host_memory_bandwidth
        offload = 2 * p * elements / hw.host_transfer_bandwidth  # gradients down, updated parameters up
        if offload_parameters:  # the rank's parameter partition to the device for the forward's and backward's gathers
            offload += 2 * p * elements / hw.host_transfer_bandwidth
    else:
        optimizer = elements * per_element / (hw.host_memory_bandwidth if offload_optimizer and
                                              hw.host_memory_bandwidth else hw.memory_bandwidth)
    seconds = compute + communication + optimizer + offload
    label = "Lightning DDP" if stage is None else (
        f"ZeRO-{stage}" + (" + hpZ" if hpz else "") + (" + offload optimizer & params" if offload_parameters
                                                        else " + offload optimizer" if offload_optimizer else ""))
    return StepTime(label, seconds, compute, communication, optimizer, offload,
                    workload.micro_batch * world / seconds, traffic.inter_host_per_host if nodes > 1 else 0.0,
                    traffic.sent_per_rank)


def hardware_for(device_type: str) -> str:
    """The table row a device type's step time assumes by default."""
    return {"hpu": "gaudi2", "cuda": "h100"}.get(device_type, "cpu")


def plan_step_times(rows: list[dict[str, Any]], workload: Workload, hardware: str,
                    efficiency: float = 1.0) -> list[dict[str, Any]]:
    """:func:`step_time` for each of the planner's rows (their stage, offload, hpZ, ZeRO-1/2 gradient path)."""
    if hardware not in HARDWARE:
        raise PlanError(f"hardware={hardware!r} is not in the step-time table. Allowed: {', '.join(HARDWARE)}")
    out = []
    for r in rows:
        t = step_time(workload, hardware, r["stage"], devices=r["devices"], nodes=r["nodes"],
                      offload_optimizer=r["offload_optimizer"], offload_parameters=r["offload_parameters"],
                      hpz=bool(r.get("hpz")) and r["stage"] == 3,
                      reduce_to_owner=r["buckets"]["reduce_to_owner"], efficiency=efficiency)
        out.append({**t.to_dict(), "configuration": r["label"], "fits": r["fits"]})
    return out


def format_step_table(steps: list[dict[str, Any]], workload: Workload, hardware: str, efficiency: float) -> str:
    """The step-time table ``lightning-gaudi-ds plan --step-time`` prints."""
    hw = HARDWARE[hardware]
    unit = "CPU s" if hw.collective_rates else "s"
    head = (f"step time on {hw.name} ({hw.source}): {workload.flops_per_sample:.3g} FLOPs per sample, micro batch"
            f" {workload.micro_batch}, {efficiency:.0%} of the peak {_peak(hw, workload.precision):.3g} FLOP/s;"
            " compute, communication and the optimizer step added, nothing overlapped")
    cols = ("configuration", "fits", f"step {unit}", "compute", "communication", "optimizer", "offload",
            "samples/s", "sent/node/step")
    table = [cols]
    for s in steps:
        fits = {True: "yes", False: "no", None: "?"}[s["fits"]]
        table.append((s["configuration"], fits, f"{s['seconds']:.3f}", f"{s['compute']:.3f}",
                      f"{s['communication']:.3f}", f"{s['optimizer']:.3f}", f"{s['offload']:.3f}",
                      f"{s['samples_per_second']:.1f}", f"{s['inter_node_bytes_per_node'] / 2**30:.2f} GiB"))
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    lines = [head, ""]
    for i, row in enumerate(table):
        lines.append("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths,
                                                                                                    strict=True))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
