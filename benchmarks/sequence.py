"""The longest sequence that trains with sequence parallelism, K = 1, 2 and 4 ranks per sequence, under a memory cap
per rank (issue 40); tokens/s against K = 1 at one length; activation bytes per token against the planner's.

Every rank's training runs in its own memory cgroup with a hard limit, as in ``capacity.py`` (whose cgroups, search
and fork-from-a-warm-parent trials this reuses): a sequence that does not fit is OOM-killed by the kernel. The model
is a small Llama (random init, transformers' ``LlamaForCausalLM``, sdpa attention, grouped-query heads) trained at
ZeRO-3 on the same ``--world`` ranks for every K, so that the model states per rank are the same and only the
activations differ: K = 1 trains ``world`` sequences at once, each on one rank; K = 4 one sequence on four ranks.

For each K: a trial at ``--granularity`` tokens (the fixed cost), then the search for the longest length (a multiple
of ``--granularity``) that completes ``--steps`` optimizer steps, starting from the planner's guess. Then, at one
length (``--speed-length``; default: the longest that K = 1 trains), each K times ``--speed-steps`` steps after a
warm-up (under twice the cap), side by side in the same run: tokens/s of all ranks together, and its ratio to
K = 1. Activation bytes per token per rank: measured as the slope of the ranks' peak memory between the fixed-cost
trial and the longest, and
planned as :func:`~lightning_gaudi_ds.planning.activations.measure_activation_bytes` of the whole micro batch on one
process (the slope between two lengths) split K ways (``plan_memory(sequence_parallel_size=K)``).

    python benchmarks/sequence.py                                      # world 4, K = 1 2 4, cap 190 MiB
    python benchmarks/sequence.py --world 2 --sizes 1 2 --cap 500MiB --out /tmp/seq
    python benchmarks/sequence.py --report-only                        # table from the last results

Writes ``<out>/sequence.jsonl`` (a ``meta`` line, one row per K with its trials, the planner's measurement),
``sequence.md``; a run that fails writes nothing there (``publish.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for path in (str(HERE), str(REPO)):
    if path not in sys.path:
        sys.path.insert(0, path)

import publish  # noqa: E402
from capacity import Search, agree, check_cgroups, run_capped  # noqa: E402
from flags import fraction, positive_float, positive_int, size  # noqa: E402

from lightning_gaudi_ds.planning.units import format_bytes  # noqa: E402

RESULTS = HERE / "results" / "sequence"
# Imported by the rank parent before it forks the trials (besides worker.PRELOAD): transformers' Llama and what its
# forward and loss import, DeepSpeed's Ulysses layer (and einops, which it imports).
PRELOAD = ("transformers", "transformers.models.llama.modeling_llama", "transformers.masking_utils",
           "transformers.integrations.sdpa_attention", "transformers.loss.loss_utils", "deepspeed.sequence.layer",
           "einops")
EXIT_NO_CGROUP = 3


@dataclass
class Settings:
    world: int = 4
    sizes: tuple[int, ...] = (1, 2, 4)
    cap: int = 190 * 2**20
    hidden: int = 128
    layers: int = 2
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 344
    vocab: int = 512
    precision: str = "32-true"  # bf16 matmuls run several times slower than fp32 on CPUs without bf16 units
    stage: int = 3
    steps: int = 2
    granularity: int = 256
    max_length: int = 2**17
    tolerance: float = 0.05
    trial_timeout: float = 600.0
    speed_length: int = 0  # 0: the longest K = 1 trains
    speed_warmup: int = 1
    speed_steps: int = 3
    speed_rounds: int = 2  # the K values timed in turn, this many times: the machine's load falls on each alike
    mmap_threshold: int = 64 * 2**10  # freed tensors leave the process at once: peaks measure what is held


# ------------------------------------------------------------------------------------------- the model
def llama_config(s: Settings) -> Any:
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                         num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                         max_position_embeddings=s.max_length, use_cache=False)
    config._attn_implementation = "sdpa"
    return config


def make_module(s: Settings) -> Any:
    import lightning as L
    import torch

    class LongLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: Any = None
            self.step_times: list[float] = []

        def configure_model(self) -> None:
            if self.model is None:
                from transformers import LlamaForCausalLM

                torch.manual_seed(0)
                self.model = LlamaForCausalLM(llama_config(s))

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss

        def on_train_batch_end(self, *args: Any) -> None:
            self.step_times.append(time.perf_counter())

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return LongLM()


def batches(s: Settings, length: int, count: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, s.vocab, (count, length), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


# ------------------------------------------------------------------------------------------- one trial
def train_trial(s: Settings, k: int, length: int, rank: int, store: Path, steps: int) -> dict[str, Any]:
    """Inside the capped child: ``steps`` optimizer steps at ``length`` tokens, K = ``k``; the steps' times."""
    import logging
    import warnings
    from datetime import timedelta

    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from lightning_gaudi_ds import HPUDeepSpeedStrategy

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "DeepSpeed", "deepspeed", "torch",
                 "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=s.world,
                            timeout=timedelta(seconds=s.trial_timeout))
    module = make_module(s)
    trainer = L.Trainer(accelerator="cpu", devices=s.world, precision=s.precision, max_steps=steps,
                        strategy=HPUDeepSpeedStrategy(stage=s.stage, sequence_parallel_size=k),
                        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(store.parent / "root"))
    loader = DataLoader(batches(s, length, s.world // k * steps), batch_size=1)
    start = time.perf_counter()
    trainer.fit(module, loader)
    if trainer.global_step != steps:
        raise RuntimeError(f"trained {trainer.global_step} steps, not {steps}")
    times = [start, *module.step_times]
    return {"step_seconds": [b - a for a, b in zip(times, times[1:], strict=False)]}


def trial(s: Settings, k: int, length: int, rank: int, work: Path, tag: str, steps: int,
          cap: int | None = None) -> list[dict[str, Any]]:
    """Every rank's outcome of one capped trial (each rank runs it, then waits for the others)."""
    run_capped(lambda: train_trial(s, k, length, rank, work / "rdv" / tag, steps), cap=cap or s.cap, rank=rank,
               work=work,
               tag=tag, timeout=s.trial_timeout, mmap_threshold=s.mmap_threshold, extra={"k": k, "length": length})
    return agree(work, tag, s.world, s.trial_timeout + 120)


# ------------------------------------------------------------------------------------------- the planner
def planner_per_token(s: Settings) -> dict[str, Any]:
    """Activation bytes per token of one micro batch on one process (the slope between two lengths, so that fixed
    costs cancel), as the planner measures them (``measure_activation_bytes``)."""
    import torch
    from transformers import LlamaForCausalLM

    from lightning_gaudi_ds.planning.activations import measure_activation_bytes

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(s))
    lengths = (2 * s.granularity, 6 * s.granularity)
    measured = []
    for length in lengths:
        ids = torch.randint(0, s.vocab, (1, length))
        measured.append(measure_activation_bytes(model, {"input_ids": ids, "labels": ids}, s.precision, "cpu"))
    return {"lengths": list(lengths), "bytes": measured,
            "bytes_per_token": (measured[1] - measured[0]) / (lengths[1] - lengths[0])}


# ------------------------------------------------------------------------------------------- the search
def search_rank(s: Settings, rank: int, work: Path, plan: dict[str, Any]) -> int:
    """What every rank process runs: the same trials in the same order; rank 0 writes the rows."""
    rows = []
    for k in s.sizes:
        t0 = time.monotonic()
        base = trial(s, k, s.granularity, rank, work, f"k{k}-base", s.steps)
        base_ok = all(r["outcome"] == "ok" for r in base)
        baseline = max(r["peak_bytes"] or 0 for r in base) if base_ok else None
        per_token = plan["bytes_per_token"] / k  # the planner's, per rank
        guess = int(((0.9 * s.cap - (baseline or 0)) / per_token) // s.granularity) if baseline else 1
        search = Search(max(1, guess), s.max_length // s.granularity, s.tolerance)
        trials, errors = [], []
        while base_ok and (units := search.next()) is not None:
            length = units * s.granularity
            results = trial(s, k, length, rank, work, f"k{k}-l{length}", s.steps)
            ok = all(r["outcome"] == "ok" for r in results)
            if any(r["outcome"] == "oom" for r in results):
                for r in results:
                    r["outcome"] = "peer" if r["outcome"] == "error" else r["outcome"]
            outcomes = sorted({r["outcome"] for r in results})
            errors += [r["error"] for r in results if r["outcome"] == "error" and "error" in r]
            peak = max(r["peak_bytes"] or 0 for r in results)
            trials.append({"length": length, "ok": ok, "outcomes": outcomes, "peak_bytes": peak,
                           "seconds": max(r["seconds"] for r in results)})
            if rank == 0:
                print(f"K={k}: {length} tokens -> {'/'.join(outcomes)}, peak {format_bytes(peak)},"
                      f" {trials[-1]['seconds']}s", flush=True)
            search.record(units, ok)
            if "error" in outcomes and not ok:
                break
        if not base_ok:
            errors += [r.get("error", r["outcome"]) for r in base if r["outcome"] != "ok"]
        rows.append({"type": "sequence", "k": k, "world_size": s.world, "longest": search.lo * s.granularity,
                     "first_failing": search.hi * s.granularity if search.hi else None,
                     "at_search_limit": search.hi is None, "baseline_peak_bytes": baseline,
                     "planner_bytes_per_token": per_token, "planner_guess": guess * s.granularity,
                     "trials": trials, "errors": errors[:2], "seconds": round(time.monotonic() - t0, 1)})
    longest_one = next((r["longest"] for r in rows if r["k"] == 1), 0)
    speed_length = s.speed_length or longest_one
    steps: dict[int, list[float]] = {row["k"]: [] for row in rows}
    for turn in range(s.speed_rounds if speed_length else 0):
        for row in rows:
            # twice the cap: at K = 1's longest length, K = 1 would otherwise run against the limit (reclaim)
            results = trial(s, row["k"], speed_length, rank, work, f"k{row['k']}-speed{turn}",
                            s.speed_warmup + s.speed_steps, cap=2 * s.cap)
            if all(r["outcome"] == "ok" for r in results):
                # each measured step: the slowest rank's
                timed = [r["value"]["step_seconds"][s.speed_warmup:] for r in results]
                steps[row["k"]] += [max(t) for t in zip(*timed, strict=True)]
            else:
                row["speed_outcomes"] = sorted({r["outcome"] for r in results})
    for row in rows:
        row["speed_length"] = speed_length
        if steps[row["k"]] and "speed_outcomes" not in row:
            row["step_seconds"] = sorted(steps[row["k"]])[len(steps[row["k"]]) // 2]  # the median
            row["tokens_per_second"] = (s.world // row["k"]) * speed_length / row["step_seconds"]
    if rank == 0:
        (work / "rows.json").write_text(json.dumps(rows))
    return 0


# ------------------------------------------------------------------------------------------- report
def derive(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    one = next((r for r in rows if r["k"] == 1), None)
    for r in rows:
        r["longest_vs_k1"] = r["longest"] / one["longest"] if one and one["longest"] else None
        speed = one.get("tokens_per_second") if one else None
        r["speed_vs_k1"] = r["tokens_per_second"] / speed if speed and r.get("tokens_per_second") else None
        ok = [t for t in r["trials"] if t["ok"] and t["length"] == r["longest"]]
        base = r.get("baseline_peak_bytes")
        longest = r["longest"]
        r["measured_bytes_per_token"] = ((ok[0]["peak_bytes"] - base) / (longest - r["granularity"])
                                         if ok and base and longest > r["granularity"] else None)
        r["planner_error"] = (r["planner_bytes_per_token"] / r["measured_bytes_per_token"] - 1
                              if r["measured_bytes_per_token"] else None)
    return rows


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def write_report(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> str:
    for r in rows:
        r.setdefault("granularity", meta["granularity"])
    rows = derive(rows)
    head = ["K (ranks per sequence)", "sequences at once", "longest that trains (tokens)", "first failing",
            "÷ K = 1", "tokens/s at the same length", "÷ K = 1 ", "activation bytes/token/rank measured",
            "planner's", "planner ÷ measured − 1", "peak with the longest", "peak at the fixed-cost length"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ok = [t for t in r["trials"] if t["ok"] and t["length"] == r["longest"]]
        longest = f"{r['longest']:,}" + (" (search limit)" if r["at_search_limit"] else "")
        if r["errors"]:
            longest += " ✗ error: " + str(r["errors"][0]).splitlines()[0][:100].replace("|", "/")
        lines.append("| " + " | ".join([
            str(r["k"]), str(r["world_size"] // r["k"]), longest,
            f"{r['first_failing']:,}" if r["first_failing"] else "–", _fmt(r["longest_vs_k1"]),
            _fmt(r.get("tokens_per_second"), ",.0f"), _fmt(r["speed_vs_k1"]),
            _fmt(r["measured_bytes_per_token"], ",.0f"), _fmt(r["planner_bytes_per_token"], ",.0f"),
            _fmt(r["planner_error"], "+.1%"), format_bytes(ok[0]["peak_bytes"]) if ok else "–",
            format_bytes(r["baseline_peak_bytes"]) if r["baseline_peak_bytes"] else "–"]) + " |")
    plan = meta["planner"]
    text = "\n".join([
        f"Cap {format_bytes(meta['cap'])} per rank (memory cgroup, swap off), {meta['world']} ranks on gloo, ZeRO-"
        f"{meta['stage']}, {meta['precision']}, AdamW; a random-init Llama (transformers' LlamaForCausalLM, sdpa):"
        f" hidden {meta['hidden']}, {meta['layers']} layers, {meta['heads']} heads ({meta['kv_heads']} key-value),"
        f" MLP {meta['intermediate']}, vocabulary {meta['vocab']}; micro batch 1, {meta['steps']} optimizer steps per"
        f" trial, lengths in steps of {meta['granularity']} tokens, search tolerance {meta['tolerance']:.0%}; tokens/s"
        f" at {rows[0].get('speed_length') or 0:,} tokens, under twice the cap (no rank against its limit): the"
        f" median of {meta['speed_rounds']} x {meta['speed_steps']} steps after {meta['speed_warmup']} (each the"
        " slowest rank's; the K values timed in turn), all ranks' tokens."
        f" Planner: measure_activation_bytes of one sequence on one process, the slope between {plan['lengths'][0]:,}"
        f" and {plan['lengths'][1]:,} tokens ({plan['bytes_per_token']:,.0f} B/token), split K ways as"
        f" plan_memory(sequence_parallel_size=K) does; measured: the slope of the ranks' peak between the"
        f" {meta['granularity']}-token trial and the longest. {meta['seconds']:.0f} s in all on {meta['machine']}.",
        "", *lines, "", *goal_lines(rows), ""])
    (out / "sequence.md").write_text(text)
    return text


def goal_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for r in rows:
        if r["k"] == 2 and r["longest_vs_k1"] is not None:
            lines.append(f"- K = 2 trains sequences {r['longest_vs_k1']:.2f}x as long as K = 1 under the same cap"
                         f" (goal >= 1.8) {'✓' if r['longest_vs_k1'] >= 1.8 else '✗'}")
    errs = [abs(r["planner_error"]) for r in rows if r["planner_error"] is not None]
    if errs:
        within = sum(e <= 0.2 for e in errs)
        lines.append(f"- Planner's activation bytes per token within 20% of the measured slope: {within} of"
                     f" {len(errs)} (largest error {max(errs):.1%}) {'✓' if max(errs) <= 0.2 else '✗'}")
    return lines


def update_readme(text: str, readme: Path) -> None:
    publish.replace_section(readme, "sequence", text)


# ------------------------------------------------------------------------------------------- driver
def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Settings]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=positive_int, default=4, help="ranks (default 4)")
    p.add_argument("--sizes", type=positive_int, nargs="+", default=[1, 2, 4], help="K values (default: 1 2 4)")
    p.add_argument("--cap", type=size, default="190MiB", help="memory per rank (default 190MiB)")
    p.add_argument("--hidden", type=positive_int, default=128)
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--kv-heads", type=positive_int, default=4)
    p.add_argument("--intermediate", type=positive_int, default=344)
    p.add_argument("--vocab", type=positive_int, default=512)
    p.add_argument("--precision", choices=("bf16-mixed", "32-true"), default="32-true")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=3)
    p.add_argument("--steps", type=positive_int, default=2, help="optimizer steps per trial (default 2)")
    p.add_argument("--granularity", type=positive_int, default=256, help="lengths are multiples of it (default 256)")
    p.add_argument("--max-length", type=positive_int, default=2**17)
    p.add_argument("--tolerance", type=fraction, default=0.05)
    p.add_argument("--trial-timeout", type=positive_float, default=600.0)
    p.add_argument("--speed-length", type=positive_int, default=None,
                   help="tokens per sequence for tokens/s (default: the longest K = 1 trains)")
    p.add_argument("--speed-warmup", type=positive_int, default=1)
    p.add_argument("--speed-steps", type=positive_int, default=3)
    p.add_argument("--speed-rounds", type=positive_int, default=2,
                   help="time the K values in turn this many times (default 2)")
    p.add_argument("--mmap-threshold", type=size, default="64KiB",
                   help="glibc's mmap threshold in every trial (default 64KiB: freed tensors leave at once)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--no-readme", action="store_true", help="do not rewrite benchmarks/README.md's section")
    p.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.settings:
        return args, Settings(**{k: tuple(v) if isinstance(v, list) else v
                                 for k, v in json.loads(args.settings).items()})
    bad = [k for k in args.sizes if args.world % k or args.heads % k or args.kv_heads % k
           or args.granularity % k]
    if bad:
        p.error(f"argument --sizes: {bad} is not allowed: each K must divide --world ({args.world}), --heads"
                f" ({args.heads}), --kv-heads ({args.kv_heads}) and --granularity ({args.granularity})")
    if args.hidden % args.heads:
        p.error(f"argument --hidden: {args.hidden} is not allowed: it must be a multiple of --heads ({args.heads})")
    s = Settings(world=args.world, sizes=tuple(sorted(set(args.sizes))), cap=args.cap, hidden=args.hidden,
                 layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, intermediate=args.intermediate,
                 vocab=args.vocab, precision=args.precision, stage=args.stage, steps=args.steps,
                 granularity=args.granularity, max_length=args.max_length, tolerance=args.tolerance,
                 trial_timeout=args.trial_timeout, speed_length=args.speed_length or 0,
                 speed_warmup=args.speed_warmup, speed_steps=args.speed_steps, speed_rounds=args.speed_rounds,
                 mmap_threshold=args.mmap_threshold)
    return args, s


def main(argv: list[str] | None = None) -> int:
    args, s = parse(argv)
    out = Path(args.out).resolve()
    if args.rank_worker:
        rank = int(os.environ["RANK"])
        from worker import preload

        preload()
        import gc
        import importlib

        import lightning  # noqa: F401  (before any fork: every trial starts from the same imported parent)

        for name in PRELOAD:  # what every K's trials import: the cap counts the trial's own allocations, not imports
            importlib.import_module(name)
        gc.collect()
        gc.freeze()
        return search_rank(s, rank, out, json.loads(args.plan))
    if args.report_only:
        return publish.report_only("sequence.py", out, "sequence", write_report,
                                   None if args.no_readme else lambda text: update_readme(text, HERE / "README.md"))
    why = check_cgroups()
    if why:
        print(f"sequence.py: {why}. Not measuring: without a cap per rank the lengths would mean nothing.",
              file=sys.stderr)
        return EXIT_NO_CGROUP
    from launch import run_ranks

    t0 = time.monotonic()
    plan = planner_per_token(s)  # uncapped, one process: what the planner is given
    work = out / "raw"
    shutil.rmtree(work, ignore_errors=True)
    for sub in ("trials", "rdv"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    budget = len(s.sizes) * 14 * (s.trial_timeout + 60)
    job = run_ranks([sys.executable, str(Path(__file__).resolve()), "--rank-worker", "--out", str(work),
                     "--settings", json.dumps(asdict(s)), "--plan", json.dumps(plan)], s.world, work / "logs", budget)
    rows_file = work / "rows.json"
    if not job.ok or not rows_file.exists():
        print(f"sequence.py: the job ended without results ({job}); logs in {work / 'logs'}: no results written",
              file=sys.stderr)
        return 1
    rows = json.loads(rows_file.read_text())
    failed = [r["k"] for r in rows if r["errors"] or not r["longest"]]
    import platform

    meta = {"type": "meta", **asdict(s), "planner": plan, "seconds": time.monotonic() - t0,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    with publish.staged(out) as stage:
        if failed:
            stage.discard(f"sequence.py: K = {failed} failed (see {work / 'logs'})", keep=True)
            return 1
        (stage.path / "sequence.jsonl").write_text("\n".join(json.dumps(x) for x in [meta, *rows]) + "\n")
        text = write_report(rows, meta, stage.path)
    if not args.no_readme:
        update_readme(text, HERE / "README.md")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
