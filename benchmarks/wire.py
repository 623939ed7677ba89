"""Bytes on the wire across hosts per ZeRO configuration, measured on two hosts against the wire theory (issue 41).

    python benchmarks/wire.py                      # every arm, 2 hosts x 2 ranks; results/wire.{jsonl,md}
    python benchmarks/wire.py --arms z3 z3_hpz     # some arms (the others' rows are kept from the last results)
    python benchmarks/wire.py --report-only        # wire.md and the README sections from results/wire.jsonl

The two hosts are the multi-node tier's (tests/multinode/cluster.py: network namespaces joined by a veth pair, root
only; the benchmark exits with status 3, saying what is missing, where they cannot be made). One job, started per
node with ``lightning-gaudi-ds spawn --node_rank`` (torchrun: no ssh session carries output across the link), trains
every arm in turn in the same processes (benchmarks/wire_job.py: the benchmark's model, bf16-mixed, AdamW, the
strategy's CPU communication defaults). Around ``--steps`` steps after ``--warmup`` of each arm the job stops every
rank while the hosts' link counters are read (tests/multinode/wire.py): the veth's for what crosses between the hosts,
the loopback's for what gloo sends between the ranks of one host. Each figure is per optimizer step, summed over the
two hosts, beside :func:`lightning_gaudi_ds.planning.wire.step_traffic` for gloo with this placement (the theory the
planner uses too). *payload* is the counted bytes less one TCP/IP frame header (66 B) per counted packet.

ZeRO-3's arms release the gathered parameters after use (``stage3_max_reuse_distance`` 0, no prefetch), so that
backward gathers them again, as it does for models too large to keep them gathered (DeepSpeed keeps them up to
``stage3_max_live_parameters``, 1e9 by default, and a prefetch that finds a parameter still gathered keeps it); the
``z3_kept`` arm shows DeepSpeed's defaults at this size. hpZ: ``HPUDeepSpeedStrategy(stage=3, hpz=True)``, the
secondary partition over the 2 ranks of a host.
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
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for path in (str(HERE), str(REPO)):
    if path not in sys.path:
        sys.path.insert(0, path)

import publish  # noqa: E402
from flags import int_at_least, positive_float, positive_int  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
JOB = HERE / "wire_job.py"
README = HERE / "README.md"
TOP_README = REPO / "README.md"
DOCS = REPO / "docs" / "benchmarks.md"
HOSTS, RANKS_PER_HOST = 2, 2
RELEASED = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}

#: name -> (label, stage, options for the job, options for the theory)
ARMS: dict[str, tuple[str, int | None, dict[str, Any], dict[str, Any]]] = {
    "ddp": ("Lightning DDP", None, {}, {}),
    "z1": ("ZeRO-1", 1, {}, {}),
    "z2": ("ZeRO-2", 2, {}, {}),
    "z3": ("ZeRO-3", 3, {"zero": RELEASED}, {}),
    "z3_hpz": ("ZeRO-3 + hpZ", 3, {"zero": RELEASED, "hpz": True}, {"hpz": True}),
    "z2_offload": ("ZeRO-2 + offload optimizer", 2, {"offload_optimizer": True}, {}),
    "z3_offload": ("ZeRO-3 + offload optimizer & params", 3,
                   {"zero": RELEASED, "offload_optimizer": True, "offload_parameters": True}, {}),
    "z3_kept": ("ZeRO-3, parameters kept through backward (DeepSpeed's defaults)", 3, {},
                {"backward_allgather": False}),
}
TOLERANCE = 0.05


def theory(arm: str, params: int, persistent: int, precision: str) -> Any:
    from lightning_gaudi_ds.planning.wire import step_traffic

    _, stage, _, options = ARMS[arm]
    extra = {"persistent_params": persistent} if stage == 3 else {}
    return step_traffic(stage, params, HOSTS * RANKS_PER_HOST, RANKS_PER_HOST, "gloo", precision, **options, **extra)


@contextlib.contextmanager
def two_hosts() -> Iterator[Any]:
    from tests.multinode import cluster as hosts

    root = hosts.make_root()
    try:
        try:
            made = hosts.start(root)
        except hosts.Unavailable as why:
            print(f"benchmarks/wire.py needs the multi-node tier's two hosts, which cannot be made here: {why}",
                  file=sys.stderr)
            raise SystemExit(3) from None
        try:
            yield made
        finally:
            made.kill_leftovers()
            hosts.stop(made)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Bring the hosts up, run the job, return the meta line and one row per arm."""
    from bench_model import ModelSize

    from tests.multinode.launch import finish, spawn
    from tests.multinode.wire import WindowServer, summary
    from tests.procs import free_port

    size = ModelSize(args.hidden, args.layers)
    arms = [{"name": name, "stage": ARMS[name][1], **ARMS[name][2]} for name in args.arms]
    started = time.monotonic()
    with two_hosts() as cluster:
        work = cluster.root / "wire"
        server = WindowServer(cluster, work / "marks")
        server.start()
        job = [str(JOB), "--out", str(work / "out"), "--wire-dir", str(work / "marks"), "--arms", json.dumps(arms),
               "--devices", str(RANKS_PER_HOST), "--num-nodes", str(HOSTS), "--hidden", str(args.hidden),
               "--layers", str(args.layers), "--batch-size", str(args.batch_size), "--warmup", str(args.warmup),
               "--steps", str(args.steps), "--precision", args.precision]
        port = str(free_port())
        env = {"OMP_NUM_THREADS": "1"}  # tests.procs.job_env puts this checkout on PYTHONPATH
        jobs = [spawn(cluster, i, "--hostfile", str(cluster.hostfile(RANKS_PER_HOST)), "--node_rank", str(i),
                      "--master_addr", "n0", "--master_port", port, *job, env=env) for i in range(HOSTS)]
        try:
            results = finish(cluster, *jobs, timeout=args.timeout)
        finally:
            server.stop()
        for result in results:
            if result.returncode != 0:
                raise RuntimeError(f"the job failed (exit {result.returncode}):\n{result.output[-4000:]}")
        veth = {h.name: h.veth for h in cluster.hosts}
        persistent = size.layers * size.hidden  # the biases: below the persistence threshold (10 x hidden)
        rows = []
        for arm in args.arms:
            measured = summary(server.window(arm), veth, args.steps)
            records = [json.loads(p.read_text()) for p in sorted((work / "out").glob(f"{arm}.rank*.json"))]
            t = theory(arm, size.params, persistent, args.precision)
            rows.append({
                "type": "wire", "arm": arm, "label": ARMS[arm][0], **{k: v for k, v in measured.items()},
                "theory_inter_host_bytes": t.inter_host, "theory_intra_host_bytes": t.intra_host,
                "theory_parts": [(c.what, c.op, c.nbytes, inter, intra) for c, inter, intra in t.parts],
                "params": size.params, "persistent_params": persistent,
                "step_seconds": [s for r in records for s in r["step_seconds"]],
                "step_cpu_seconds": [s for r in records for s in r.get("step_cpu_seconds", [])],
                "collectives": records[0]["collectives"] if records else {},
                "zero_optimization": records[0]["zero_optimization"] if records else None,
            })
    import deepspeed
    import lightning
    import torch

    meta = {"type": "meta", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(["python", "benchmarks/wire.py", *sys.argv[1:]]), "cpus": os.cpu_count(),
            "platform": platform.platform(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "lightning": lightning.__version__, "load": [round(x, 1) for x in os.getloadavg()],
            "commit": _commit(), "seconds": round(time.monotonic() - started), "hosts": HOSTS,
            "ranks_per_host": RANKS_PER_HOST, "hidden": args.hidden, "layers": args.layers, "params": size.params,
            "batch_size": args.batch_size, "warmup": args.warmup, "steps": args.steps, "precision": args.precision}
    return meta, rows


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f}"


def ratio(measured: float, expected: float) -> str:
    if not expected:
        return "–"
    r = measured / expected
    return f"{r:.3f} {'✓' if abs(r - 1) <= TOLERANCE else '✗'}"


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        f"Run {meta['date']}, {meta['seconds']} s; {meta['cpus']} CPUs shared by 2 hosts x 2 ranks (network"
        f" namespaces joined by a veth pair); load average {', '.join(map(str, meta['load']))} at the end. torch"
        f" {meta['torch']}, lightning {meta['lightning']}, deepspeed {meta['deepspeed']}, commit {meta['commit']}.",
        f"Model: {meta['layers']} x Linear({meta['hidden']}, {meta['hidden']}) (Ψ = {meta['params'] / 1e6:.2f}M),"
        f" {meta['precision']}, AdamW, micro-batch {meta['batch_size']}; {meta['warmup']} warm-up steps, then"
        f" {meta['steps']} measured. Bytes per optimizer step, both hosts together (MB = 10^6 B); theory:"
        " `planning.wire.step_traffic` for gloo, ranks 0-1 on n0 and 2-3 on n1. *CPU s/step*: the median over the"
        " measured steps of rank 0 and rank 2 of their process's CPU time (user + system), which the machine's load"
        " stretches least.",
        "",
        "| configuration | inter-host MB/step: counted | payload | theory | payload ÷ theory | intra-host MB/step:"
        " payload | theory | ÷ theory | ÷ ZeRO-3's inter-host (theory) | CPU s/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    z3 = next((r for r in rows if r["arm"] == "z3"), None)
    for r in rows:
        versus = "–"
        if z3 is not None and r["arm"] != "z3":
            versus = (f"{r['inter_host_payload_bytes'] / z3['inter_host_payload_bytes']:.2f}"
                      f" ({r['theory_inter_host_bytes'] / z3['theory_inter_host_bytes']:.2f})")
        cpu = sorted(r.get("step_cpu_seconds") or [float("nan")])
        median = cpu[len(cpu) // 2]
        lines.append(
            f"| {r['label']} | {_mb(r['inter_host_bytes'])} | {_mb(r['inter_host_payload_bytes'])} |"
            f" {_mb(r['theory_inter_host_bytes'])} |"
            f" {ratio(r['inter_host_payload_bytes'], r['theory_inter_host_bytes'])} |"
            f" {_mb(r['intra_host_payload_bytes'])} | {_mb(r['theory_intra_host_bytes'])} |"
            f" {ratio(r['intra_host_payload_bytes'], r['theory_intra_host_bytes'])} | {versus} | {median:.2f} |")
    lines += ["", "Collectives Python issued per step in the window (rank 0; payload MB; DDP's C++ reducer is not"
              " seen):", "", "| configuration | collectives (calls/step, payload MB/step) |", "|---|---|"]
    for r in rows:
        c = r.get("collectives") or {}
        calls, payload = c.get("calls", {}), c.get("payload", {})
        steps = meta["steps"]
        text = ", ".join(f"{op} {calls[op] / steps:g} ({payload.get(op, 0) / steps / 1e6:.2f})" for op in sorted(calls))
        lines.append(f"| {r['label']} | {text or '–'} |")
    return "\n".join(lines) + "\n"


def headline(rows: list[dict[str, Any]]) -> str:
    by = {r["arm"]: r for r in rows}
    worst = max(abs(r["inter_host_payload_bytes"] / r["theory_inter_host_bytes"] - 1) for r in rows)
    parts = [f"{by[a]['label']} {_mb(by[a]['inter_host_payload_bytes'])}" for a in ("ddp", "z2", "z3", "z3_hpz")
             if a in by]
    text = (f"inter-host MB per step (Ψ = {rows[0]['params'] / 1e6:.1f}M, bf16): {', '.join(parts)};"
            f" every row within {worst:.1%} of the wire theory")
    if "z3" in by and "z3_hpz" in by:
        cut = 1 - by["z3_hpz"]["inter_host_payload_bytes"] / by["z3"]["inter_host_payload_bytes"]
        expected = 1 - by["z3_hpz"]["theory_inter_host_bytes"] / by["z3"]["theory_inter_host_bytes"]
        text += f"; hpZ cuts ZeRO-3's by {cut:.0%} (theory {expected:.0%})"
    return text


def replace_section(path: Path, tag: str, body: str) -> str:
    text = path.read_text()
    start, end = f"<!-- {tag}:start -->", f"<!-- {tag}:end -->"
    if start not in text or end not in text:
        raise SystemExit(f"{path}: no {start} ... {end} section to write the results into")
    head, rest = text.split(start, 1)
    return head + start + "\n" + body.rstrip() + "\n" + end + rest.split(end, 1)[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS), help="the configurations to run")
    parser.add_argument("--hidden", type=int_at_least(16), default=1024)
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--warmup", type=positive_int, default=2, help="steps before the window (at least 1)")
    parser.add_argument("--steps", type=positive_int, default=3, help="steps in the window")
    parser.add_argument("--precision", choices=("bf16-mixed", "32-true"), default="bf16-mixed")
    parser.add_argument("--timeout", type=positive_float, default=1800, help="the job's time limit, seconds")
    parser.add_argument("--report-only", action="store_true", help="rebuild wire.md and the READMEs' sections")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default benchmarks/results)")
    parser.add_argument("--no-readme", action="store_true", help="leave README.md and benchmarks/README.md alone")
    args = parser.parse_args(argv)

    jsonl = args.out / "wire.jsonl"
    if args.report_only:
        if not jsonl.exists():
            parser.error(f"--report-only: {jsonl} does not exist; run the benchmark first")
        lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
        meta, rows = lines[0], lines[1:]
    else:
        meta, rows = run(args)
        if jsonl.exists() and set(args.arms) != set(ARMS):  # a partial rerun keeps the other arms' rows
            kept = [json.loads(line) for line in jsonl.read_text().splitlines()[1:]]
            ran = {r["arm"] for r in rows}
            rows = [r for r in kept if r["arm"] not in ran] + rows
        rows.sort(key=lambda r: list(ARMS).index(r["arm"]))
    table = markdown(meta, rows)
    readmes = [] if args.no_readme else [  # made first: a README without its section stops the run before any write
        (README, replace_section(README, "wire", table)),
        (DOCS, replace_section(DOCS, "wire", table)),
        (TOP_README, replace_section(TOP_README, "wire", textwrap.fill(
            f"- **Wire** (`python benchmarks/wire.py`, 2 hosts x 2 ranks): {headline(rows)}.", width=118,
            subsequent_indent="  ", break_on_hyphens=False))),
    ]
    with publish.staged(args.out) as stage:
        (stage.path / "wire.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [meta, *rows]))
        (stage.path / "wire.md").write_text("# Bytes on the wire across hosts\n\n" + table)
    for path, text in readmes:
        publish.write_text(path, text)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
