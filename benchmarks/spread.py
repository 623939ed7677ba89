"""Do two runs of the speed benchmark agree? Each speed ratio of two ``results.jsonl`` side by side, per arm.

    python benchmarks/run_all.py                                        # run 1 -> benchmarks/results
    python benchmarks/run_all.py --only speed --out /tmp/run2 --no-readme   # run 2, the same command's speed part
    python benchmarks/spread.py benchmarks/results /tmp/run2 --write benchmarks/results/spread.md
    python benchmarks/spread.py RUN1 RUN2 --flipped     # two runs with --flipped-speed: CPU defaults switched

The ratios compared are the ones the README reports: rank 0's CPU time of the Trainer ÷ the hand-written loop
(``cpu_overhead``) and samples per CPU-second ÷ Lightning DDP (``cpu_vs_ddp``) and ÷ DDP with AdamW(fused=True)
(``cpu_vs_ddp_fused``), medians over the rounds. The
difference is |a - b| / min(a, b). Exit status 1 when a ratio differs by more than ``--tolerance`` (default 10%).
Wall-clock samples/s ÷ DDP is shown beside them, not judged: on a shared machine it is noise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

import publish
from cases import ARMS, FLIPPED
from flags import existing_path, fraction

JUDGED = (("cpu_overhead", "CPU time Trainer ÷ raw"), ("cpu_vs_ddp", "samples per CPU-s ÷ DDP"),
          ("cpu_vs_ddp_fused", "samples per CPU-s ÷ DDP with AdamW(fused=True)"))


def speed_rows(path: Path) -> dict[str, dict[str, Any]]:
    file = path / "results.jsonl" if path.is_dir() else path
    rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    return {r["arm"]: r for r in rows if r.get("type") == "speed" and r.get("ok")}


def differ(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if not a or not b:
        return None
    return abs(a - b) / min(a, b)


def compare(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]], tolerance: float) -> tuple[list[str], int]:
    head = "| arm | " + " | ".join(f"{label}: run 1 / run 2 | differ" for _, label in JUDGED)
    lines = [head + " | wall samples/s ÷ DDP: run 1 / run 2 |", "|---" * (2 * len(JUDGED) + 2) + "|"]
    worst, outside = 0.0, 0
    for arm in ARMS:
        if arm not in a or arm not in b:
            continue
        cells = [ARMS[arm].label]
        for key, _ in JUDGED:
            x, y = a[arm].get(key), b[arm].get(key)
            d = differ(x, y)
            if d is None:
                cells += ["–", "–"]
                continue
            worst = max(worst, d)
            outside += d > tolerance
            cells += [f"{x:.3f} / {y:.3f}", f"{100 * d:.1f}%" + (" ✗" if d > tolerance else "")]
        wa, wb = a[arm].get("vs_ddp"), b[arm].get("vs_ddp")
        cells.append(f"{wa:.2f} / {wb:.2f}" if wa and wb else "–")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Largest difference {100 * worst:.1f}%; {outside} ratio(s) differ by more than {100 * tolerance:.0f}%.")
    return lines, outside


def flipped_table(runs: list[dict[str, dict[str, Any]]]) -> list[str]:
    """Per run: the switched arm's CPU time per Trainer step ÷ the default arm's (below 1: the switch is faster)."""
    lines = ["| switched | default | " + " | ".join(f"run {i + 1}: CPU ms/step switched / default, ratio"
                                                   for i in range(len(runs))) + " |",
             "|---|---|" + "---|" * len(runs)]
    for arm, default in FLIPPED.items():
        cells = [ARMS[arm].label, ARMS[default].label]
        for rows in runs:
            a, d = rows.get(arm, {}).get("trainer_cpu_median_s"), rows.get(default, {}).get("trainer_cpu_median_s")
            cells.append(f"{1e3 * a:.0f} / {1e3 * d:.0f}, {a / d:.3f}" if a and d else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run1", type=existing_path, help="a results folder or results.jsonl")
    parser.add_argument("run2", type=existing_path)
    parser.add_argument("--tolerance", type=fraction, default=0.10)
    parser.add_argument("--write", type=Path, help="also write the table (markdown) here")
    parser.add_argument("--flipped", action="store_true",
                        help="compare each switched CPU default with the default, per run, instead")
    args = parser.parse_args(argv)
    a, b = speed_rows(args.run1), speed_rows(args.run2)
    if not a or not b:
        print(f"no speed rows in {args.run1 if not a else args.run2}", file=sys.stderr)
        return 2
    if args.flipped:
        lines, outside = flipped_table([a, b]), 0
    else:
        lines, outside = compare(a, b, args.tolerance)
    text = "\n".join(lines)
    print(text)
    if args.write:
        publish.write_text(args.write, f"Run 1: {args.run1}; run 2: {args.run2}.\n\n{text}\n")
    return 1 if outside else 0


if __name__ == "__main__":
    sys.exit(main())
