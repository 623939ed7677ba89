"""Turn the cases' per-rank JSON into ratios: JSON lines, a markdown table, PNG charts, the README section."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Optional, Sequence

import publish
from cases import ARMS, Case

from lightning_gaudi_ds.planning.memory import paper_bytes_per_param, paper_split

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
MIB = 1 << 20

# targets of issue 7
FORMULA_RATIO = (1.00, 1.25)
VS_DDP_TARGET = {1: 0.70, 2: 0.62, 3: 0.56}
OVERHEAD_TARGET = 1.05
COMM_THEORY = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.5}


# ------------------------------------------------------------------------------------------ formulas
def formula(arm: str, precision: str, n: int) -> float:
    """Model-state bytes per parameter per rank in the ZeRO paper's accounting, for this arm."""
    return paper_bytes_per_param(ARMS[arm].stage, precision, n)


def formula_split(arm: str, precision: str, n: int) -> Optional[tuple[float, float]]:
    """(device, host) bytes per parameter with ZeRO-Offload (None without offload)."""
    spec = ARMS[arm]
    if not spec.offload_optimizer or spec.stage is None:
        return None
    return paper_split(spec.stage, precision, n, spec.offload_parameters)


# ------------------------------------------------------------------------------------------ loading
@dataclass
class CaseResult:
    case: Case
    ranks: list[dict[str, Any]]

    @property
    def ok(self) -> bool:
        return len(self.ranks) > 0 and all(r.get("ok") for r in self.ranks)

    @property
    def r0(self) -> dict[str, Any]:
        return self.ranks[0]

    def error(self) -> str:
        errs = [r.get("error", "missing") for r in self.ranks if not r.get("ok")] or ["no result"]
        return "; ".join(sorted(set(errs)))


def load(case_dir: Path, cases: Sequence[Case], world: int) -> dict[str, CaseResult]:
    out = {}
    for c in cases:
        ranks = []
        for r in range(world):
            f = case_dir / f"{c.id}.rank{r}.json"
            ranks.append(json.loads(f.read_text()) if f.exists() else {"ok": False, "error": "no result file"})
        out[c.id] = CaseResult(c, ranks)
    return out


# ------------------------------------------------------------------------------------------ analysis
def census_point(res: CaseResult, point: str) -> dict[str, Any]:
    """The census at ``point``, the rank holding most bytes (ranks differ by padding only)."""
    return max((r["census"][point] for r in res.ranks), key=lambda c: c["total"])


def memory_rows(results: dict[str, CaseResult], precision_tag: str, layers: int, world: int) -> list[dict[str, Any]]:
    rows = []
    ddp = results.get(f"mem_{precision_tag}_ddp_l{layers}")
    ddp_states = ddp_peak = None
    if ddp is not None and ddp.ok:
        peak = max((census_point(ddp, p) for p in ("before_step", "in_step")), key=lambda c: c["total"])
        ddp_peak = peak["total"]
        ddp_states = peak["params"] + peak["grads"] + peak["optimizer"]
    for arm in ARMS:
        res = results.get(f"mem_{precision_tag}_{arm}_l{layers}")
        if res is None:
            continue
        row: dict[str, Any] = {"type": "memory", "arm": arm, "label": ARMS[arm].label, "layers": layers,
                               "precision": res.case.precision, "ok": res.ok}
        if not res.ok:
            row["error"] = res.error()
            rows.append(row)
            continue
        psi = res.r0["params"]
        entry = census_point(res, "before_step")
        peak = max((entry, census_point(res, "in_step")), key=lambda c: c["total"])
        f = formula(arm, res.case.precision, world)
        row.update(
            params=psi,
            entry_bpp=entry["total"] / psi,
            peak_bpp=peak["total"] / psi,
            peak_parts_bpp={k: peak[k] / psi for k in ("params", "grads", "optimizer", "buffers")},
            formula_bpp=f,
            peak_ratio=peak["total"] / psi / f,
            entry_ratio=entry["total"] / psi / f,
            device_bpp=peak["device"] / psi,
            host_bpp=peak["host"] / psi,
            live_bpp=max(r.get("live_at_step", 0) for r in res.ranks) / psi,
            names={k: v / psi for k, v in peak["names"].items()},
            rss_peak=max(r["rss_peak"] for r in res.ranks),
        )
        split = formula_split(arm, res.case.precision, world)
        if split is not None:
            row["formula_device_bpp"], row["formula_host_bpp"] = split
        if ddp_states and arm != "ddp":
            row["vs_ddp_states"] = peak["total"] / ddp_states
            row["vs_ddp_states_entry"] = entry["total"] / ddp_states
            row["vs_ddp_peak"] = peak["total"] / (ddp_peak or 1)
            row["theory_vs_ddp"] = f / formula("ddp", res.case.precision, world)
        if arm == "ddp":
            row["ddp_states_bpp"] = (ddp_states or 0) / psi
        rows.append(row)
    return rows


def comm_rows(results: dict[str, CaseResult], precision_tag: str, layers: int) -> list[dict[str, Any]]:
    rows = []
    base: Optional[tuple[float, float]] = None
    for arm in ARMS:
        res = results.get(f"mem_{precision_tag}_{arm}_l{layers}")
        if res is None or not res.ok:
            continue
        psi = res.r0["params"]
        last = [r["comm_steps"][-1] for r in res.ranks]
        ring = statistics.fmean(s["ring_total"] for s in last)
        wchar = statistics.fmean(s["wchar"] for s in last)
        if arm == "ddp":
            base = (ring, wchar)
        calls: dict[str, int] = last[0]["calls"]
        row = {"type": "comm", "arm": arm, "precision": res.case.precision, "params": psi,
               "ring_bytes": ring, "wchar_bytes": wchar, "calls": calls}
        stage = ARMS[arm].stage
        if base is not None and arm != "ddp":
            row["ring_vs_ddp"] = ring / base[0]
            row["wchar_vs_ddp"] = wchar / base[1]
        if stage is not None:
            # in elements; in bytes DeepSpeed's bf16 collectives are half of DDP's fp32 ones under bf16-mixed
            # (Lightning's DDP keeps fp32 parameters and reduces fp32 gradients)
            row["theory_vs_ddp"] = COMM_THEORY[stage] * (0.5 if res.case.precision.startswith("bf16") else 1.0)
        rows.append(row)
    return rows


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least squares y = a x + b; returns (a, b, r²)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    a = sxy / sxx if sxx else 0.0
    b = my - a * mx
    ss_res = sum((y - (a * x + b)) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return a, b, (1 - ss_res / ss_tot) if ss_tot else 1.0


def rss_rows(results: dict[str, CaseResult], layers: Sequence[int], world: int) -> list[dict[str, Any]]:
    rows = []
    for arm in ("ddp", "z0", "z1", "z2", "z3"):
        row: dict[str, Any] = {"type": "rss_fit", "arm": arm, "formula_bpp": formula(arm, "bf16-mixed", world)}
        for suffix, key in (("", "rss"), ("_mmap", "rss_mmap")):
            pts = []
            for lay in layers:
                res = results.get(f"mem_bf16_{arm}_l{lay}{suffix}")
                if res is not None and res.ok:
                    peak = max((census_point(res, p) for p in ("before_step", "in_step")), key=lambda c: c["total"])
                    pts.append((res.r0["params"], max(r["rss_peak"] for r in res.ranks), peak["total"]))
            if len(pts) < 2:
                continue
            a, b, r2 = fit_line([p[0] for p in pts], [p[1] for p in pts])
            row.update({f"{key}_points": pts, f"{key}_bytes_per_param": a, f"{key}_intercept": b, f"{key}_r2": r2})
            if not suffix:
                row["census_bytes_per_param"] = fit_line([p[0] for p in pts], [p[2] for p in pts])[0]
        if "rss_points" in row:
            rows.append(row)
    return rows


def speed_rows(results: dict[str, CaseResult]) -> list[dict[str, Any]]:
    """One row per arm. Two ratios per round, each from measurements taken side by side:

    - *CPU overhead*: rank 0's process CPU time of each Trainer step ÷ that of the raw step right after it, in the
      same processes; the median over every measured step of every round;
    - *÷ DDP*: Lightning DDP's median CPU time per step ÷ the arm's, each over all its rounds (the arms of a round
      run one after the other, in an order that rotates from round to round): samples per CPU-second against DDP's.

    Beside each, min / max of the per-round values. Process CPU time is what one rank computes; other jobs
    on a loaded machine stretch wall time but barely change it. Wall-clock figures are kept beside them.
    """
    by_arm: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for res in results.values():
        if res.case.kind != "speed":
            continue
        if not res.ok:
            errors[res.case.arm] = res.error()
            continue
        d = by_arm.setdefault(res.case.arm, {"trainer": [], "raw": [], "pairs": [], "samples": [], "tcpu": [],
                                             "rcpu": []})
        r0 = res.r0
        d["trainer"] += r0["trainer_s"]
        d["raw"] += r0["raw_s"]
        d["tcpu"] += r0.get("trainer_cpu_s", [])
        d["rcpu"] += r0.get("raw_cpu_s", [])
        for phase in ("forward", "backward", "step"):
            d.setdefault("t_" + phase, []).extend(p[phase + "_cpu"] for p in r0.get("trainer_phases", []))
            d.setdefault("r_" + phase, []).extend(p[phase + "_cpu"] for p in r0.get("raw_phases", []))
        d["pairs"] += [t / r for t, r in zip(r0["trainer_s"], r0["raw_s"])]
        d.setdefault("cpu_pairs", []).extend(t / r for t, r in zip(r0.get("trainer_cpu_s", []), r0.get("raw_cpu_s", [])))
        d["samples"] = [r0["samples_per_step"]]
        if r0.get("trainer_cpu_s") and r0.get("raw_cpu_s"):  # DDP runs twice per round: pool its cases
            steps = d.setdefault("round_steps", {}).setdefault(res.case.round, ([], [], []))
            for acc, key in zip(steps, ("trainer_cpu_s", "raw_cpu_s", "trainer_s")):
                acc.extend(r0[key])
    for d in by_arm.values():
        d["rounds"] = {k: tuple(statistics.median(xs) for xs in v) for k, v in d.get("round_steps", {}).items()}
    rows = []
    ddp_sps = None
    ddp_rounds = by_arm.get("ddp", {}).get("rounds", {})
    for arm in ARMS:
        if arm not in by_arm:
            if arm in errors:
                rows.append({"type": "speed", "arm": arm, "ok": False, "error": errors[arm]})
            continue
        d = by_arm[arm]
        t, r = statistics.median(d["trainer"]), statistics.median(d["raw"])
        sps = d["samples"][0] / t
        if arm == "ddp":
            ddp_sps = sps
        rounds = d["rounds"]
        row = {"type": "speed", "arm": arm, "ok": True, "steps": len(d["trainer"]), "rounds": len(rounds),
               "trainer_median_s": t,
               "raw_median_s": r, "overhead": t / r, "paired_overhead": statistics.median(d["pairs"]),
               "trainer_iqr_s": _iqr(d["trainer"]), "raw_iqr_s": _iqr(d["raw"]), "samples_per_s": sps,
               "raw_samples_per_s": d["samples"][0] / r,
               # each Trainer step ÷ the raw step run right after it, median over every measured step: what
               # slows the machine for a moment slows both steps of a pair alike (two runs agree within ~6% here,
               # the ratio of the two medians within ~9%)
               "cpu_overhead": statistics.median(d["cpu_pairs"]) if d.get("cpu_pairs") else None,
               "cpu_overhead_of_medians": statistics.median(d["tcpu"]) / statistics.median(d["rcpu"]) if d["rcpu"]
               else None,
               "cpu_overhead_rounds": _spread([tc / rc for tc, rc, _ in rounds.values()]),
               "trainer_cpu_median_s": statistics.median(d["tcpu"]) if d["tcpu"] else None,
               "cpu_phase_delta_ms": {p: 1e3 * (statistics.median(d["t_" + p]) - statistics.median(d["r_" + p]))
                                      for p in ("forward", "backward", "step") if d.get("t_" + p) and d.get("r_" + p)},
               "trainer_cpu_phase_ms": {p: 1e3 * statistics.median(d["t_" + p])
                                        for p in ("forward", "backward", "step") if d.get("t_" + p)}}
        if arm != "ddp" and ddp_rounds:
            common = sorted(set(rounds) & set(ddp_rounds))
            row["cpu_vs_ddp_rounds"] = _spread([ddp_rounds[k][0] / rounds[k][0] for k in common])
            row["wall_vs_ddp_rounds"] = _spread([ddp_rounds[k][2] / rounds[k][2] for k in common])
            # DDP's and the arm's median CPU time per step over all their rounds: each round's ratio compares two
            # processes, whose speed differs by up to ±15% on this VM; pooling the steps halves the run-to-run spread
            ddp_tcpu = by_arm.get("ddp", {}).get("tcpu")
            row["cpu_vs_ddp"] = statistics.median(ddp_tcpu) / statistics.median(d["tcpu"]) if ddp_tcpu and d["tcpu"] \
                else None
            fused_tcpu = by_arm.get("ddp_fused", {}).get("tcpu")  # DDP with AdamW(fused=True): the fair reference
            row["cpu_vs_ddp_fused"] = statistics.median(fused_tcpu) / statistics.median(d["tcpu"]) \
                if fused_tcpu and d["tcpu"] and arm != "ddp_fused" else None
        if ddp_sps and arm != "ddp":
            row["vs_ddp"] = sps / ddp_sps
        rows.append(row)
    return rows


def _spread(xs: Sequence[float]) -> dict[str, Optional[float]]:
    if not xs:
        return {"min": None, "median": None, "max": None, "n": 0}
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def _iqr(xs: Sequence[float]) -> float:
    if len(xs) < 4:
        return 0.0
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


# ------------------------------------------------------------------------------------------ meta
def meta(settings: dict[str, Any], world: int, elapsed: float, build: Optional[dict[str, Any]]) -> dict[str, Any]:
    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "-"

    cpu = "-"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    except (ValueError, OSError):
        mem_gib = 0.0
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "lightning_gaudi_ds"], cwd=HERE.parent,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "-", False
    from bench_model import ZeroSettings

    return {
        "type": "meta",
        "date": __import__("datetime").datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_gib, 1),
                    "platform": platform.platform(), "load_avg_at_end": os.getloadavg()},
        "versions": {"python": platform.python_version(), "torch": version("torch"), "lightning": version("lightning"),
                     "deepspeed": version("deepspeed"), "lightning_gaudi_ds": version("lightning_gaudi_ds"),
                     "commit": commit + ("+dirty" if dirty else "")},
        "settings": {**settings, "world_size": world, "backend": "gloo", "torch_threads_per_rank": 1,
                     "optimizer": "torch.optim.AdamW (offload: DeepSpeedCPUAdam)",
                     "zero": ZeroSettings.for_hidden(settings["hidden"]).__dict__},
        "elapsed_s": round(elapsed, 1),
        "cpu_adam_build": build,
    }


# ------------------------------------------------------------------------------------------ output
def _ok(value: Optional[float], lo: Optional[float], hi: Optional[float]) -> str:
    if value is None:
        return ""
    eps = 1e-9  # exact boundary values (e.g. 20/16 = 1.25) pass
    good = (lo is None or value >= lo - eps) and (hi is None or value <= hi + eps)
    return "✓" if good else "✗"


def _f(x: Optional[float], nd: int = 2) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def _names(names: dict[str, float], top: int = 3) -> str:
    keep = [(k, v) for k, v in names.items() if k.startswith("buffers") or "offload" in k or "fp32_partitioned" in k]
    return ", ".join(f"`{k.split(':', 2)[2]}` {v:.2f}" for k, v in keep[:top] if v >= 0.005)


def markdown(m: dict[str, Any], mem: list[dict[str, Any]], mem32: list[dict[str, Any]], rss: list[dict[str, Any]],
             speed: list[dict[str, Any]], comm: list[dict[str, Any]], failures: list[str]) -> str:
    s = m["settings"]
    psi = next((r["params"] for r in mem if r.get("ok")), None)
    lines = [
        f"Run {m['date']}, {m['elapsed_s']:.0f} s end to end; {m['machine']['cpu']}, {m['machine']['cores']} cores, "
        f"{m['machine']['memory_gib']} GiB; load average at the end {', '.join(f'{x:.1f}' for x in m['machine']['load_avg_at_end'])} "
        + ("(other jobs ran beside this one)" if max(m["machine"]["load_avg_at_end"]) > m["machine"]["cores"] + 0.5
           else "(the benchmark's own ranks only)")
        + f". torch {m['versions']['torch']}, lightning "
        f"{m['versions']['lightning']}, deepspeed {m['versions']['deepspeed']}, commit {m['versions']['commit']}.",
        f"N = {s['world_size']} ranks on gloo, 1 torch thread each; model: {s['main_layers']} × Linear({s['hidden']}, "
        f"{s['hidden']}) (Ψ = {psi / 1e6:.1f}M)" if psi else "",
        f"; AdamW; micro-batch {s['batch_size']}; ZeRO buckets: reduce/allgather {s['zero']['reduce_bucket_size']:,}, "
        f"ZeRO-3 prefetch {s['zero']['stage3_prefetch_bucket_size']:,}, persistence threshold "
        f"{s['zero']['stage3_param_persistence_threshold']:,} elements; communication settings: the strategy's"
        " CPU defaults (overlap_comm off; ZeRO-1/2 reduce each gradient slice to its owner).",
        "",
    ]
    lines[1] = lines[1] + lines[2]
    del lines[2]
    if failures:
        lines += ["**Failed cases:** " + "; ".join(failures), ""]
    if mem:
        lines += [
            "#### 1-2. Model-state bytes per rank (bf16-mixed) ÷ the ZeRO paper's formula, and ÷ DDP",
            "",
            "Bytes of every tensor the engine holds (parameters, gradients, optimizer states, DeepSpeed's buffers;"
            " each storage once), per parameter. *entry*: at the optimizer step's entry (the paper's accounting);"
            " *peak*: the larger of that and the census inside the step (fp32 gradient partition created).",
            "",
            "| arm | entry B/Ψ | peak B/Ψ | formula B/Ψ | peak ÷ formula | entry ÷ formula | peak ÷ DDP states | "
            "entry ÷ DDP states | theory | peak ÷ DDP peak | largest buffers (B/Ψ) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in mem:
            if not r.get("ok"):
                lines.append(f"| {r['label']} | failed: {r.get('error', '')[:80]} |||||||||")
                continue
            stage = ARMS[r["arm"]].stage
            target = VS_DDP_TARGET.get(stage or -1) if not ARMS[r["arm"]].offload_optimizer else None
            vs, vs_entry = r.get("vs_ddp_states"), r.get("vs_ddp_states_entry")
            lines.append(
                f"| {r['label']} | {r['entry_bpp']:.2f} | {r['peak_bpp']:.2f} | {r['formula_bpp']:.2f} | "
                f"{r['peak_ratio']:.3f} {_ok(r['peak_ratio'], *FORMULA_RATIO)} | {r['entry_ratio']:.3f} "
                f"{_ok(r['entry_ratio'], *FORMULA_RATIO)} | {_f(vs, 3)} {_ok(vs, None, target) if target else ''} | "
                f"{_f(vs_entry, 3)} {_ok(vs_entry, None, target) if target else ''} | "
                f"{_f(r.get('theory_vs_ddp'), 3)} | {_f(r.get('vs_ddp_peak'), 3)} | {_names(r['names'])} |"
            )
        ddp = next((r for r in mem if r["arm"] == "ddp" and r.get("ok")), None)
        if ddp:
            lines += ["", f"DDP's states (params + grads + Adam) are {ddp['ddp_states_bpp']:.2f} B/Ψ; its peak adds"
                      f" {ddp['peak_bpp'] - ddp['ddp_states_bpp']:.2f} B/Ψ of gradient buckets (torch DDP,"
                      " gradient_as_bucket_view=False, Lightning's default)."]
        off = [r for r in mem if r.get("ok") and "formula_host_bpp" in r]
        if off:
            lines += ["", "ZeRO-Offload, device vs host (on this CPU-only machine by role: what DeepSpeed allocates"
                      " with its offload device, see meter.py):", "",
                      "| arm | device B/Ψ | formula | host B/Ψ | formula | total ÷ formula |", "|---|---|---|---|---|---|"]
            for r in off:
                lines.append(f"| {r['label']} | {r['device_bpp']:.2f} | {r['formula_device_bpp']:.2f} | "
                             f"{r['host_bpp']:.2f} | {r['formula_host_bpp']:.2f} | {r['peak_ratio']:.2f} |")
    if mem32:
        lines += ["", "fp32 (32-true; formula with 4 B parameters, 4 B gradients, 8 B Adam states):", "",
                  "| arm | entry B/Ψ | peak B/Ψ | formula B/Ψ | peak ÷ formula | peak ÷ DDP states | theory |",
                  "|---|---|---|---|---|---|---|"]
        for r in mem32:
            if r.get("ok"):
                lines.append(f"| {r['label']} | {r['entry_bpp']:.2f} | {r['peak_bpp']:.2f} | {r['formula_bpp']:.2f} | "
                             f"{r['peak_ratio']:.2f} {_ok(r['peak_ratio'], *FORMULA_RATIO)} | "
                             f"{_f(r.get('vs_ddp_states'))} | {_f(r.get('theory_vs_ddp'), 3)} |")
    if rss:
        lines += ["", "#### 3. Peak RSS per rank: fitted bytes per parameter (bf16-mixed)", "",
                  "| arm | sizes (Ψ, M) | RSS slope B/param | R² | RSS slope, freed memory returned | R² | "
                  "tensor-census slope B/param | formula B/param |", "|---|---|---|---|---|---|---|---|"]
        for r in rss:
            sizes = ", ".join(f"{p[0] / 1e6:.1f}" for p in r["rss_points"])
            lines.append(f"| {ARMS[r['arm']].label} | {sizes} | {r['rss_bytes_per_param']:.1f} | {r['rss_r2']:.3f} | "
                         f"{_f(r.get('rss_mmap_bytes_per_param'), 1)} | {_f(r.get('rss_mmap_r2'), 3)} | "
                         f"{r['census_bytes_per_param']:.1f} | {r['formula_bpp']:.0f} |")
        lines += ["", "*freed memory returned*: the same sweep with glibc's mmap threshold pinned to 64 KiB (mallopt),"
                  " so that every freed tensor leaves the process at once; by default glibc raises that threshold"
                  " up to 32 MiB as blocks are freed, and freed tensors below it stay in the heap and in RSS."]
    if speed:
        lines += ["", "#### 4-5. Step time: Trainer + strategy ÷ the same training by hand; samples/s ÷ Lightning DDP",
                  "", "Rank 0's step times, warm-up dropped, rounds interleaved; each Trainer step is followed by one"
                  " step of the hand-written loop (deepspeed.initialize, or torch DDP for the DDP row) in the same"
                  " processes.", "",
                  "| arm | rounds × steps | Trainer CPU ms/step: fwd / bwd / step | CPU time Trainer ÷ raw: median of step pairs (min-max of rounds)"
                  " | CPU ms Trainer − raw: fwd / bwd / step | samples per CPU-s ÷ DDP: all rounds (min-max of rounds) |"
                  " samples per CPU-s ÷ DDP with AdamW(fused=True) | wall: Trainer ÷ raw | wall: samples/s ÷ DDP,"
                  " median (min-max) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in speed:
            if not r.get("ok"):
                lines.append(f"| {ARMS[r['arm']].label} | failed: {r.get('error', '')[:80]} ||||||||")
                continue
            tgt = _ok(r.get("cpu_overhead"), None, OVERHEAD_TARGET) if r["arm"] != "ddp" else ""
            co, vd, wd = r.get("cpu_overhead_rounds") or {}, r.get("cpu_vs_ddp_rounds") or {}, \
                r.get("wall_vs_ddp_rounds") or {}
            lines.append(f"| {ARMS[r['arm']].label} | {r.get('rounds', '–')} × {r['steps'] // max(r.get('rounds') or 1, 1)}"
                         f" | {_f((r.get('trainer_cpu_median_s') or 0) * 1e3, 0)}: "
                         f"{' / '.join(f'{v:.0f}' for v in r.get('trainer_cpu_phase_ms', {}).values())}"
                         f" | {_f(r.get('cpu_overhead'), 3)} {tgt}"
                         f" ({_f(co.get('min'), 3)}-{_f(co.get('max'), 3)}) | "
                         f"{' / '.join(f'{v:+.1f}' for v in r.get('cpu_phase_delta_ms', {}).values())} | "
                         + (f"{_f(r.get('cpu_vs_ddp'))} ({_f(vd.get('min'))}-{_f(vd.get('max'))})" if vd else "–")
                         + f" | {_f(r.get('cpu_vs_ddp_fused'))}"
                         + f" | {r['overhead']:.3f} | "
                         + (f"{_f(wd.get('median'))} ({_f(wd.get('min'))}-{_f(wd.get('max'))})" if wd else "–")
                         + " |")
        lines.append("")
        lines.append("(CPU time: rank 0's process CPU time (user + sys), which other jobs on a loaded machine barely"
                     " change; wall time is shown for reference only. *Trainer ÷ raw*: per step, the Trainer with the"
                     " strategy against `deepspeed.initialize` by hand (torch DDP for the DDP row), alternating step"
                     " by step in the same processes; the median of the per-step ratios over all rounds, and the"
                     " range of the rounds' ratios of medians. *÷ DDP*: Lightning DDP's median CPU time per step ÷ the"
                     " arm's, over all rounds; in brackets the range of the per-round ratios (both from the same round);"
                     " *÷ DDP with AdamW(fused=True)*: the same against Lightning DDP whose AdamW uses torch's fused"
                     " CPU kernel, as the strategy's ZeRO does on CPU. *fwd* runs from the batch's arrival to the loss, *step* from the end of backward to the"
                     " end of the batch, Lightning's hooks included.)")
    if comm:
        lines += ["", "#### 6. Bytes sent per rank per step ÷ DDP's", "",
                  "*ring*: the collectives' payloads under the ring algorithms of NCCL/HCCL (all-reduce of M bytes"
                  " sends 2M(N-1)/N, reduce-scatter and all-gather M(N-1)/N); *gloo*: what the rank process really"
                  " wrote (/proc/self/io), i.e. gloo's own algorithms.", "",
                  "| arm | precision | collectives per step | ring MB | gloo MB | ring ÷ DDP | gloo ÷ DDP | theory |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in comm:
            calls = ", ".join(f"{k}×{v}" for k, v in sorted(r["calls"].items()) if k not in ("broadcast",))
            lines.append(f"| {ARMS[r['arm']].label} | {r['precision']} | {calls} | {r['ring_bytes'] / MIB:.1f} | "
                         f"{r['wchar_bytes'] / MIB:.1f} | {_f(r.get('ring_vs_ddp'))} | {_f(r.get('wchar_vs_ddp'))} | "
                         f"{_f(r.get('theory_vs_ddp'))} |")
    return "\n".join(lines) + "\n"


def charts(out: Path, mem: list[dict[str, Any]], rss: list[dict[str, Any]], speed: list[dict[str, Any]],
           comm: list[dict[str, Any]]) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no charts", flush=True)
        return []
    made = []
    ok_mem = [r for r in mem if r.get("ok")]
    if ok_mem:
        fig, ax = plt.subplots(figsize=(9, 4.2))
        colors = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "buffers": "#c44e52"}
        xs = range(len(ok_mem))
        bottom = [0.0] * len(ok_mem)
        for part, color in colors.items():
            vals = [r["peak_parts_bpp"][part] for r in ok_mem]
            ax.bar(xs, vals, bottom=bottom, color=color, label=part, width=0.6)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.scatter(xs, [r["formula_bpp"] for r in ok_mem], marker="_", s=900, color="black", zorder=3,
                   label="paper formula")
        ax.set_xticks(list(xs), [ARMS[r["arm"]].short for r in ok_mem], fontsize=8)
        ax.set_ylabel("bytes per parameter per rank")
        ax.set_title(f"Model-state bytes per rank at peak (bf16-mixed, N=2, Ψ={ok_mem[0]['params'] / 1e6:.1f}M)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "memory_vs_formula.png", dpi=110)
        plt.close(fig)
        made.append("memory_vs_formula.png")
    if rss:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for r in rss:
            xs = [p[0] / 1e6 for p in r["rss_points"]]
            ys = [p[1] / (1 << 30) for p in r["rss_points"]]
            line = ax.plot(xs, ys, "o", label=f"{ARMS[r['arm']].label}: {r['rss_bytes_per_param']:.1f} B/param "
                                              f"(formula {r['formula_bpp']:.0f})")[0]
            fx = [min(xs), max(xs)]
            ax.plot(fx, [(r["rss_bytes_per_param"] * x * 1e6 + r["rss_intercept"]) / (1 << 30) for x in fx],
                    color=line.get_color(), lw=1)
            if "rss_mmap_points" in r:
                mx = [p[0] / 1e6 for p in r["rss_mmap_points"]]
                my = [p[1] / (1 << 30) for p in r["rss_mmap_points"]]
                ax.plot(mx, my, "x", color=line.get_color(),
                        label=f"  freed memory returned: {r['rss_mmap_bytes_per_param']:.1f} B/param")
                ax.plot([min(mx), max(mx)], [(r["rss_mmap_bytes_per_param"] * x * 1e6 + r["rss_mmap_intercept"])
                                             / (1 << 30) for x in (min(mx), max(mx))], color=line.get_color(),
                        lw=1, ls=":")
        ax.set_xlabel("parameters Ψ (millions)")
        ax.set_ylabel("peak RSS per rank (GiB)")
        ax.set_title("Peak RSS per rank vs model size, fitted slopes (bf16-mixed, N=2)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "rss_slopes.png", dpi=110)
        plt.close(fig)
        made.append("rss_slopes.png")
    ok_speed = [r for r in speed if r.get("ok")]
    ok_comm = [r for r in comm if "ring_vs_ddp" in r]
    if ok_speed or ok_comm:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [1, 2.2]})
        if ok_speed:
            labels = [ARMS[r["arm"]].short for r in ok_speed]
            xs = list(range(len(ok_speed)))
            axes[0].bar([x - 0.2 for x in xs], [r.get("cpu_overhead") or 0 for r in ok_speed], width=0.4,
                        label="CPU time: Trainer ÷ raw loop")
            axes[0].bar([x + 0.2 for x in xs], [r.get("cpu_vs_ddp") or 1.0 for r in ok_speed], width=0.4,
                        label="samples per CPU-s ÷ Lightning DDP")
            axes[0].axhline(OVERHEAD_TARGET, color="black", lw=0.8, ls="--", label="1.05")
            axes[0].set_xticks(xs, labels, fontsize=7)
            axes[0].set_title("Speed ratios", fontsize=9)
            axes[0].legend(fontsize=7)
        if ok_comm:
            labels = [f"{ARMS[r['arm']].short}\n{r['precision'][:4]}" for r in ok_comm]
            xs = list(range(len(ok_comm)))
            axes[1].bar([x - 0.2 for x in xs], [r["ring_vs_ddp"] for r in ok_comm], width=0.4, label="ring model")
            axes[1].bar([x + 0.2 for x in xs], [r["wchar_vs_ddp"] for r in ok_comm], width=0.4, label="gloo (bytes written)")
            axes[1].scatter(xs, [r.get("theory_vs_ddp", 0) for r in ok_comm], marker="_", s=300, color="black",
                            zorder=3, label="theory")
            axes[1].set_xticks(xs, labels, fontsize=6)
            axes[1].set_title("Bytes sent per rank per step ÷ DDP (same precision)", fontsize=9)
            axes[1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "speed_and_comm.png", dpi=110)
        plt.close(fig)
        made.append("speed_and_comm.png")
    return made


def write_report(out: Path, cases: Sequence[Case], settings: dict[str, Any], world: int, elapsed: float,
                 build: Optional[dict[str, Any]], quick: bool, update_readme: bool,
                 keep_meta: bool = False, job_ok: bool = True) -> list[str]:
    """results.jsonl, table.md and the charts of the run in ``out``/raw, published in ``out`` (and benchmarks/README.md
    when ``update_readme``) only when the job ended well (``job_ok``) and no case failed; the cases that failed."""
    results = load(out / "raw" / "cases", cases, world)
    failures = [f"{cid}: {r.error()[:200]}" for cid, r in results.items() if not r.ok]
    main = settings["main_layers"]
    mem = memory_rows(results, "bf16", main, world)
    mem32 = memory_rows(results, "fp32", main, world)
    comm = comm_rows(results, "bf16", main) + comm_rows(results, "fp32", main)
    rss = rss_rows(results, settings["layers"], world)
    speed = speed_rows(results)
    saved_meta = out / "raw" / "meta.json"
    if keep_meta and saved_meta.exists():  # --report-only: the run's own date, commit and load, not today's
        m = json.loads(saved_meta.read_text())
    else:
        m = meta(settings, world, elapsed, build)
        saved_meta.write_text(json.dumps(m))
    table = markdown(m, mem, mem32, rss, speed, comm, failures)
    print(table, flush=True)
    with publish.staged(out) as stage:
        made = _write_files(stage.path, m, mem + mem32 + rss + speed + comm, results, table, (mem, rss, speed, comm))
        if failures or not job_ok:
            stage.discard(f"{len(failures)} case(s) failed" if failures else "the job failed", keep=True)
            return failures or ["the job failed"]
    if update_readme and README.exists():
        text = README.read_text()
        if START in text and END in text:
            images = "\n".join(f"![{name}](results/{name})" for name in made)
            body = f"{START}\n{table}\n{images}\n{END}"
            text = text[:text.index(START)] + body + text[text.index(END) + len(END):]
            publish.write_text(README, text)
    print(f"wrote {out / 'results.jsonl'}, {out / 'table.md'}" + "".join(f", {out / n}" for n in made), flush=True)
    return failures


def _write_files(out: Path, m: dict[str, Any], rows: list[dict[str, Any]], results: dict[str, CaseResult],
                 table: str, chart_rows: tuple[list[dict[str, Any]], ...]) -> list[str]:
    with open(out / "results.jsonl", "w") as f:
        f.write(json.dumps(m) + "\n")
        for row in rows:
            f.write(json.dumps(row) + "\n")
        for cid, res in results.items():
            for rank, r in enumerate(res.ranks):
                slim = {k: v for k, v in r.items() if k not in ("traceback",)}
                for step in slim.get("comm_steps", []):
                    step.pop("detail", None)
                f.write(json.dumps({"type": "case", "id": cid, "rank": rank, **slim}, default=str) + "\n")
    (out / "table.md").write_text(table)
    return charts(out, *chart_rows)
