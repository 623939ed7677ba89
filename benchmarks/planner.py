"""The memory planner held against measurement: predicted ÷ measured bytes per rank, per ZeRO arm.

For the benchmark model at each stage and offload arm, and for the example GPT (examples/train_lm.py), two
ranks train a few steps on gloo (the memory cases of worker.py). Measured per rank on the census step:

- *model states*: the tensor census of meter.py (parameters, gradients, optimizer states, DeepSpeed's
  buffers; the larger of the optimizer step's entry and inside it) — predicted: ``model_state_bytes``;
- *peak*: the C heap in use at its highest during the whole step (forward, backward, optimizer step; glibc
  ``mallinfo2`` after every operator) minus what was in use before the model was built — predicted:
  model states + DeepSpeed's transient buffers + the activations that ``measure_activation_bytes`` measured
  in this process (one forward/backward of one micro batch, no DeepSpeed).

DeepSpeed's own estimators (``estimate_zero2_model_states_mem_needs``, ``estimate_zero3_...``; ZeRO-1 has
none, users take ZeRO-2's) stand beside: per rank, their GPU figure plus, with offload, their CPU figure
shared by the node's ranks.

    python benchmarks/planner.py                 # run (a few minutes on 2 cores) and report
    python benchmarks/planner.py --report-only   # rebuild table, chart and README section from raw results
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import publish  # noqa: E402
from cases import ARMS, Case  # noqa: E402
from flags import positive_float, positive_int  # noqa: E402
from launch import run_ranks  # noqa: E402

WORLD = 2
BENCH_ARMS = ("z0", "z1", "z2", "z3", "z2_offload", "z3_offload")
GPT_ARMS = ("z1", "z2", "z3")
GPT = {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 128}
STATES_GOAL, PEAK_GOAL = (0.95, 1.05), (0.90, 1.10)
README = HERE / "README.md"
START, END = "<!-- planner:start -->", "<!-- planner:end -->"
MIB = 2**20


def plan_cases(hidden: int, layers: int, batch_size: int) -> list[Case]:
    common = dict(kind="memory", batch_size=batch_size, steps=3, census_step=1, timeout=400.0)
    cases = [Case(id=f"plan_bench_{arm}", arm=arm, hidden=hidden, layers=layers, extra={"heap_peak": True}, **common)
             for arm in BENCH_ARMS]
    cases += [Case(id=f"plan_gpt_{arm}", arm=arm, hidden=GPT["n_embd"], layers=GPT["n_layer"],
                   extra={"heap_peak": True, "gpt": GPT}, **common) for arm in GPT_ARMS]
    return cases


# ------------------------------------------------------------------------------------------ predictions
def _module_and_batch(case: Case) -> tuple[Any, Any, Any]:
    """(class, init kwargs, one micro batch) of the case's model."""
    import torch

    if case.extra.get("gpt"):
        sys.path.insert(0, str(HERE.parent / "examples"))
        from train_lm import LitGPT

        return LitGPT, dict(GPT), torch.randint(0, 256, (case.batch_size, GPT["block_size"]))
    from bench_model import BenchModule, ModelSize

    return BenchModule, {"size": ModelSize(case.hidden, case.layers)}, torch.randn(case.batch_size, case.hidden)


def activation_bytes(case: Case) -> int:
    import torch

    from lightning_gaudi_ds.planning.activations import measure_activation_bytes

    torch.set_num_threads(1)
    cls, kwargs, batch = _module_and_batch(case)
    module = cls(**kwargs)
    module.configure_model()
    return measure_activation_bytes(module, batch, case.precision)


def predict(case: Case, config: dict[str, Any] | None, activations: int) -> dict[str, Any]:
    from lightning_gaudi_ds.planning import Buckets, plan_memory
    from lightning_gaudi_ds.planning.model import build_on_meta, spec_from_module

    cls, kwargs, _ = _module_and_batch(case)
    spec = spec_from_module(build_on_meta(cls, kwargs))
    zero = (config or {}).get("zero_optimization") or {}
    arm = ARMS[case.arm]
    # the GPT's configure_optimizers makes two parameter groups (weight decay on matrices only)
    (row,) = plan_memory(spec, devices=WORLD, precision=case.precision, activation_bytes=activations,
                         buckets=Buckets.for_model(spec.hidden_size, zero),
                         param_groups=2 if case.extra.get("gpt") else 1,
                         configurations=[(arm.stage, arm.offload_optimizer, arm.offload_parameters)])
    row["largest_param"] = spec.largest_param
    return row


def deepspeed_estimate(case: Case, params: int, largest: int) -> int | None:
    """Model-state bytes per rank by DeepSpeed's estimators (None for ZeRO-0: it has none)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    arm = ARMS[case.arm]
    if arm.stage in (1, 2):
        cpu, gpu = estimate_zero2_model_states_mem_needs(params, WORLD, 1, cpu_offload=arm.offload_optimizer)
    elif arm.stage == 3:
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(params, largest, WORLD, 1, arm.offload_optimizer,
                                                            arm.offload_parameters)
    else:
        return None
    return int(gpu + (cpu / WORLD if arm.offload_optimizer else 0))


# ------------------------------------------------------------------------------------------ report
def measured(case_dir: Path, case: Case) -> dict[str, Any]:
    ranks = []
    for r in range(WORLD):
        f = case_dir / f"{case.id}.rank{r}.json"
        ranks.append(json.loads(f.read_text()) if f.exists() else {"ok": False, "error": "no result file"})
    if not all(r.get("ok") for r in ranks):
        return {"ok": False, "error": "; ".join(sorted({str(r.get("error")) for r in ranks if not r.get("ok")}))}
    states = max(max(r["census"][p]["total"] for p in ("before_step", "in_step")) for r in ranks)
    # tensors held when the step starts + the most the C heap grew during it (the framework's own host
    # memory, allocated before, is left out: on an accelerator it would not be in device memory)
    peak, peak_op = max((r["census"]["step_start"]["total"] + r["heap_peak"] - r["heap_step_start"],
                         r.get("heap_peak_op", "")) for r in ranks)
    whole = max(r["heap_peak"] - r["heap_start"] for r in ranks)
    return {"ok": True, "params": ranks[0]["params"], "states": states, "peak": peak, "peak_op": peak_op,
            "process_peak": whole,
            "config": ranks[0]["config"]}


def analyse(raw: Path, cases: list[Case]) -> list[dict[str, Any]]:
    rows = []
    acts: dict[tuple[str, str, int], int] = {}
    for case in cases:
        m = measured(raw / "cases", case)
        row: dict[str, Any] = {"type": "planner", "case": case.id, "model": "gpt" if case.extra.get("gpt") else "bench",
                               "arm": case.arm, "label": ARMS[case.arm].label, "precision": case.precision,
                               "ok": m["ok"]}
        if not m["ok"]:
            rows.append({**row, "error": m["error"]})
            continue
        key = (row["model"], case.precision, case.batch_size)
        if key not in acts:
            acts[key] = activation_bytes(case)
        p = predict(case, m["config"], acts[key])
        ds = deepspeed_estimate(case, p["params"], p["largest_param"])
        pred_peak = p["device_bytes"] + p["host_bytes_per_rank"]
        row.update(params=p["params"], measured_states=m["states"], predicted_states=p["model_state_bytes"],
                   states_ratio=p["model_state_bytes"] / m["states"], measured_peak=m["peak"],
                   predicted_peak=pred_peak, peak_ratio=pred_peak / m["peak"], activations=acts[key],
                   peak_phase="backward" if p["backward_peak_bytes"] >= p["step_peak_bytes"] else "step",
                   step_temporaries=p["step_temporary_bytes"],
                   process_peak=m["process_peak"], peak_op=m["peak_op"],
                   transient=p["transient_bytes"], deepspeed_states=ds,
                   deepspeed_ratio=None if ds is None else ds / m["states"], predicted=p)
        rows.append(row)
    return rows


def _ok(x: float, goal: tuple[float, float]) -> str:
    return "✓" if goal[0] <= x <= goal[1] else "✗"


def table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"Run {meta['date']}, {meta['elapsed_s']:.0f} s; {meta['machine']}; torch {meta['versions']['torch']},"
        f" deepspeed {meta['versions']['deepspeed']}, lightning {meta['versions']['lightning']}. {WORLD} ranks on"
        f" gloo, bf16-mixed, AdamW (offload: DeepSpeedCPUAdam), micro batch {meta['batch_size']}."
        f" Benchmark model: {meta['layers']} × Linear({meta['hidden']}, {meta['hidden']});"
        f" example GPT: {GPT['n_layer']} layers, width {GPT['n_embd']}, context {GPT['block_size']}.",
        "",
        "| model | arm | Ψ | states measured | predicted | ÷ | DeepSpeed's estimate | ÷ | peak measured |"
        " predicted (at) | ÷ |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['model']} | {r['label']} | failed: {r['error'][:120]} |||||||||")
            continue
        ds = "–" if r["deepspeed_states"] is None else f"{r['deepspeed_states'] / MIB:.1f} MiB"
        dsr = "–" if r["deepspeed_ratio"] is None else f"{r['deepspeed_ratio']:.2f}"
        lines.append(
            f"| {'GPT' if r['model'] == 'gpt' else 'bench'} | {r['label']} | {r['params'] / 1e6:.2f}M |"
            f" {r['measured_states'] / MIB:.1f} MiB | {r['predicted_states'] / MIB:.1f} MiB |"
            f" {r['states_ratio']:.3f} {_ok(r['states_ratio'], STATES_GOAL)} | {ds} | {dsr} |"
            f" {r['measured_peak'] / MIB:.1f} MiB | {r['predicted_peak'] / MIB:.1f} MiB ({r['peak_phase']}) |"
            f" {r['peak_ratio']:.3f} {_ok(r['peak_ratio'], PEAK_GOAL)} |")
    lines += ["", "Predicted peak: the larger of *backward* (the states at the step's entry + DeepSpeed's buckets and"
              " gathered parameters + the measured activations of one micro batch) and *step* (the states inside the"
              " optimizer step + the torch optimizer's temporaries).",
              " Where the measured peak came: the operator after which the heap was highest, per arm, in"
              " `planner.jsonl` (`peak_op`). With the optimizer offloaded it is gloo's all-gather of the updated"
              " parameters: gloo stages the whole output in a temporary (2 bytes per parameter), which NCCL and HCCL"
              " do not; the planner leaves it out.",
              "", f"Goals: states {STATES_GOAL[0]}-{STATES_GOAL[1]}, peak {PEAK_GOAL[0]}-{PEAK_GOAL[1]}."
              " DeepSpeed's estimate for ZeRO-1 is its ZeRO-2 estimator (it has none for ZeRO-1)."]
    return "\n".join(lines)


def chart(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["ok"]]
    names = [("GPT " if r["model"] == "gpt" else "") + ARMS[r["arm"]].short for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    panels = (("measured_states", "predicted_states", "model states per rank"),
              ("measured_peak", "predicted_peak", "peak per rank (with activations)"))
    for ax, (meas, pred, title) in zip(axes, panels, strict=True):
        xs = range(len(ok))
        ax.bar([x - 0.2 for x in xs], [r[meas] / MIB for r in ok], 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], [r[pred] / MIB for r in ok], 0.4, label="predicted (planner)")
        if meas == "measured_states":
            ax.scatter(list(xs), [(r["deepspeed_states"] or float("nan")) / MIB for r in ok], color="black",
                       marker="x", zorder=3, label="DeepSpeed's estimator")
        ax.set_xticks(list(xs), names, fontsize=8)
        ax.set_ylabel("MiB")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any], update_readme: bool) -> bool:
    """The table, chart and rows, published in ``out`` only when every case ran (else kept aside); whether they
    were."""
    md = table(rows, meta)
    with publish.staged(out) as stage:
        (stage.path / "planner.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [{"type": "meta", **meta},
                                                                                           *rows]))
        (stage.path / "planner.md").write_text(md + "\n")
        try:
            chart(rows, stage.path / "planner.png")
        except ImportError as err:
            print(f"no chart: {err}")
        failed = [r["case"] for r in rows if not r["ok"]]
        if failed:
            stage.discard(f"{len(failed)} case(s) failed ({', '.join(failed)})", keep=True)
            return False
    if update_readme:
        text = README.read_text()
        if START in text and END in text:
            head, rest = text.split(START, 1)
            text = head + START + "\n" + md + "\n\n![planner](results/planner.png)\n" + END + rest.split(END, 1)[1]
            publish.write_text(README, text)
    print(md)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=positive_int, default=512)
    parser.add_argument("--layers", type=positive_int, default=8)
    parser.add_argument("--batch-size", dest="batch_size", type=positive_int, default=16)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--timeout", type=positive_float, default=1800)
    parser.add_argument("--report-only", dest="report_only", action="store_true")
    parser.add_argument("--no-readme", dest="no_readme", action="store_true")
    parser.add_argument("--cases", nargs="+", help="only these case ids (development)")
    args = parser.parse_args(argv)
    raw = args.out / "raw" / "planner"
    cases = [c for c in plan_cases(args.hidden, args.layers, args.batch_size) if not args.cases or c.id in args.cases]
    elapsed = 0.0
    if not args.report_only:
        if raw.exists():  # the ranks meet through file stores named after the case: none may be left over
            shutil.rmtree(raw)
        (raw / "cases").mkdir(parents=True)
        (raw / "rdv").mkdir()
        (raw / "plan.json").write_text(json.dumps({"cases": [c.to_json() for c in cases]}, indent=1))
        t0 = time.time()
        job = run_ranks([sys.executable, str(HERE / "worker.py"), "--plan", str(raw / "plan.json"), "--out",
                         str(raw / "cases")], WORLD, raw, args.timeout,
                        {"BENCH_RDV_DIR": str(raw / "rdv"), "BENCH_ROOT_DIR": str(raw / "root")})
        elapsed = time.time() - t0
        (raw / "run.json").write_text(json.dumps({"elapsed": elapsed, "ok": job.ok}))
        print(f"job {'ok' if job.ok else 'FAILED'} in {elapsed:.0f}s", flush=True)
    elif not (raw / "run.json").is_file():
        parser.error(f"--report-only: no run to report in {raw} (no run.json); run planner.py first, or pass --out"
                     " with the folder of an earlier run")
    else:
        elapsed = json.loads((raw / "run.json").read_text())["elapsed"]
    from importlib import metadata

    import psutil

    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "elapsed_s": elapsed, "hidden": args.hidden,
            "layers": args.layers, "batch_size": args.batch_size, "world_size": WORLD, "gpt": GPT,
            "machine": f"{platform.processor() or platform.machine()}, {psutil.cpu_count()} cores,"
                       f" {psutil.virtual_memory().total / 2**30:.1f} GiB",
            "versions": {k: metadata.version(k) for k in ("torch", "deepspeed", "lightning")}}
    rows = analyse(raw, cases)
    return 0 if write(args.out, rows, meta, update_readme=not args.no_readme) else 1


if __name__ == "__main__":
    sys.exit(main())
