"""The wire theory (lightning_gaudi_ds/planning/wire.py) against numbers worked by hand, ZeRO++ hpZ's refusals and
its place in the planner. Unit tier: no process is started."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest

from lightning_gaudi_ds import HPUDeepSpeedStrategy
from lightning_gaudi_ds.config import zeropp
from lightning_gaudi_ds.errors import ConfigError
from lightning_gaudi_ds.fabric import HPUDeepSpeedStrategy as FabricStrategy
from lightning_gaudi_ds.planning import comm_bytes_per_param, plan_memory
from lightning_gaudi_ds.planning.wire import Collective, Placement, collective_flows, collective_traffic, step_traffic

PSI = 1000  # parameters: bf16 -> 2000 bytes of gradients, fp32 -> 4000


# ------------------------------------------------------------------------------------ by hand, 2 hosts x 2 ranks
# Ranks 0, 1 on host 0 and 2, 3 on host 1. A ring over 0-1-2-3 crosses hosts on 2 of its 4 edges.
@pytest.mark.parametrize(("stage", "options", "algorithm", "inter", "intra"), [
    # DDP: all-reduce of 4000 B (fp32 gradients under bf16-mixed); each rank sends 2*3/4*4000 = 6000 B to a neighbour
    (None, {}, "gloo", 2 * 6000, 2 * 6000),
    (None, {}, "ring", 2 * 6000, 2 * 6000),
    # ZeRO-0: all-reduce of 2000 B
    (0, {}, "ring", 2 * 3000, 2 * 3000),
    # ZeRO-1/2, reduce to the owner, gloo: ring reduce-scatter (each rank 3/4*2000 = 1500 B to rank-1: 2 crossing
    # edges) + each owner's chunk (2000/4/4 = 125 B) from its 3 peers, 2 of them on the other host (x 4 owners: 1000
    # inter, 500 intra) + all-gather of 2000 B (1500 B per rank to rank+1)
    (2, {}, "gloo", 3000 + 1000 + 3000, 3000 + 500 + 3000),
    # the same, ring: reduce to the owner is a reduce-scatter (1500 B per rank) + the all-gather
    (2, {}, "ring", 3000 + 3000, 3000 + 3000),
    # ZeRO-1/2 all-reducing every bucket: 2 x 3000 + 3000
    (1, {"reduce_to_owner": False}, "ring", 6000 + 3000, 6000 + 3000),
    # ZeRO-3, gloo: all-gather forward + backward (1500 B per rank each) + reduce-scatter as an all-reduce (3000)
    (3, {}, "gloo", 3000 + 3000 + 6000, 3000 + 3000 + 6000),
    (3, {}, "ring", 3000 + 3000 + 3000, 3000 + 3000 + 3000),
    # hpZ: the backward all-gather inside each host: 2 ranks send each other 1/2*2000 = 1000 B, twice per host
    (3, {"hpz": True}, "gloo", 3000 + 6000, 3000 + 4 * 1000 + 6000),
    (3, {"hpz": True}, "ring", 3000 + 3000, 3000 + 4 * 1000 + 3000),
    # ZeRO-3 keeping 200 parameters whole: they are gathered once after the step (400 B: 300 B per rank), never in
    # forward or backward (1600 B: 1200 B per rank each)
    (3, {"persistent_params": 200}, "ring", 2400 + 2400 + 3000 + 600, 2400 + 2400 + 3000 + 600),
    # ZeRO-3 that keeps the gathered parameters through backward: no second all-gather
    (3, {"backward_allgather": False}, "gloo", 3000 + 6000, 3000 + 6000),
])
def test_two_hosts_of_two_ranks_by_hand(stage: int | None, options: dict[str, Any], algorithm: str, inter: float,
                                        intra: float) -> None:
    traffic = step_traffic(stage, PSI, 4, 2, algorithm, "bf16-mixed", **options)  # type: ignore[arg-type]
    assert (traffic.inter_host, traffic.intra_host) == pytest.approx((inter, intra))
    assert traffic.inter_host_per_host == pytest.approx(inter / 2)


def test_hpz_saves_the_backward_all_gather_across_hosts() -> None:
    """8 nodes x 8 devices, ring collectives: ZeRO-3 sends 3 x 63/64 x 2 bytes per parameter from each node, hpZ 2."""
    z3 = step_traffic(3, 1e9, 64, 8, "ring", "bf16-mixed")
    hpz = step_traffic(3, 1e9, 64, 8, "ring", "bf16-mixed", hpz=True)
    f = 63 / 64
    # a ring over 64 ranks crosses nodes on 8 edges: each node sends one rank's share
    assert z3.inter_host_per_host == pytest.approx(3 * f * 2e9)
    assert hpz.inter_host_per_host == pytest.approx(2 * f * 2e9)
    assert hpz.sent_per_rank < z3.sent_per_rank  # inside the node: 7/8, not 63/64, of the parameters


def test_flows_follow_the_algorithms_own_ring_direction() -> None:
    """gloo's all-reduce sends to rank-1 (allreduce.cc), its all-gather to rank+1 (allgather.cc)."""
    ranks = [0, 1, 2]
    assert set(collective_flows("all_reduce", 300, ranks, "gloo")) == {(0, 2), (1, 0), (2, 1)}
    assert set(collective_flows("all_gather", 300, ranks, "gloo")) == {(0, 1), (1, 2), (2, 0)}
    # gloo's reduce_scatter_tensor is an all-reduce of the whole input: twice the ring's bytes
    ring = sum(collective_flows("reduce_scatter", 300, ranks, "ring").values())
    gloo = sum(collective_flows("reduce_scatter", 300, ranks, "gloo").values())
    assert (ring, gloo) == pytest.approx((2 * 300, 4 * 300))
    # one host: nothing crosses (400 B all-reduced: each of 4 ranks sends 2 x 3/4 x 400)
    assert collective_traffic(Collective("all_reduce", 100, 4, "g"), Placement(4, 4), "gloo") == (0.0, 4 * 600.0)


def test_the_planners_bytes_per_rank_come_from_the_wire_theory() -> None:
    """comm_bytes_per_param is what one rank sends under ring collectives on one host: DDP's 2(N-1)/N x 2 bytes for
    ZeRO-0 in bf16, reduce to owner + all-gather the same for ZeRO-1/2, 1.5x with all-reduce, 3 x (N-1)/N x 2 for
    ZeRO-3; offload changes no collective."""
    f = 7 / 8
    assert comm_bytes_per_param(0, "bf16-mixed", 8) == pytest.approx(2 * f * 2)
    assert comm_bytes_per_param(2, "bf16-mixed", 8) == pytest.approx(2 * f * 2)
    assert comm_bytes_per_param(2, "bf16-mixed", 8, reduce_to_owner=False) == pytest.approx(3 * f * 2)
    assert comm_bytes_per_param(2, "bf16-mixed", 8, offload_optimizer=True) == comm_bytes_per_param(2, "bf16-mixed", 8)
    assert comm_bytes_per_param(3, "32-true", 8) == pytest.approx(3 * f * 4)
    assert comm_bytes_per_param(3, "bf16-mixed", 1) == 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"world_size": 6, "ranks_per_host": 4}, "not a multiple of ranks_per_host=4"),
    ({"world_size": 0, "ranks_per_host": 1}, "world_size=0 must be a whole number >= 1"),
])
def test_placement_refuses_what_no_launcher_makes(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Placement(**kwargs)


def test_theory_refuses_unknown_inputs() -> None:
    with pytest.raises(ValueError, match="algorithm='tree' is not one the theory knows. Allowed: ring, gloo"):
        step_traffic(3, PSI, 4, 2, "tree")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hpz=True needs ZeRO stage 3, not 2"):
        step_traffic(2, PSI, 4, 2, hpz=True)


# ------------------------------------------------------------------------------------------------- the planner
def test_planner_counts_the_secondary_partition_and_the_inter_node_bytes() -> None:
    """hpZ adds p/devices bytes per parameter of parameters on each rank (the secondary partition over a node's 8
    devices) and takes the backward all-gather off the inter-node link."""
    psi, devices, nodes = 8e9, 8, 4
    (z3,) = plan_memory(psi, devices=devices, nodes=nodes, device_type="hpu", configurations=[(3, False, False)])
    (hpz,) = plan_memory(psi, devices=devices, nodes=nodes, device_type="hpu", hpz=True,
                         configurations=[(3, False, False)])
    assert hpz["device_parts"]["params"] - z3["device_parts"]["params"] == pytest.approx(2 * psi / devices, rel=1e-6)
    assert hpz["label"] == "ZeRO-3 + hpZ" and hpz["hpz"]
    f = 31 / 32
    assert z3["inter_node_bytes"] == pytest.approx(3 * f * 2 * psi, rel=1e-6)
    assert hpz["inter_node_bytes"] == pytest.approx(2 * f * 2 * psi, rel=1e-6)
    # with parameter offload the secondary partition is on the host (DeepSpeed's remote device)
    (off,) = plan_memory(psi, devices=devices, nodes=nodes, device_type="hpu", hpz=True,
                         configurations=[(3, True, True)])
    assert off["host_parts"]["params"] == pytest.approx(2 * psi / 32 + 2 * psi / devices, rel=1e-6)
    # ZeRO-1/2 rows are not hpZ's
    (z2,) = plan_memory(psi, devices=devices, nodes=nodes, device_type="hpu", hpz=True,
                        configurations=[(2, False, False)])
    assert z2["label"] == "ZeRO-2"


def test_planner_refuses_hpz_on_one_node() -> None:
    with pytest.raises(ValueError, match=r"hpz=True needs 2 or more nodes of 2 or more devices each \(here 1 node"):
        plan_memory(1e9, devices=8, nodes=1, hpz=True)


# -------------------------------------------------------------------------------------------- hpZ's refusals
@pytest.mark.parametrize("cls", [HPUDeepSpeedStrategy, FabricStrategy])
def test_hpz_refused_below_zero3_before_anything_starts(cls: type) -> None:
    with pytest.raises(ConfigError, match=r"HPUDeepSpeedStrategy\(stage=2, hpz=True\)`: hpZ partitions ZeRO-3's"):
        cls(stage=2, hpz=True)
    with pytest.raises(ConfigError, match=r"hpz='yes'\)` is not a boolean"):
        cls(stage=3, hpz="yes")
    with pytest.raises(ConfigError, match=r"stage='auto', hpz=True"):
        cls(stage="auto", hpz=True)


def test_hpz_config_key_refused_below_zero3_and_against_hpz_true() -> None:
    with pytest.raises(ConfigError, match=r"partition_size=4 \(the DeepSpeed config \(dict\)\) at ZeRO stage 1"):
        HPUDeepSpeedStrategy(config={"zero_optimization": {"stage": 1, "zero_hpz_partition_size": 4}})
    with pytest.raises(ConfigError, match=r"hpz=True\)` and zero_optimization.zero_hpz_partition_size=4 in the"):
        HPUDeepSpeedStrategy(hpz=True, config={"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}})
    strategy = HPUDeepSpeedStrategy(stage=3, hpz=True)
    assert strategy.config["zero_optimization"]["zero_hpz_partition_size"] == "auto"


def test_hpz_refused_where_deepspeed_lacks_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zeropp, "deepspeed_has_hpz", lambda: False)
    with pytest.raises(ConfigError, match=r"hpz=True\)`: DeepSpeed \S+ has no ZeRO\+\+ hierarchical partitioning"):
        HPUDeepSpeedStrategy(stage=3, hpz=True)


def test_installed_deepspeeds_know_hpz() -> None:
    assert zeropp.deepspeed_has_hpz()  # 0.16.1 (Habana's fork's base) and 0.19.8 both


def test_hpz_refused_on_one_node_by_the_trainer_before_any_process_starts() -> None:
    with pytest.raises(ConfigError, match=r"`HPUDeepSpeedStrategy\(hpz=True\)` on one node"):
        L.Trainer(accelerator="cpu", devices=2, strategy=HPUDeepSpeedStrategy(stage=3, hpz=True), logger=False)


@pytest.mark.parametrize(("devices_per_node", "num_nodes", "value", "message"), [
    (1, 2, "auto", "with 1 device per node"),
    (4, 2, 3, "must lie inside one node, so its size must divide 4"),
    (4, 2, 8, "must lie inside one node, so its size must divide 4"),
])
def test_hpz_placement_checks(devices_per_node: int, num_nodes: int, value: Any, message: str) -> None:
    config = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": value}}
    with pytest.raises(ConfigError, match=message):
        zeropp.check_before_launch(config, devices_per_node=devices_per_node, num_nodes=num_nodes, device_type="cpu",
                                   source="dict")
    zeropp.check_before_launch({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}},
                               devices_per_node=4, num_nodes=2, device_type="cpu", source="dict")  # a divisor: fine


@pytest.mark.parametrize("key", ["zero_quantized_weights", "zero_quantized_gradients"])
@pytest.mark.parametrize(("device", "runs"), [("cpu", False), ("hpu", False), ("cuda", True)])
def test_quantized_collectives_only_where_deepspeed_runs_them(key: str, device: str, runs: bool) -> None:
    """qwZ/qgZ load DeepSpeed's quantizer op, which its CPU and HPU accelerators lack (on CPU the first quantized
    all-gather raises "This op had not been implemented on CPU backend."): refused there, naming the device."""
    config = {"zero_optimization": {"stage": 3, key: True}}
    if runs:
        zeropp.check_before_launch(config, devices_per_node=8, num_nodes=1, device_type=device, source="dict")
        return
    with pytest.raises(ConfigError, match=rf"{key}=true .* not run ZeRO\+\+'s quantized collectives on '{device}'"):
        zeropp.check_before_launch(config, devices_per_node=8, num_nodes=1, device_type=device, source="dict")


def test_quantized_collectives_refused_by_the_trainer_on_cpu() -> None:
    strategy = HPUDeepSpeedStrategy(config={"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}})
    with pytest.raises(ConfigError, match="on 'cpu'"):
        L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)


# ------------------------------------------------------------------------------------------- the step-time model
def test_step_time_by_hand() -> None:
    """ZeRO-2 of 1e9 parameters in bf16 on 8 Gaudi 2 cards of one node, 1e12 FLOPs per sample, micro batch 4: compute
    4e12 / 432e12; all-reduce (HPU's ZeRO-2 path) 2 x 7/8 x 2e9 B and all-gather 7/8 x 2e9 B over 262.5e9 B/s;
    Adam on 1e9/8 elements x 40 B over 2.46e12 B/s."""
    from lightning_gaudi_ds.planning.steptime import Workload, step_time

    t = step_time(Workload(1e9, 1e12, 4), "gaudi2", 2, devices=8, reduce_to_owner=False)
    assert t.compute == pytest.approx(4e12 / 432e12)
    assert t.communication == pytest.approx(3 * 7 / 8 * 2e9 / 262.5e9)
    assert t.optimizer == pytest.approx(1e9 / 8 * 40 / 2.46e12)
    assert t.samples_per_second == pytest.approx(32 / (t.compute + t.communication + t.optimizer))
    # two such nodes: each ring crosses to the other node on 2 of its 16 edges, whose links (3 x 100 GbE per card,
    # 8 cards) carry each node's share: 3 x 15/16 x 2e9 B over 8 x 37.5e9 B/s, slower than the node's inside
    two = step_time(Workload(1e9, 1e12, 4), "gaudi2", 2, devices=8, nodes=2, reduce_to_owner=False)
    assert two.communication == pytest.approx(3 * 15 / 16 * 2e9 / (8 * 37.5e9))
    assert two.inter_node_bytes_per_node == pytest.approx(3 * 15 / 16 * 2e9)


def test_step_time_hpz_and_efficiency() -> None:
    import dataclasses

    from lightning_gaudi_ds.planning.steptime import HARDWARE, Workload, step_time

    w = Workload(7e9, 6 * 7e9 * 4096, 1)
    z3 = step_time(w, "gaudi2", 3, devices=8, nodes=8)
    hpz = step_time(w, "gaudi2", 3, devices=8, nodes=8, hpz=True)
    assert hpz.inter_node_bytes_per_node == pytest.approx(2 / 3 * z3.inter_node_bytes_per_node)
    # Gaudi 2's 3 scale-out ports per card (300 GB/s a node) carry a ring's crossing bytes as fast as the 21 inside
    # carry a rank's: hpZ saves link bytes, hardly time. With 1 port per card out the link is the bottleneck, and it
    # saves a third of the all-gathers' time there.
    assert hpz.communication == pytest.approx(z3.communication, rel=0.02)
    thin = dataclasses.replace(HARDWARE["gaudi2"], inter_node_bandwidth=100e9 / 8)
    z3_thin, hpz_thin = (step_time(w, thin, 3, devices=8, nodes=8, hpz=h) for h in (False, True))
    assert hpz_thin.communication < 0.8 * z3_thin.communication
    half = step_time(w, "gaudi2", 3, devices=8, nodes=8, efficiency=0.5)
    assert half.compute == pytest.approx(2 * z3.compute)
    with pytest.raises(ValueError, match=r"efficiency=0 must lie in \(0, 1\]"):
        step_time(w, "gaudi2", 3, devices=8, efficiency=0)
    with pytest.raises(ValueError, match="no fp32 peak in the table"):
        step_time(Workload(7e9, 1e12, 1, "32-true"), "gaudi2", 3, devices=8)


def test_transformer_flops_per_sample() -> None:
    """Kaplan et al.: forward 2 FLOPs per parameter per token + 2·layers·seq·hidden per token; training 3x, 4x with
    activation checkpointing. GPT2-XL, 1024 tokens: (2 x 1,557,611,200 + 2 x 48 x 1024 x 1600) x 1024 x 4."""
    from lightning_gaudi_ds.planning.steptime import transformer_flops_per_sample

    forward = (2 * 1_557_611_200 + 2 * 48 * 1024 * 1600) * 1024
    assert transformer_flops_per_sample(1_557_611_200, 48, 1600, 1024) == 3 * forward
    assert transformer_flops_per_sample(1_557_611_200, 48, 1600, 1024, activation_checkpointing=True) == 4 * forward


def test_the_cpu_row_is_what_benchmarks_hardware_measured() -> None:
    """The model's `cpu` row holds benchmarks/results/hardware.json's rates (3 significant digits)."""
    import json
    from pathlib import Path

    from lightning_gaudi_ds.planning.steptime import HARDWARE

    measured = json.loads((Path(__file__).parents[1] / "benchmarks/results/hardware.json").read_text())["rates"]
    cpu = HARDWARE["cpu"]

    def rate(name: str) -> float:
        return float(f"{measured[name]['per_cpu_second']:.3g}")

    assert cpu.peak_flops == {"bf16": rate("train_matmul_bfloat16_flops"), "fp32": rate("train_matmul_float32_flops")}
    assert cpu.memory_bandwidth == rate("memory_bytes")
    assert cpu.collective_rates == {op: rate(f"gloo_{op}_bytes_sent") for op in ("all_reduce", "all_gather", "reduce")}
    assert measured and cpu.name.split(" (")[0].startswith("this machine")


def test_plan_step_time_command(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_gaudi_ds.planning.command import main

    main(["--params", "1.5576e9", "--hidden-size", "1600", "--devices", "8", "--nodes", "2", "--device", "hpu",
          "--device-memory", "96GiB", "--hpz", "--step-time", "--seq-len", "1024", "--batch-size", "16",
          "--activation-checkpointing", "--efficiency", "0.4"])
    out = capsys.readouterr().out
    assert "step time on Intel Gaudi 2" in out and "40% of the peak" in out
    memory, step = out.split("step time on ", 1)
    assert "ZeRO-3 + hpZ " in memory and "ZeRO-3 + hpZ " in step and "samples/s" in step
    with pytest.raises(SystemExit):
        main(["--params", "1e9", "--step-time", "--efficiency", "2", "--device-memory", "1GiB"])
    assert "argument --efficiency: 2.0 is not allowed" in capsys.readouterr().err
