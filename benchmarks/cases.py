"""What one benchmark case is: an arm (DDP or a ZeRO stage), a model size, a precision, a kind of run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

@dataclass(frozen=True)
class Arm:
    stage: int | None  # None: Lightning's DDPStrategy
    fused: bool = False  # configure_optimizers returns AdamW(fused=True) (else torch's choice: fused=None)
    offload_optimizer: bool = False
    offload_parameters: bool = False
    # zero_optimization keys set in the config; every other communication setting is the device's default
    # (lightning_gaudi_ds.devices: on CPU overlap_comm off, each gradient slice reduced to its owner)
    zero: tuple[tuple[str, Any], ...] = ()
    label: str = ""
    short: str = ""  # for charts


ARMS: dict[str, Arm] = {
    "ddp": Arm(None, label="Lightning DDP", short="DDP"),
    # DDP with torch's fastest CPU AdamW: the fair reference for ZeRO, which the strategy fuses on CPU itself
    "ddp_fused": Arm(None, fused=True, label="Lightning DDP, AdamW(fused=True)", short="DDP\nfused"),
    "z0": Arm(0, label="ZeRO-0", short="Z0"),
    "z1": Arm(1, label="ZeRO-1", short="Z1"),
    "z2": Arm(2, label="ZeRO-2", short="Z2"),
    "z3": Arm(3, label="ZeRO-3", short="Z3"),
    "z2_offload": Arm(2, offload_optimizer=True, label="ZeRO-2 + offload optimizer", short="Z2\noffload"),
    "z3_offload": Arm(3, offload_optimizer=True, offload_parameters=True, label="ZeRO-3 + offload optimizer & params",
                      short="Z3\noffload"),
    # DeepSpeed 0.19's own default for ZeRO-1/2: every gradient bucket all-reduced
    "z1_allreduce": Arm(1, zero=(("use_multi_rank_bucket_allreduce", True),), label="ZeRO-1, all-reduce (DeepSpeed's"
                        " default)", short="Z1\nall-reduce"),
    "z2_allreduce": Arm(2, zero=(("use_multi_rank_bucket_allreduce", True),), label="ZeRO-2, all-reduce (DeepSpeed's"
                        " default)", short="Z2\nall-reduce"),
    # The CPU defaults of issue 16 item 3, each switched the other way (lightning_gaudi_ds.devices)
    "z2_overlap": Arm(2, zero=(("overlap_comm", True),), label="ZeRO-2, overlap_comm on", short="Z2\noverlap"),
    "z2_nocontig": Arm(2, zero=(("contiguous_gradients", False),), label="ZeRO-2, contiguous_gradients off",
                       short="Z2\nnon-contig"),
    "z3_overlap": Arm(3, zero=(("overlap_comm", True),), label="ZeRO-3, overlap_comm on", short="Z3\noverlap"),
}


# Each arm that switches a CPU communication default (its `zero` settings) -> the arm with the default
FLIPPED: dict[str, str] = {name: f"z{arm.stage}" for name, arm in ARMS.items() if arm.zero}


@dataclass
class Case:
    id: str
    kind: str  # "memory" (tensor census, RSS, collective bytes) | "speed" (Trainer vs raw loop, paired steps)
    arm: str
    hidden: int
    layers: int
    precision: str = "bf16-mixed"
    batch_size: int = 16
    steps: int = 3  # memory: steps run (census on step `census_step`); speed: warm-up + measured + 1
    warmup: int = 0
    census_step: int = 1
    round: int = 0
    timeout: float = 300.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def spec(self) -> Arm:
        return ARMS[self.arm]

    @property
    def stage(self) -> int | None:
        return self.spec.stage

    @property
    def offload_optimizer(self) -> bool:
        return self.spec.offload_optimizer

    @property
    def offload_parameters(self) -> bool:
        return self.spec.offload_parameters

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Case":
        return cls(**d)
