"""Fault tolerance (issue 24): steps lost per failure against the save interval, seconds from a failure to the first
step after the restart, and the final fp32 weights of an interrupted-and-restarted run against an uninterrupted one.

    python benchmarks/restart.py                  # K = 1, 2, 4; results in benchmarks/results/restart.{jsonl,md}
    python benchmarks/restart.py --every 2 --tag restart_tiny --tiny   # one interval, few steps
    python benchmarks/restart.py --two_hosts --every 2   # one rank on each of the multi-node tier's two hosts
    python benchmarks/restart.py --mid_epoch --tag restart_mid_epoch   # train on the data: every resume mid-epoch

Every job is tests/jobs/restart_job.py (2 ranks on gloo, ZeRO-2, fp32, ``ModelCheckpoint(every_n_train_steps=K,
save_last=True)``) under ``lightning-gaudi-ds spawn --world_size 2 --max_restarts 1`` (torchrun), on this host;
with ``--two_hosts``, on the multi-node tier's hosts n0 and n1 (tests/multinode/cluster.py: network namespaces with
their own sshd, root only), one rank each, ``spawn --hostfile --use_deepspeed`` from n0 (pdsh), rank 1 on n1.
For each K, rank 1 SIGKILLs itself inside step F (``--kill 0:F:1:KILL``); the restart resumes from ``last.ckpt``.
The reference, the same job uninterrupted, runs in the same invocation, first. Measured per row, from the ranks'
own records (``attempt<A>-rank<R>.json``):

- **steps lost**: completed steps whose work the failure threw away, ``F - S`` where S is the step the restart
  resumed at (the step in progress at the failure is run again too, on top);
- **failure to first step**: from the moment rank 1 sent itself SIGKILL to the first ``training_step`` of the
  restarted job (the earliest rank): detection, stopping the rest, a fresh start-up, loading the checkpoint; of
  which "to the new processes" is the part until the restarted ranks' processes started (their first line);
- **max |Δw|**: the largest absolute difference between the final fp32 weights and the reference's.

:func:`measure` reads one interrupted run's directory; tests/test_restart.py applies it to its own restart job (the
tiny mode here costs ~3 job start-ups, over the test budget).

``--mid_epoch``: the job trains on its loader's batches, all ``--steps`` of them in one epoch (``restart_job.py
--data``), so every restart resumes mid-epoch and its weights equal the reference's only if it goes on with the
batch after the checkpoint's (lightning_gaudi_ds/checkpoint/data_position.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import publish
from flags import file_stem, int_at_least, positive_float, positive_int

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
JOB = REPO / "tests" / "jobs" / "restart_job.py"
SPAWN = [sys.executable, "-m", "lightning_gaudi_ds", "spawn", "--world_size", "2", "--master_port", "0"]


def _records(out: Path, attempt: int) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"attempt{attempt}-rank*.json"))]


def max_abs_diff(a: Path, b: Path) -> float:
    import torch

    left, right = torch.load(a / "weights.pt"), torch.load(b / "weights.pt")
    if left.keys() != right.keys():
        raise ValueError(f"{a} and {b} hold different weights: {sorted(left)} vs {sorted(right)}")
    return max(float((left[k] - right[k]).abs().max()) for k in left)


def measure(out: Path, reference: Path | None = None) -> dict[str, Any]:
    """Figures of the first failure in ``out`` (a restart_job ``--out`` whose attempt 0 was SIGKILLed): the step it
    failed in, the step attempt 1 resumed at, the steps lost, seconds from the kill to attempt 1's processes and to
    its first step and, with ``reference``, the weights' max |Δ|."""
    killed = [r for r in _records(out, 0) if r.get("killed_at")]
    restarted = _records(out, 1)
    if not killed or not restarted:
        raise ValueError(f"{out}: no killed rank in attempt 0 or no attempt 1 ({len(killed)}, {len(restarted)})")
    failed_in = killed[0]["steps"][-1]
    resumed_at = min(r["steps"][0] for r in restarted)
    figures: dict[str, Any] = {
        "failed_in_step": failed_in, "resumed_at_step": resumed_at, "steps_lost": failed_in - resumed_at,
        "failure_to_first_step_s": round(min(r["times"][0] for r in restarted) - killed[0]["killed_at"], 2),
        "failure_to_processes_s": round(min(r["started"] for r in restarted) - killed[0]["killed_at"], 2),
    }
    if reference is not None:
        figures["max_abs_diff"] = max_abs_diff(out, reference)
    return figures


def run_job(out: Path, steps: int, every: int, kill: str | None, timeout: float, cluster: Any = None,
            data: bool = False) -> None:
    job = [str(JOB), "--out", str(out), "--steps", str(steps), "--every", str(every),
           *(["--kill", kill] if kill else []), *(["--data"] if data else [])]
    restarts = ["--max_restarts", "1"] if kill else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if cluster is None:
        args, cwd = [*SPAWN, *restarts, *job], None
    else:
        args = [*cluster.hosts[0].enter(cluster.root), sys.executable, "-m", "lightning_gaudi_ds", "spawn",
                "--hostfile", str(cluster.hostfile(1)), "--use_deepspeed", "--master_port", "0", *restarts, *job,
                "--num_nodes", "2"]
        env, cwd = {**env, **cluster.env()}, cluster.root
    start = time.time()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, start_new_session=True,
                          cwd=cwd)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    print(f"  {out.name}: {time.time() - start:.1f} s", flush=True)


@contextlib.contextmanager
def _two_hosts() -> Iterator[Any]:
    sys.path.insert(0, str(REPO))
    from tests.multinode import cluster as hosts

    root = hosts.make_root()
    try:
        made = hosts.start(root)  # raises hosts.Unavailable, saying what is missing
        try:
            yield made
        finally:
            made.kill_leftovers()
            hosts.stop(made)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# Restarts: steps lost, time to recover, exact resume",
        "",
        f"Machine: {meta['cpus']} CPUs, {meta['platform']}; torch {meta['torch']}, deepspeed {meta['deepspeed']}, "
        f"lightning {meta['lightning']}; load average {meta['load']} at the start. Rows from: `{meta['command']}` "
        f"({meta['date']}).",
        "",
        ("One host, 2 ranks (torchrun, " if meta.get("hosts", 1) == 1 else
         "Two hosts (the multi-node tier's n0 and n1), one rank each (`--hostfile --use_deepspeed`, pdsh, ") +
        "gloo, ZeRO-2, fp32), `lightning-gaudi-ds spawn --max_restarts 1`; rank 1 "
        "SIGKILLed inside step F; `ModelCheckpoint(every_n_train_steps=K, save_last=True)`. The reference is the "
        "same job uninterrupted, run first in the same invocation. "
        + ("Mid-epoch: the job trains on its loader's batches, every step in one epoch, so each restart resumes "
           "mid-epoch. " if meta.get("mid_epoch") else "") + "Steps lost = completed steps thrown away "
        "(F - resumed step; at most K - 1, (K - 1)/2 on average for a failure at a random step); the step in "
        "progress is run again as well.",
        "",
        "| save every K steps | failed in step F | resumed at step | steps lost | failure → first step after "
        "restart, s | of which to the new processes, s | final fp32 weights, max abs diff vs uninterrupted |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['every']} | {r['failed_in_step']} | {r['resumed_at_step']} | {r['steps_lost']} | "
                     f"{r['failure_to_first_step_s']} | {r['failure_to_processes_s']} | {r['max_abs_diff']:.1e} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=positive_int, nargs="+", default=[1, 2, 4], help="save intervals K")
    parser.add_argument("--fail_in", type=positive_int, default=7, help="the step F rank 1 is SIGKILLed in")
    parser.add_argument("--steps", type=int_at_least(2), default=10)
    parser.add_argument("--two_hosts", action="store_true", help="one rank on each of the multi-node tier's hosts")
    parser.add_argument("--tiny", action="store_true", help="6 steps, failure in step 3 (for development)")
    parser.add_argument("--mid_epoch", action="store_true", help="train on the loader's batches, all in one epoch")
    parser.add_argument("--tag", type=file_stem, default="restart", help="output file stem under benchmarks/results/")
    parser.add_argument("--timeout", type=positive_float, default=900, help="per job, seconds")
    args = parser.parse_args(argv)
    if args.tiny:
        args.steps, args.fail_in = 6, 3
    if not 0 < args.fail_in < args.steps:
        parser.error(f"--fail_in {args.fail_in}: must be a step of the run, 1 to {args.steps - 1}")

    import deepspeed
    import lightning
    import torch

    meta = {"type": "meta", "cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "lightning": lightning.__version__,
            "load": round(os.getloadavg()[0], 1), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(["python", "benchmarks/restart.py", *(argv if argv is not None else sys.argv[1:])]),
            "steps": args.steps}
    meta["hosts"] = 2 if args.two_hosts else 1
    meta["mid_epoch"] = args.mid_epoch
    rows = []
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(_two_hosts()) if args.two_hosts else None
        parent = cluster.root if cluster is not None else None  # on the hosts' shared filesystem
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lgds_restart_bench_", dir=parent)))
        # the weights do not depend on K (only on which steps ran): one reference serves every row
        run_job(work / "reference", args.steps, args.every[0], None, args.timeout, cluster, args.mid_epoch)
        for every in args.every:
            out = work / f"every{every}"
            run_job(out, args.steps, every, f"0:{args.fail_in}:1:KILL", args.timeout, cluster, args.mid_epoch)
            rows.append({"type": "restart", "hosts": meta["hosts"], "every": every, "mid_epoch": args.mid_epoch,
                         **measure(out, work / "reference")})
            print(f"  {rows[-1]}", flush=True)
    with publish.staged(RESULTS) as stage:
        (stage.path / f"{args.tag}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [meta, *rows]))
        (stage.path / f"{args.tag}.md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
