"""Throughput of the example recipes: every ``examples/configs/*.yaml`` trained for the same number of steps.

    python benchmarks/recipes.py                 # 5 recipes x 300 steps, ~8 minutes on 2 cores
    python benchmarks/recipes.py --steps 100 --only zero2_bf16 zero3_bf16

Each recipe runs as a user runs it (``python examples/train_lm.py fit --config <yaml>``: Lightning's launcher,
2 processes, the YAML's model and batch), with ``--trainer.max_steps`` set to ``--steps``, one validation at the
end, no checkpoint and no sample. The figures are the example's own summary: samples/s and tokens/s of all
processes over the training steps after the first (validation excluded), the final train and validation loss,
and the end-to-end time of the command (start-up included). Results: ``results/recipes.{jsonl,md}``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import publish
from flags import positive_float, positive_int
from launch import REPO, run_one

CONFIGS = REPO / "examples" / "configs"
RESULTS = Path(__file__).resolve().parent / "results"
ORDER = ("zero1_bf16", "zero2_bf16", "zero3_bf16", "zero2_offload_bf16", "zero3_offload_bf16")


def summary_fields(log: str) -> dict[str, Any]:
    """The numbers of train_lm's summary lines (``throughput:``, ``loss:``, ``run:``)."""
    out: dict[str, Any] = {}
    if m := re.search(r"^throughput: ([\d,.]+) samples/s, ([\d,.]+) tokens/s \(all processes; (\d+) steps in ([\d.]+) s",
                      log, re.M):
        out.update(samples_per_s=float(m[1].replace(",", "")), tokens_per_s=float(m[2].replace(",", "")),
                   timed_steps=int(m[3]), train_seconds=float(m[4]))
    if m := re.search(r"^loss:\s+train ([\d.]+) -> ([\d.]+)(?:, val ([\d.]+))?", log, re.M):
        out.update(first_loss=float(m[1]), last_loss=float(m[2]), val_loss=float(m[3]) if m[3] else None)
    if m := re.search(r"^run:\s+(\d+) steps on (\d+) x (\w+), \w+(?: \(ZeRO stage (\d)\))?", log, re.M):
        out.update(steps=int(m[1]), processes=int(m[2]), device=m[3], stage=int(m[4]) if m[4] else None)
    return out


def recipe_shape(name: str) -> dict[str, Any]:
    """The model and batch a YAML trains (LitGPT's and TextDataModule's defaults where the YAML is silent)."""
    import yaml

    config = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    model, data = config.get("model") or {}, config.get("data") or {}
    return {"n_layer": model.get("n_layer", 4), "n_embd": model.get("n_embd", 128), "lr": model.get("lr", 3e-3),
            "batch_size": data.get("batch_size", 16), "block_size": data.get("block_size", 128)}


def run_recipe(name: str, steps: int, work: Path, timeout: float) -> dict[str, Any]:
    log = work / f"{name}.log"
    cmd = [sys.executable, str(REPO / "examples" / "train_lm.py"), "fit", "--config", str(CONFIGS / f"{name}.yaml"),
           "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(steps),
           "--save_checkpoint", "false", "--report.sample_tokens", "0", "--trainer.enable_progress_bar", "false",
           "--trainer.default_root_dir", str(work / name)]
    res = run_one(cmd, log, timeout, env={"OMP_NUM_THREADS": "1"})
    text = log.read_text(errors="replace")
    row: dict[str, Any] = {"recipe": name, "ok": res.ok, "wall_s": round(res.seconds, 1), **recipe_shape(name),
                           **summary_fields(text)}
    if not res.ok or "samples_per_s" not in row:
        row["ok"], row["error"] = False, text[-600:]
    return row


def table(rows: list[dict[str, Any]], steps: int) -> str:
    lines = ["| recipe (examples/configs) | ZeRO | model: layers × width | batch per process × bytes | samples/s |"
             " tokens/s | train loss (first → last) | val loss | end to end |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['recipe']}.yaml | failed: {r.get('error', '')[-80:]!r} ||||||||")
            continue
        val = f"{r['val_loss']:.3f}" if r.get("val_loss") is not None else "–"
        shape = {**recipe_shape(r["recipe"]), **r}
        lines.append(f"| {r['recipe']}.yaml | {r.get('stage', '–')} | {shape['n_layer']} × {shape['n_embd']} |"
                     f" {shape['batch_size']} × {shape['block_size']} | {r['samples_per_s']:,.1f} |"
                     f" {r['tokens_per_s']:,.0f} | {r['first_loss']:.2f} → {r['last_loss']:.2f} | {val} |"
                     f" {r['wall_s']:.0f} s |")
    lines.append("")
    lines.append(f"{steps} steps per recipe, 2 processes (all processes' samples and tokens per second over steps 2-{steps},"
                 " validation excluded); end to end: the command's wall time, start-up and the final validation"
                 " included.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive_int, default=300)
    parser.add_argument("--only", nargs="+", choices=ORDER, help="these recipes only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--timeout", type=positive_float, default=900, help="per recipe (s)")
    parser.add_argument("--report-only", dest="report_only", action="store_true",
                        help="rebuild recipes.md from the last recipes.jsonl")
    args = parser.parse_args(argv)
    if args.report_only:
        if not (args.out / "recipes.jsonl").is_file():
            parser.error(f"--report-only: no recipes.jsonl in {args.out} to report; run recipes.py first, or pass"
                         " --out with the folder of an earlier run")
        meta, *rows = [json.loads(line) for line in (args.out / "recipes.jsonl").read_text().splitlines()]
        text = f"Run {meta['started']}.\n\n" + table(rows, meta["steps"]) + "\n"
        publish.write_text(args.out / "recipes.md", text)
        print(text)
        return 0
    names = [n for n in ORDER if not args.only or n in args.only]
    rows = []
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    with tempfile.TemporaryDirectory(prefix="recipes-") as tmp:
        for name in names:
            row = run_recipe(name, args.steps, Path(tmp), args.timeout)
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = {"type": "meta", "started": started, "steps": args.steps}
    text = f"Run {started}.\n\n" + table(rows, args.steps) + "\n"
    print(text)
    with publish.staged(args.out) as stage:
        (stage.path / "recipes.jsonl").write_text("\n".join(json.dumps(r) for r in [meta, *rows]) + "\n")
        (stage.path / "recipes.md").write_text(text)
        failed = [r["recipe"] for r in rows if not r["ok"]]
        if failed:
            stage.discard(f"recipe(s) failed: {', '.join(failed)}", keep=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
