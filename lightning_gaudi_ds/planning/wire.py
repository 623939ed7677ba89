"""Bytes on the wire per optimizer step: which collectives each ZeRO configuration runs, and what each collective
sends between which ranks, so that the bytes crossing between hosts and the bytes staying inside one host follow
from Ψ (trainable parameters), N (ranks), the ranks per host and the collective algorithm.

One theory, used by ``benchmarks/wire.py`` (held against the link counters of two hosts), by the memory planner's
``comm_bytes`` and by the step-time model (:mod:`lightning_gaudi_ds.planning.steptime`).

Ranks are placed host by host (ranks ``h·r .. h·r + r - 1`` on host ``h``, ``r`` ranks per host), as every launcher
does. Per optimizer step (no gradient accumulation), ``p`` bytes per element of the training precision:

=====================  =========================================================================================
configuration          collectives
=====================  =========================================================================================
DDP                    all-reduce of the gradients (fp32 under mixed precision: Lightning keeps fp32 parameters)
ZeRO-0                 all-reduce of the gradients (``p``)
ZeRO-1/2 (+ offload)   each gradient element reduced to the rank that owns it (``reduce_scatter`` on,
                       ``use_multi_rank_bucket_allreduce`` off: the CPU and CUDA default) or all-reduced (DeepSpeed's
                       default, the HPU default); then the updated partitions all-gathered
ZeRO-3 (+ offload)     parameters all-gathered in forward and, once released, again in backward; gradients
                       reduce-scattered; the persistent (unpartitioned) parameters all-gathered after the step
ZeRO-3 + hpZ           the same, but the backward all-gather runs inside each host, from the secondary partition
                       (``zero_hpz_partition_size`` = ranks per host): no bytes cross hosts for it
=====================  =========================================================================================

Algorithms (``algorithm=``):

- ``"ring"`` (NCCL, HCCL): all-reduce is a ring reduce-scatter and all-gather, each rank sending 2(N-1)/N·M to its
  ring neighbour; all-gather and reduce-scatter (N-1)/N·M; a reduce to one root is a chain along the ring ending at
  the root (N-1 hops of M).
- ``"gloo"`` (torch's gloo backend, read in gloo's ``allreduce.cc``, ``allgather.cc``, ``reduce.cc`` and torch's
  ``ProcessGroupGloo.cpp``): all-reduce is a ring (each rank to rank-1), 2(N-1)/N·M per rank; all-gather a ring
  (each rank to rank+1), (N-1)/N·M; ``reduce_scatter_tensor`` is *emulated by an all-reduce of the whole input*
  (torch's ``reduce_scatter_tensor_coalesced`` for gloo), so it sends twice the ring's bytes; a reduce is a ring
  reduce-scatter (N-1)/N·M followed by every other rank sending its reduced chunk M/N straight to the root. gloo's
  segment rounding is left out: it moves no byte in total for all-reduce and all-gather, and for reduce it holds
  while one call is at most 2N MiB (the chunk then is exactly M/N).

What the theory leaves out: the few-byte collectives of every step (gradient norm, overflow flag, barriers), the
transport's framing (TCP/IP and Ethernet headers, gloo's message headers) and anything that is not a collective
(the launcher's and the rendezvous store's traffic). ``benchmarks/wire.py`` measures them beside it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from lightning_gaudi_ds.errors import PlanError
from lightning_gaudi_ds.precisions import HALF_PRECISIONS, PRECISIONS

Algorithm = Literal["ring", "gloo"]
ALGORITHMS: dict[str, str] = {
    "ring": "ring collectives (NCCL, HCCL)",
    "gloo": "torch's gloo backend (ring all-reduce and all-gather; reduce-scatter as an all-reduce; reduce as a ring"
            " reduce-scatter and a gather to the root)",
}
#: The collective algorithm each device's process-group backend runs (lightning_gaudi_ds.devices: gloo, nccl, hccl).
DEVICE_ALGORITHM: dict[str, Algorithm] = {"cpu": "gloo", "cuda": "ring", "hpu": "ring"}
OPS = ("all_reduce", "all_gather", "reduce_scatter", "reduce_to_owner")

Flows = dict[tuple[int, int], float]  # (sender, receiver) -> bytes


@dataclass(frozen=True)
class Placement:
    """N ranks, ``ranks_per_host`` to a host, numbered host by host."""

    world_size: int
    ranks_per_host: int

    def __post_init__(self) -> None:
        for name, value in (("world_size", self.world_size), ("ranks_per_host", self.ranks_per_host)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name}={value!r} must be a whole number >= 1")
        if self.world_size % self.ranks_per_host:
            raise PlanError(f"world_size={self.world_size} is not a multiple of ranks_per_host={self.ranks_per_host}:"
                             " every host runs the same number of ranks")

    @property
    def hosts(self) -> int:
        return self.world_size // self.ranks_per_host

    def host(self, rank: int) -> int:
        return rank // self.ranks_per_host


@dataclass(frozen=True)
class Collective:
    """One kind of collective of a step, all its calls together: ``op`` over ``elements`` elements of
    ``element_bytes`` (for all-gather the gathered output; for the others the input), in the world group or, with
    ``within_host``, in one group per host (hpZ's secondary partition)."""

    op: str
    elements: float
    element_bytes: float
    what: str
    within_host: bool = False

    @property
    def nbytes(self) -> float:
        return self.elements * self.element_bytes


@dataclass
class Traffic:
    """Bytes of one step: ``inter_host`` crossing between hosts (every host's sends to other hosts, summed),
    ``intra_host`` between ranks of the same host (summed over hosts), per collective in ``parts``."""

    placement: Placement
    inter_host: float = 0.0
    intra_host: float = 0.0
    parts: list[tuple[Collective, float, float]] = field(default_factory=list)  # (collective, inter, intra)

    @property
    def sent_per_rank(self) -> float:
        """What one rank sends on average (inter- and intra-host together)."""
        return (self.inter_host + self.intra_host) / self.placement.world_size

    @property
    def inter_host_per_host(self) -> float:
        """What each host sends to the others (the ring algorithms load every host alike)."""
        return self.inter_host / self.placement.hosts


# ------------------------------------------------------------------------------------------- per collective
def _ring(ranks: list[int], nbytes_each: float, step: int, flows: Flows) -> None:
    """Every rank of ``ranks`` sends ``nbytes_each`` to its neighbour ``step`` places on (1 or -1) in the list."""
    n = len(ranks)
    if n < 2:
        return
    for i, src in enumerate(ranks):
        flows[(src, ranks[(i + step) % n])] += nbytes_each


def collective_flows(op: str, nbytes: float, ranks: list[int], algorithm: Algorithm) -> Flows:
    """Bytes between each pair of ``ranks`` for one collective of ``nbytes`` over them (``reduce_to_owner``: every
    rank owns an equal slice and each slice is reduced to its owner)."""
    if algorithm not in ALGORITHMS:
        raise PlanError(f"algorithm={algorithm!r} is not one the theory knows. Allowed: {', '.join(ALGORITHMS)}")
    if op not in OPS:
        raise PlanError(f"op={op!r} is not a collective the theory knows. Allowed: {', '.join(OPS)}")
    flows: Flows = defaultdict(float)
    n = len(ranks)
    if n < 2 or nbytes <= 0:
        return flows
    f = (n - 1) / n
    gloo = algorithm == "gloo"
    if op == "all_reduce" or (op == "reduce_scatter" and gloo):  # gloo: reduce_scatter_tensor is an all-reduce
        _ring(ranks, 2 * f * nbytes, -1 if gloo else 1, flows)
    elif op in ("all_gather", "reduce_scatter"):
        _ring(ranks, f * nbytes, 1, flows)
    elif gloo:  # reduce_to_owner: per owner, a ring reduce-scatter of its slice, then the chunks sent to the owner
        _ring(ranks, f * nbytes, -1, flows)  # the N owners' slices together
        for root in ranks:
            for src in ranks:
                if src != root:
                    flows[(src, root)] += nbytes / n / n
    else:  # ring: per owner, a chain along the ring ending at the owner, every hop carrying the owner's slice
        for j in range(n):
            for hop in range(1, n):
                src, dst = ranks[(j + hop) % n], ranks[(j + hop + 1) % n]
                flows[(src, dst)] += nbytes / n
    return flows


def collective_traffic(collective: Collective, placement: Placement, algorithm: Algorithm) -> tuple[float, float]:
    """(inter-host, intra-host) bytes of ``collective`` under ``placement``."""
    if collective.within_host:
        groups = [list(range(h * placement.ranks_per_host, (h + 1) * placement.ranks_per_host))
                  for h in range(placement.hosts)]
    else:
        groups = [list(range(placement.world_size))]
    inter = intra = 0.0
    for group in groups:
        for (src, dst), sent in collective_flows(collective.op, collective.nbytes, group, algorithm).items():
            if placement.host(src) == placement.host(dst):
                intra += sent
            else:
                inter += sent
    return inter, intra


def total(collectives: Iterable[Collective], placement: Placement, algorithm: Algorithm) -> Traffic:
    traffic = Traffic(placement)
    for c in collectives:
        inter, intra = collective_traffic(c, placement, algorithm)
        traffic.inter_host += inter
        traffic.intra_host += intra
        traffic.parts.append((c, inter, intra))
    return traffic


# ------------------------------------------------------------------------------------------ per configuration
def element_bytes(precision: str) -> float:
    if precision not in PRECISIONS:
        raise PlanError(f"precision={precision!r} is not one the theory knows. Allowed: {', '.join(PRECISIONS)}")
    return 2.0 if precision in HALF_PRECISIONS else 4.0


def step_collectives(
    stage: int | None,
    params: float,
    precision: str = "bf16-mixed",
    *,
    reduce_to_owner: bool = True,
    hpz: bool = False,
    backward_allgather: bool = True,
    persistent_params: float = 0.0,
) -> list[Collective]:
    """The collectives of one optimizer step of ``params`` trainable parameters.

    ``stage``: None for Lightning's DDP, else the ZeRO stage (offload changes none of them).
    ``reduce_to_owner``: ZeRO-1/2 reduce each gradient element to its owner (else all-reduce every bucket).
    ``hpz``: ZeRO-3's backward all-gather from the secondary partition, inside each host.
    ``backward_allgather``: ZeRO-3 gathers the parameters again in backward (DeepSpeed skips it while they stay
    within ``stage3_max_reuse_distance`` / ``stage3_max_live_parameters``: then an upper bound).
    ``persistent_params``: ZeRO-3's parameters below ``stage3_param_persistence_threshold``, kept whole.
    """
    if stage not in (None, 0, 1, 2, 3):
        raise PlanError(f"stage={stage!r} is not a ZeRO stage. Allowed: None (DDP), 0, 1, 2, 3")
    if hpz and stage != 3:
        raise PlanError(f"hpz=True needs ZeRO stage 3, not {stage!r}")
    if not params > 0:
        raise PlanError(f"params={params!r} must be > 0")
    p = element_bytes(precision)
    if stage is None:
        grad = 4.0 if precision not in ("bf16-true", "16-true") else p  # mixed precision keeps fp32 parameters
        return [Collective("all_reduce", params, grad, "gradients")]
    if stage == 0:
        return [Collective("all_reduce", params, p, "gradients")]
    if stage in (1, 2):
        reduce = "reduce_to_owner" if reduce_to_owner else "all_reduce"
        return [Collective(reduce, params, p, "gradients"),
                Collective("all_gather", params, p, "updated parameter partitions")]
    partitioned = params - persistent_params
    out = [Collective("all_gather", partitioned, p, "parameters, forward")]
    if backward_allgather:
        out.append(Collective("all_gather", partitioned, p, "parameters, backward" + (" (hpZ: inside each host)"
                                                                                        if hpz else ""),
                              within_host=hpz))
    out.append(Collective("reduce_scatter", params, p, "gradients"))
    if persistent_params:
        out.append(Collective("all_gather", persistent_params, p, "persistent parameters, after the step"))
    return out


def step_traffic(
    stage: int | None,
    params: float,
    world_size: int,
    ranks_per_host: int | None = None,
    algorithm: Algorithm = "ring",
    precision: str = "bf16-mixed",
    **options: float | bool,
) -> Traffic:
    """Bytes of one optimizer step of ``params`` parameters on ``world_size`` ranks, ``ranks_per_host`` to a host
    (default: all on one host), under ``algorithm``; ``options``: those of :func:`step_collectives`."""
    placement = Placement(world_size, ranks_per_host or world_size)
    return total(step_collectives(stage, params, precision, **options), placement, algorithm)  # type: ignore[arg-type]


def describe(traffic: Traffic) -> Mapping[str, float]:
    """The figures of ``traffic`` as a flat mapping (for JSON rows)."""
    return {"inter_host_bytes": traffic.inter_host, "intra_host_bytes": traffic.intra_host,
            "inter_host_bytes_per_host": traffic.inter_host_per_host, "sent_per_rank": traffic.sent_per_rank}
