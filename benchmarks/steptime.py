"""The step-time model (lightning_gaudi_ds/planning/steptime.py) held against measured runs (issue 41).

    python benchmarks/steptime.py          # results/steptime.{jsonl,md}, the READMEs' sections; no training

Three checks, all from results already committed:

1. **This machine, 2 ranks on one host**: the speed rows of ``benchmarks/results/speed_this_cpu/results.jsonl``
   (``run_all.py --only speed`` on this machine: rank 0's CPU seconds per Trainer step, median over rounds).
2. **This machine, 2 hosts x 2 ranks**: the rows of ``benchmarks/results/wire.jsonl`` (CPU seconds per step,
   median of rank 0 and rank 2 over the window).
   Both against the ``cpu`` row of the model's table, which holds this machine's rates measured by
   ``benchmarks/hardware.py`` per CPU-second: a prediction is the CPU time one rank spends per step.
3. **optimum-habana's published Gaudi figures** (:data:`PUBLISHED`): samples/s of GPT2-XL and GPT-NeoX-20B trained
   with DeepSpeed ZeRO-2 on 8 cards, against the model at the devices' peak FLOP/s, and with the efficiency (the
   fraction of the peak reached) that the *other* model's published figure implies.

Goal: within 25% (predicted ÷ measured in 0.75-1.25); where a figure is off by more, the table says why.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for path in (str(HERE), str(REPO)):
    if path not in sys.path:
        sys.path.insert(0, path)

import publish  # noqa: E402
from cases import ARMS as BENCH_ARMS  # noqa: E402
from flags import existing_path  # noqa: E402

from lightning_gaudi_ds.planning.steptime import (  # noqa: E402
    HARDWARE,
    Workload,
    step_time,
    transformer_flops_per_sample,
)

RESULTS = HERE / "results"
GOAL = 0.25

#: optimum-habana (huggingface/optimum-habana, main at 1d8504c, its last release line 1.21): the baselines its CI holds
#: each example to, tests/baselines/fixture/tests/test_examples.json, keys
#: DeepspeedCausalLanguageModelingExampleTester::test_run_clm_gpt2-xl_deepspeed and ...gpt-neox-20b_deepspeed ("gaudi2"
#: and "gaudi3" entries,
#: train_samples_per_second, the first 3 steps left out: --throughput_warmup_steps 3 in tests/test_examples.py, lazy
#: mode). The runs: examples/language-modeling/run_clm.py on
#: wikitext-2 (tests/configs/examples/gpt2_xl.json, gpt_neox_20b.json: per-device batch 16 and 2,
#: --gradient_checkpointing, --deepspeed tests/configs/deepspeed_zero_2.json: bf16, ZeRO-2 with overlap_comm,
#: reduce_scatter and contiguous_gradients off), 8 cards (tests/test_examples.py: gaudi_spawn.py --world_size 8),
#: block size 1024 (run_clm's default: the tokenizer's maximum, capped at 1024 when it exceeds the model's positions).
#: Parameters: GPT2-XL 1,557,611,200 (48 layers, hidden 1600); GPT-NeoX-20B 20,554,567,680 (44 layers, hidden 6144).
PUBLISHED: tuple[dict[str, Any], ...] = (
    {"model": "GPT2-XL", "params": 1_557_611_200, "layers": 48, "hidden": 1600, "micro_batch": 16,
     "published": {"gaudi2": 96.789, "gaudi3": 147.801}},
    {"model": "GPT-NeoX-20B", "params": 20_554_567_680, "layers": 44, "hidden": 6144, "micro_batch": 2,
     "published": {"gaudi2": 7.328, "gaudi3": 11.704}},
)
SEQ_LEN, CARDS, SOURCE = 1024, 8, "optimum-habana tests/baselines/fixture/tests/test_examples.json"

# benchmark arm -> (stage, step_time keyword arguments)
SPEED_ARMS: dict[str, tuple[int | None, dict[str, Any]]] = {
    "ddp": (None, {"fused_optimizer": False}),  # Lightning DDP's AdamW: torch's per-tensor step on CPU
    "ddp_fused": (None, {}),
    "z0": (0, {}), "z1": (1, {}), "z2": (2, {}),
    "z3": (3, {"backward_allgather": False}),  # the speed rows keep DeepSpeed's defaults: gathered once
    "z2_offload": (2, {"offload_optimizer": True}),
    "z3_offload": (3, {"offload_optimizer": True, "offload_parameters": True, "backward_allgather": False}),
}
WIRE_ARMS: dict[str, tuple[int | None, dict[str, Any]]] = {
    "ddp": (None, {"fused_optimizer": False}), "z1": (1, {}), "z2": (2, {}), "z3": (3, {}),
    "z3_hpz": (3, {"hpz": True}), "z2_offload": (2, {"offload_optimizer": True}),
    "z3_offload": (3, {"offload_optimizer": True, "offload_parameters": True}),
    "z3_kept": (3, {"backward_allgather": False}),
}


def bench_workload(hidden: int, layers: int, batch: int, precision: str = "bf16-mixed") -> Workload:
    """The benchmarks' model: ``layers`` x Linear(hidden, hidden), 6 FLOPs per weight per sample; its biases are
    ZeRO-3's persistent parameters (below 10 x hidden)."""
    return Workload(layers * (hidden * hidden + hidden), 6 * layers * hidden * hidden, batch, precision,
                    persistent_params=layers * hidden)


def verdict(ratio: float) -> str:
    return "✓" if abs(ratio - 1) <= GOAL else "✗"


def cpu_rows(kind: str, rows: list[dict[str, Any]], workload: Workload, devices: int, nodes: int,
             arms: dict[str, tuple[int | None, dict[str, Any]]], measured_key: str) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        if r.get("arm") not in arms or r.get(measured_key) is None:
            continue
        stage, options = arms[r["arm"]]
        predicted = step_time(workload, "cpu", stage, devices=devices, nodes=nodes, **options)
        measured = r[measured_key]
        label = r.get("label") or (BENCH_ARMS[r["arm"]].label if r["arm"] in BENCH_ARMS else predicted.configuration)
        out.append({"type": kind, "arm": r["arm"], "label": label,
                    "measured_cpu_s": measured, "predicted_cpu_s": predicted.seconds,
                    "ratio": predicted.seconds / measured,
                    **{f"predicted_{k}": v for k, v in predicted.to_dict().items()
                       if k in ("compute", "communication", "optimizer")}})
    return out


def published_rows() -> list[dict[str, Any]]:
    out = []
    for hw in ("gaudi2", "gaudi3"):
        predictions = {}
        for entry in PUBLISHED:
            flops = transformer_flops_per_sample(entry["params"], entry["layers"], entry["hidden"], SEQ_LEN,
                                                 activation_checkpointing=True)
            predictions[entry["model"]] = Workload(entry["params"], flops, entry["micro_batch"])
        # Habana's ZeRO-2 all-reduces (reduce_scatter false in its config): the HPU default here too
        peak = {m: step_time(w, hw, 2, devices=CARDS, reduce_to_owner=False) for m, w in predictions.items()}
        for entry in PUBLISHED:
            model, published = entry["model"], entry["published"][hw]
            other = next(e for e in PUBLISHED if e is not entry)
            # the efficiency the other model's published figure implies: compute / (its step - the rest)
            o = peak[other["model"]]
            step = other["micro_batch"] * CARDS / other["published"][hw]
            efficiency = o.compute / (step - o.communication - o.optimizer)
            calibrated = step_time(predictions[model], hw, 2, devices=CARDS, reduce_to_owner=False,
                                   efficiency=min(1.0, efficiency))
            p = peak[model]
            out.append({"type": "published", "model": model, "hardware": hw, "cards": CARDS, "published": published,
                        "predicted_at_peak": p.samples_per_second, "ratio_at_peak": p.samples_per_second / published,
                        "implied_efficiency": p.compute / (entry["micro_batch"] * CARDS / published - p.communication
                                                           - p.optimizer),
                        "efficiency_from_other": efficiency, "predicted_calibrated": calibrated.samples_per_second,
                        "ratio_calibrated": calibrated.samples_per_second / published,
                        "compute_s": p.compute, "communication_s": p.communication, "optimizer_s": p.optimizer})
    return out


def markdown(speed: list[dict[str, Any]], wire: list[dict[str, Any]], published: list[dict[str, Any]],
             notes: dict[str, str]) -> tuple[str, str]:
    """(the full tables, the README's published table)."""
    lines = [f"This machine's rates ({notes['cpu']}): `cpu` row of `lightning_gaudi_ds/planning/steptime.py`, from"
             " `benchmarks/results/hardware.json`. Predicted and measured: CPU seconds one rank spends per step.", ""]
    for title, rows in ((f"2 ranks on one host ({notes['speed']})", speed),
                        (f"2 hosts x 2 ranks ({notes['wire']})", wire)):
        lines += [f"**{title}**", "", "| configuration | measured CPU s/step | predicted | compute | communication |"
                  " optimizer | predicted ÷ measured |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['label']} | {r['measured_cpu_s']:.3f} | {r['predicted_cpu_s']:.3f} |"
                         f" {r['predicted_compute']:.3f} | {r['predicted_communication']:.3f} |"
                         f" {r['predicted_optimizer']:.3f} | {r['ratio']:.2f} {verdict(r['ratio'])} |")
        lines.append("")
    readme = ["| model (ZeRO-2, bf16) | cards | published samples/s | predicted at peak | ratio | predicted, efficiency"
              " of the other model | ratio |", "|---|---|---|---|---|---|---|"]
    for r in published:
        readme.append(f"| {r['model']} | {r['cards']} x {HARDWARE[r['hardware']].name.split(' (')[0]} |"
                      f" {r['published']:.2f} | {r['predicted_at_peak']:.1f} | {r['ratio_at_peak']:.2f} |"
                      f" {r['predicted_calibrated']:.2f} ({r['efficiency_from_other']:.0%} of peak) |"
                      f" {r['ratio_calibrated']:.2f} {verdict(r['ratio_calibrated'])} |")
    lines += [f"**optimum-habana's published figures** ({SOURCE}; predicted ÷ published)", "", *readme, "",
              "| model | device | compute s/step at peak | communication | optimizer | efficiency the figure implies |",
              "|---|---|---|---|---|---|"]
    for r in published:
        lines.append(f"| {r['model']} | {r['hardware']} | {r['compute_s']:.3f} | {r['communication_s']:.3f} |"
                     f" {r['optimizer_s']:.3f} | {r['implied_efficiency']:.0%} |")
    return "\n".join(lines) + "\n", "\n".join(readme) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed", type=existing_path, default=RESULTS / "speed_this_cpu" / "results.jsonl",
                        help="2-rank speed rows measured on this machine (run_all.py --only speed)")
    parser.add_argument("--wire", type=existing_path, default=RESULTS / "wire.jsonl", help="the wire benchmark's rows")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default benchmarks/results)")
    parser.add_argument("--no-readme", action="store_true", help="leave README.md and benchmarks/README.md alone")
    args = parser.parse_args(argv)
    for path in (args.speed, args.wire, RESULTS / "hardware.json"):
        if not path.exists():
            parser.error(f"{path} does not exist: run the benchmark that writes it first")
    hardware = json.loads((RESULTS / "hardware.json").read_text())
    speed_lines = [json.loads(line) for line in args.speed.read_text().splitlines()]
    speed_meta = speed_lines[0]
    s = speed_meta["settings"]
    speed_rows = [{**r, "measured": r["trainer_cpu_median_s"]} for r in speed_lines if r.get("type") == "speed"]
    speed = cpu_rows("cpu_2_ranks", speed_rows, bench_workload(s["hidden"], s["main_layers"], s["batch_size"]),
                     s["world_size"], 1, SPEED_ARMS, "measured")
    wire_lines = [json.loads(line) for line in args.wire.read_text().splitlines()]
    wm = wire_lines[0]
    wire_rows = [{**r, "measured": statistics.median(r["step_cpu_seconds"])} for r in wire_lines[1:]
                 if r.get("step_cpu_seconds")]
    wire = cpu_rows("cpu_2x2_ranks", wire_rows, bench_workload(wm["hidden"], wm["layers"], wm["batch_size"]),
                    wm["ranks_per_host"], wm["hosts"], WIRE_ARMS, "measured")
    published = published_rows()
    notes = {"cpu": f"{hardware['meta']['cpu']}, {hardware['meta']['date']}",
             "speed": f"`{args.speed.relative_to(REPO) if args.speed.is_relative_to(REPO) else args.speed}`,"
                      f" {speed_meta['date']}, Ψ = {s['main_layers']} x {s['hidden']}²",
             "wire": f"`benchmarks/results/wire.jsonl`, {wm['date']}, Ψ = {wm['layers']} x {wm['hidden']}²"}
    full, readme = markdown(speed, wire, published, notes)
    readmes = [] if args.no_readme else [
        (HERE / "README.md", publish_section(HERE / "README.md", "steptime", full)),
        (REPO / "docs" / "benchmarks.md", publish_section(REPO / "docs" / "benchmarks.md", "steptime", full)),
        (REPO / "README.md", publish_section(REPO / "README.md", "steptime", readme)),
    ]
    with publish.staged(args.out) as stage:
        rows = [{"type": "meta", "hardware": hardware["meta"], **notes}, *speed, *wire, *published]
        (stage.path / "steptime.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (stage.path / "steptime.md").write_text("# The step-time model against measured runs\n\n" + full)
    for path, text in readmes:
        publish.write_text(path, text)
    print(full)
    return 0


def publish_section(path: Path, tag: str, body: str) -> str:
    from wire import replace_section

    return replace_section(path, tag, body)


if __name__ == "__main__":
    sys.exit(main())
