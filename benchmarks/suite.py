"""Where the test suite's time goes: per test, per file, and per job (start-up against the rest).

Time a run, then tabulate it:

    LGDS_SUITE_TIMES=/tmp/suite bash scripts/test.sh          # or any pytest selection
    python benchmarks/suite.py /tmp/suite --out benchmarks/results/suite.md --title "after"
    python benchmarks/suite.py /tmp/after --before /tmp/before     # by file, side by side, with the ratio

``tests/conftest.py`` writes each test phase's duration to ``<folder>/tests.jsonl``; ``tests/procs.py`` writes every
job it starts to ``<folder>/jobs.jsonl``: its wall time, and its start-up, from the job's start to the first optimizer
step of its first rank (the jobs under tests/jobs mark it; other commands have none). A job that started warm (forked
from the suite's warm parent, tests/warm.py) says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import publish
from flags import existing_dir, positive_int


VENV: str | None = None  # --venv: only the rows of the tier run in that environment (.venv, .venv-deepspeed-0.16.1)


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if VENV is None or r.get("venv") == VENV]


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def tabulate(folder: Path, title: str, top: int = 30) -> str:
    tests = _read(folder / "tests.jsonl")
    jobs = _read(folder / "jobs.jsonl")
    if not tests:
        raise SystemExit(f"suite.py: no {folder / 'tests.jsonl'}: run the suite with LGDS_SUITE_TIMES={folder} first")
    per_test: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    cpu: dict[str, float] = defaultdict(float)  # the test's CPU seconds, its jobs' included (tear-down rows)
    outcome: dict[str, str] = {}
    for row in tests:
        per_test[row["test"]][row["phase"]] += row["seconds"]
        cpu[row["test"]] += row.get("cpu", 0.0)
        if row["phase"] == "call" or row["outcome"] != "passed":
            outcome[row["test"]] = row["outcome"]
    per_job: dict[str, list[dict]] = defaultdict(list)
    for job in jobs:
        per_job[job["test"]].append(job)

    def wall(t: str) -> float:
        return sum(per_test[t].values())

    total = sum(wall(t) for t in per_test)
    n_jobs = len(jobs)
    job_s = sum(j["seconds"] for j in jobs)
    timed = [j for j in jobs if j["startup"] is not None]
    start_s = sum(j["startup"] for j in timed)
    lines = [
        f"## {title}",
        "",
        f"- {len(per_test)} tests, {total:.0f} s of test time (set-up, call and tear-down of each test; module",
        "  fixtures count in the set-up of the test that first uses them), "
        f"{sum(cpu.values()):.0f} CPU s (the tests' and their jobs').",
        f"- {n_jobs} jobs started ({sum(j['warm'] for j in jobs)} warm), {job_s:.0f} s of job wall time;",
        f"  {len(timed)} of them mark their first step: {start_s:.0f} s of start-up out of their "
        f"{sum(j['seconds'] for j in timed):.0f} s.",
        "- Outcomes: " + ", ".join(f"{v} {k}" for k, v in sorted(_count(outcome.values()).items())),
        "",
        "### By file",
        "",
        "| file | tests | seconds | CPU s | jobs | job s | start-up s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    files: dict[str, list[str]] = defaultdict(list)
    for t in per_test:
        files[_file(t)].append(t)
    for f, ts in sorted(files.items(), key=lambda kv: -sum(wall(t) for t in kv[1])):
        fj = [j for t in ts for j in per_job.get(t, [])]
        su = sum(j["startup"] for j in fj if j["startup"] is not None)
        lines.append(f"| {f} | {len(ts)} | {sum(wall(t) for t in ts):.1f} | {sum(cpu[t] for t in ts):.1f} | "
                     f"{len(fj)} | {sum(j['seconds'] for j in fj):.1f} | {su:.1f} |")
    lines += ["", f"### The {top} slowest tests", "",
              "| test | set-up s | call s | jobs | start-up s (first job) |", "|---|---:|---:|---:|---:|"]
    for t in sorted(per_test, key=wall, reverse=True)[:top]:
        tj = per_job.get(t, [])
        first = next((j["startup"] for j in tj if j["startup"] is not None), None)
        lines.append(f"| `{t}` | {per_test[t]['setup']:.1f} | {per_test[t]['call']:.1f} | {len(tj)} | "
                     f"{'—' if first is None else f'{first:.1f}'} |")
    return "\n".join(lines) + "\n"


def _by_file(folder: Path) -> dict[str, tuple[int, float, float]]:
    """Per test file: how many tests ran, their seconds, and their CPU seconds (0 where the run recorded none)."""
    per_test: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for row in _read(folder / "tests.jsonl"):
        per_test[row["test"]][0] += row["seconds"]
        per_test[row["test"]][1] += row.get("cpu", 0.0)
    out: dict[str, tuple[int, float, float]] = {}
    for test, (seconds, cpu) in per_test.items():
        n, total, total_cpu = out.get(_file(test), (0, 0.0, 0.0))
        out[_file(test)] = (n + 1, total + seconds, total_cpu + cpu)
    return out


def compare(before: Path, after: Path, title: str) -> str:
    """Two timed runs side by side, by file: tests and seconds in each, and after / before."""
    old, new = _by_file(before), _by_file(after)
    if not old or not new:
        raise SystemExit(f"suite.py: {before if not old else after} holds no tests.jsonl of a timed run")
    lines = [f"## {title}", "", "| file | tests before | tests after | s before | s after | after / before | "
             "CPU s before | CPU s after |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for f in sorted(old.keys() | new.keys(), key=lambda k: -old.get(k, (0, 0.0, 0.0))[1]):
        (n0, s0, c0), (n1, s1, c1) = old.get(f, (0, 0.0, 0.0)), new.get(f, (0, 0.0, 0.0))
        ratio = f"{s1 / s0:.2f}" if s0 > 0 and n1 else "—"
        lines.append(f"| {f} | {n0} | {n1} | {s0:.1f} | {s1:.1f} | {ratio} | {c0:.1f} | {c1:.1f} |")
    n0, s0, c0 = (sum(v[i] for v in old.values()) for i in range(3))
    n1, s1, c1 = (sum(v[i] for v in new.values()) for i in range(3))
    lines.append(f"| **all** | {n0:.0f} | {n1:.0f} | {s0:.1f} | {s1:.1f} | {s1 / s0:.2f} | {c0:.1f} | {c1:.1f} |")
    return "\n".join(lines) + "\n"


def _count(values) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for v in values:
        out[v] += 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=existing_dir, help="the LGDS_SUITE_TIMES folder of a timed run")
    parser.add_argument("--title", default="suite", help="the section's heading")
    parser.add_argument("--top", type=positive_int, default=30,
                        help="how many of the slowest tests to list (default 30)")
    parser.add_argument("--out", type=Path, help="append the section to this markdown file (default: print it)")
    parser.add_argument("--before", type=existing_dir,
                        help="another timed run's folder: print both by file, side by side, instead")
    parser.add_argument("--venv", help="only the tier run in this environment (.ci/run's two tiers share a folder)")
    args = parser.parse_args(argv)
    global VENV
    VENV = args.venv
    text = compare(args.before, args.folder, args.title) if args.before else tabulate(args.folder, args.title, args.top)
    if args.out:
        publish.append_text(args.out, text + "\n")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
