"""ZeRO++ hpZ across two hosts, 2 ranks each (tests/multinode/cluster.py): one job (per-node torchrun on n0 and n1,
tests/jobs/ckpt_job.py) serves every check. Its fits, in one set of processes, fp32, 4 steps of the same data:

- ``hpz``: ``HPUDeepSpeedStrategy(stage=3, hpz=True)``, link counters around steps 2-3, a checkpoint at step 4;
- ``hpz_first`` (2 steps, its checkpoint) and ``hpz_resume`` (from it to step 4);
- ``z3``: plain ZeRO-3 after the hpZ fits (DeepSpeed keeps its hpZ group for the process: this one must not use it),
  link counters around steps 2-3.

Both ZeRO-3 runs release gathered parameters after use and prefetch none (``stage3_max_reuse_distance: 0``,
``stage3_prefetch_bucket_size: 0``; a prefetch finding a parameter still gathered keeps it), so that backward gathers
them again, as it does for a model too large to keep them: that is the all-gather hpZ keeps inside each host.
A 2-rank job on one host then resumes from the hpZ checkpoint (resharded from 4 ranks to 2).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_gaudi_ds.planning.wire import step_traffic
from tests.multinode.cluster import Cluster
from tests.multinode.launch import finish, spawn
from tests.multinode.wire import WindowServer, summary
from tests.procs import JOBS, free_port, run_job

pytestmark = [pytest.mark.multinode, pytest.mark.multiprocess]

CKPT_JOB = str(JOBS / "ckpt_job.py")
HOSTS, RANKS_PER_HOST = 2, 2
WORLD = HOSTS * RANKS_PER_HOST
WIRE = [1, 2]  # the counters' window: from global step 1 (step 0 warms up) for 2 steps
ZERO = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
# One fit of ckpt_job is 10-40 s here (Trainer, DeepSpeed engine, 4 steps of 4 ranks on 2 cores), start-up 30-60 s:
# 5 min for 4 fits, doubled for a machine at twice the load.
JOB_TIMEOUT_S = 600
LOSS_TOLERANCE = 1e-5  # fp32: hpZ reduces the same gradients in the same order; only the gathers differ
WIRE_TOLERANCE = 0.05


def plan(root: Path) -> list[dict[str, Any]]:
    # the windows' runs save at step 4 only, after the window (a save gathers parameters too)
    common = {"stage": 3, "zero": ZERO, "epoch_steps": 4, "every": 4}
    return [
        {**common, "name": "hpz", "hpz": True, "max_steps": 4, "dir": str(root / "hpz"), "wire": WIRE},
        {**common, "name": "hpz_first", "hpz": True, "max_steps": 2, "every": 2, "dir": str(root / "hpz_first")},
        {**common, "name": "hpz_resume", "hpz": True, "max_steps": 4, "dir": str(root / "hpz_resume"),
         "ckpt_path": str(root / "hpz_first" / "last.ckpt")},
        {**common, "name": "z3", "max_steps": 4, "dir": str(root / "z3"), "wire": WIRE},
    ]


@pytest.fixture(scope="module")
def hpz_job(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    for host in cluster.hosts:
        host.link(True)
    cluster.kill_leftovers()
    root = tmp_path_factory.mktemp("hpz")  # the hosts share the filesystem, as a cluster shares NFS
    out, marks = root / "out", root / "wire"
    server = WindowServer(cluster, marks)
    server.start()
    port = str(free_port())
    args = [CKPT_JOB, "--out", str(out), "--devices", str(RANKS_PER_HOST), "--num-nodes", str(HOSTS),
            "--plan", json.dumps(plan(root)), "--wire-dir", str(marks), "--pg-timeout", "120"]
    jobs = [spawn(cluster, i, "--hostfile", str(cluster.hostfile(RANKS_PER_HOST)), "--node_rank", str(i),
                  "--master_addr", "n0", "--master_port", port, *args) for i in range(HOSTS)]
    try:
        results = finish(cluster, *jobs, timeout=JOB_TIMEOUT_S)
    finally:
        server.stop()
    for result in results:
        assert result.returncode == 0, result.output[-4000:]
    print(f"\nhpZ job on 2 hosts x 2 ranks: {max(r.seconds for r in results):.1f} s")
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    veth = {h.name: h.veth for h in cluster.hosts}
    windows = {name: summary(server.window(name), veth, WIRE[1]) for name in ("hpz", "z3")}
    return {"ranks": ranks, "windows": windows, "root": root}


def losses(fit: dict[str, Any]) -> dict[str, float]:
    return {step: record["loss"] for step, record in fit["records"].items()}


def test_hpz_partitions_over_the_ranks_of_one_host_and_leaves_no_group_behind(hpz_job: dict[str, Any]) -> None:
    assert [r["host"] for r in hpz_job["ranks"]] == ["n0", "n0", "n1", "n1"]
    for r in hpz_job["ranks"]:
        hpz, z3 = r["hpz"]["partition"], r["z3"]["partition"]
        # every parameter gets a secondary partition over the 2 ranks of its host (the primary: over all 4)
        assert hpz["secondary_numel"] == pytest.approx(hpz["params_numel"] / RANKS_PER_HOST, rel=0.01), hpz
        assert hpz["secondary_numel"] == pytest.approx(hpz["primary_numel"] * WORLD / RANKS_PER_HOST, rel=0.01)
        assert z3["secondary_params"] == 0, f"plain ZeRO-3 after hpZ ran hpZ (DeepSpeed's group leaked): {z3}"


def test_hpz_trains_to_plain_zero3s_weights(hpz_job: dict[str, Any]) -> None:
    """The same fp32 loss curve to 1e-5 on every rank, and the same outputs after the last step."""
    for r in hpz_job["ranks"]:
        hpz, z3 = losses(r["hpz"]), losses(r["z3"])
        assert sorted(hpz) == ["1", "2", "3", "4"] and hpz.keys() == z3.keys()
        for step in hpz:
            assert hpz[step] == pytest.approx(z3[step], abs=LOSS_TOLERANCE), (step, hpz, z3)
        for got, want in zip(r["hpz"]["end"]["outputs"], r["z3"]["end"]["outputs"], strict=True):
            assert got == pytest.approx(want, abs=LOSS_TOLERANCE)


def test_hpz_checkpoint_resumes_exactly(hpz_job: dict[str, Any]) -> None:
    for r in hpz_job["ranks"]:
        full, resumed = losses(r["hpz"]), losses(r["hpz_resume"])
        assert sorted(resumed) == ["3", "4"], resumed
        assert [resumed[k] for k in ("3", "4")] == [full[k] for k in ("3", "4")]
        assert r["hpz_resume"]["start"]["global_step"] == 2


def test_hpz_cuts_inter_host_bytes_to_what_the_theory_says(hpz_job: dict[str, Any]) -> None:
    """Bytes per step on the link between the hosts (veth counters, TCP/IP headers taken off per packet) against the
    wire theory for gloo with this placement; hpZ's saving is ZeRO-3's backward all-gather across hosts."""
    part = hpz_job["ranks"][0]["hpz"]["partition"]
    params, persistent = part["params_numel"], part["persistent_numel"]
    theory = {name: step_traffic(3, params, WORLD, RANKS_PER_HOST, "gloo", "32-true", hpz=name == "hpz",
                                 persistent_params=persistent) for name in ("hpz", "z3")}
    windows = hpz_job["windows"]
    for name in ("hpz", "z3"):
        measured, expected = windows[name]["inter_host_payload_bytes"], theory[name].inter_host
        print(f"\n{name}: inter-host {measured:,.0f} B/step (raw {windows[name]['inter_host_bytes']:,.0f}),"
              f" theory {expected:,.0f}; intra-host {windows[name]['intra_host_payload_bytes']:,.0f},"
              f" theory {theory[name].intra_host:,.0f}")
        assert measured == pytest.approx(expected, rel=WIRE_TOLERANCE), (name, windows[name])
    saved = 1 - windows["hpz"]["inter_host_payload_bytes"] / windows["z3"]["inter_host_payload_bytes"]
    assert saved == pytest.approx(1 - theory["hpz"].inter_host / theory["z3"].inter_host, abs=WIRE_TOLERANCE)


def test_hpz_checkpoint_reshards_to_two_ranks_on_one_host(hpz_job: dict[str, Any], tmp_path: Path) -> None:
    """Plain ZeRO-3 on 2 ranks resumes the 4-rank hpZ checkpoint of step 2: its losses of steps 3-4 (the mean over
    ranks, i.e. the global batch's) are the 4-rank run's."""
    root = hpz_job["root"]
    spec = {"name": "reshard", "stage": 3, "zero": ZERO, "epoch_steps": 4, "every": 2, "max_steps": 4,
            "dir": str(tmp_path / "reshard"), "ckpt_path": str(root / "hpz_first" / "last.ckpt")}
    result = run_job([sys.executable, CKPT_JOB, "--out", str(tmp_path / "out"), "--devices", "2", "--plan",
                      json.dumps([spec])], timeout=JOB_TIMEOUT_S, ranks=2).check()
    print(f"\nreshard job, 2 ranks: {result.seconds:.1f} s")
    two = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text())["reshard"] for r in (0, 1)]
    for step in ("3", "4"):
        four_ranks = statistics.fmean(losses(r["hpz"])[step] for r in hpz_job["ranks"])
        two_ranks = statistics.fmean(losses(r)[step] for r in two)
        assert two_ranks == pytest.approx(four_ranks, abs=LOSS_TOLERANCE), step
