"""Tensor-parallel inference on CPU: parameter bytes per rank and generation speed at tp_size 1 and 2, with DeepSpeed's
shared-memory all-reduce and with plain gloo, side by side in one run.

    python benchmarks/tp_inference.py                  # ~5 min on 2 cores; results/tp_inference.{jsonl,md}
    python benchmarks/tp_inference.py --hidden 512 --layers 4 --rounds 1    # quick

Model: a Llama-style ``LlamaForCausalLM`` built from a config (random init, seed 0, nothing downloaded), fp32, inside
a LightningModule served by ``trainer.predict`` with ``HPUDeepSpeedStrategy(tensor_parallel={"tp_size": N})``
(DeepSpeed's AutoTP splits it). Each arm is one job of N processes (Lightning's launcher, one torch thread per
rank): it generates ``--new-tokens`` tokens greedily after a ``--prompt-tokens`` prompt with the model's KV cache,
``--reps`` times after a warm-up; the median is kept. Per-token latency = (time for N new tokens - time for 1) /
(N - 1), i.e. decode steps without the prompt's prefill. Arms run in rounds, interleaved (tp1, tp2 shm, tp2 gloo,
tp1, ...), and each reported figure is the median over rounds.

- ``tp1``: one process, tp_size 1 (the reference: bytes and speed ratios are against it).
- ``tp2_shm``: 2 processes; tensor parallelism loads DeepSpeed's CPU shm all-reduce op (the strategy's default).
- ``tp2_gloo``: 2 processes with ``LIGHTNING_GAUDI_DS_SHM_COMM=off``: the same all-reduce through torch.distributed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import publish
from flags import positive_float, positive_int

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(REPO))

ARMS = {  # name -> (processes, extra environment)
    "tp1": (1, {}),
    "tp2_shm": (2, {}),
    "tp2_gloo": (2, {"LIGHTNING_GAUDI_DS_SHM_COMM": "off"}),
}


def _llama_config(args: argparse.Namespace) -> dict[str, Any]:
    return dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate or
                int(args.hidden * 2.75) // 64 * 64, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                num_key_value_heads=args.heads, max_position_embeddings=args.prompt_tokens + args.new_tokens + 8)


# ------------------------------------------------------------------------------------------------ worker
def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_gaudi_ds import HPUDeepSpeedStrategy

    torch.set_num_threads(1)

    class Generator(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.llama = LlamaForCausalLM(LlamaConfig(**_llama_config(args))).eval()
            self.result: dict[str, Any] = {}

        def predict_step(self, ids: torch.Tensor, batch_idx: int) -> None:
            seen: dict[tuple[int, int], int] = {}
            for p in self.parameters():
                seen[(p.untyped_storage().data_ptr(), p.storage_offset())] = p.numel() * p.element_size()

            def generate(n: int) -> tuple[torch.Tensor, float]:
                start = time.perf_counter()
                out = self.llama.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
                return out, time.perf_counter() - start

            generate(4)  # warm-up
            first, full, tokens = [], [], None
            for _ in range(args.reps):
                first.append(generate(1)[1])
                tokens, seconds = generate(args.new_tokens)
                full.append(seconds)
            decode = (statistics.median(full) - statistics.median(first)) / (args.new_tokens - 1)
            self.result = {
                "param_bytes": sum(seen.values()),
                "prefill_s": statistics.median(first),
                "generate_s": statistics.median(full),
                "decode_ms_per_token": 1e3 * decode,
                "tokens_per_s": args.new_tokens / statistics.median(full),
                "tokens": tokens[0, ids.shape[1]:].tolist(),
                "shm_op": hasattr(torch.ops, "deepspeed") and hasattr(torch.ops.deepspeed, "inference_all_reduce_"),
            }

    prompt = torch.randint(0, args.vocab, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(1))
    model = Generator()
    trainer = L.Trainer(
        accelerator="cpu", devices=args.tp, precision="32-true", logger=False, enable_progress_bar=False,
        enable_model_summary=False, strategy=HPUDeepSpeedStrategy(tensor_parallel={"tp_size": args.tp}),
    )
    trainer.predict(model, DataLoader([prompt[0]], batch_size=1))
    out = Path(args.out) / f"rank{trainer.global_rank}.json"
    out.write_text(json.dumps({**model.result, "rank": trainer.global_rank, "world": trainer.world_size}))


# ------------------------------------------------------------------------------------------------ driver
def run_arm(name: str, args: argparse.Namespace, round_dir: Path) -> dict[str, Any]:
    from benchmarks.launch import run_one

    procs, env = ARMS[name]
    out = round_dir / name
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tp", str(procs), "--out", str(out),
           *_model_argv(args)]
    result = run_one(cmd, out / "job.log", args.timeout, {**env, "OMPI_MCA_ess_singleton_isolated": "1"})
    if not result.ok:
        tail = (out / "job.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"arm {name} failed (timed out: {result.timed_out}):\n{tail}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(procs)]
    return {"arm": name, "processes": procs, "seconds": result.seconds, "ranks": ranks}


def _model_argv(args: argparse.Namespace) -> list[str]:
    keys = ("hidden", "layers", "heads", "vocab", "intermediate", "prompt_tokens", "new_tokens", "reps")
    argv = []
    for key in keys:
        value = getattr(args, key)
        if value is not None:
            argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    ref_tokens = next(r["ranks"][0]["tokens"] for r in runs if r["arm"] == "tp1")
    for name in ARMS:
        mine = [r for r in runs if r["arm"] == name]
        rank0 = [r["ranks"][0] for r in mine]
        rows.append({
            "arm": name,
            "processes": mine[0]["processes"],
            "param_bytes_per_rank": max(rank["param_bytes"] for r in mine for rank in r["ranks"]),
            "decode_ms_per_token": statistics.median(x["decode_ms_per_token"] for x in rank0),
            "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rank0),
            "prefill_ms": 1e3 * statistics.median(x["prefill_s"] for x in rank0),
            "shm_op": all(x["shm_op"] for x in rank0),
            "same_tokens_as_tp1": all(rank["tokens"] == ref_tokens for r in mine for rank in r["ranks"]),
            "rounds": len(mine),
        })
    ref = rows[0]
    for row in rows:
        row["bytes_ratio"] = row["param_bytes_per_rank"] / ref["param_bytes_per_rank"]
        row["latency_ratio"] = row["decode_ms_per_token"] / ref["decode_ms_per_token"]
        row["tokens_per_s_ratio"] = row["tokens_per_s"] / ref["tokens_per_s"]
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    m = meta["model"]
    lines = [
        "# Tensor-parallel inference (benchmarks/tp_inference.py)",
        "",
        f"Llama-style model from a config: hidden {m['hidden_size']}, {m['num_hidden_layers']} layers,"
        f" {m['num_attention_heads']} heads, intermediate {m['intermediate_size']}, vocabulary {m['vocab_size']};"
        f" {meta['parameters'] / 1e6:.1f}M parameters, fp32. Greedy generation of {meta['new_tokens']} tokens after"
        f" {meta['prompt_tokens']} prompt tokens (KV cache), median of {meta['reps']} per job, median over"
        f" {meta['rounds']} interleaved rounds. {meta['machine']}; torch {meta['torch']}, deepspeed"
        f" {meta['deepspeed']}, transformers {meta['transformers']}. Load average at start: {meta['loadavg']}.",
        "",
        "| arm | processes | parameter MB per rank | ÷ tp1 | decode ms/token | ÷ tp1 | tokens/s | ÷ tp1 |"
        " prefill ms | shm op | same tokens as tp1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['arm']} | {r['processes']} | {r['param_bytes_per_rank'] / 2**20:,.1f} | {r['bytes_ratio']:.3f} |"
            f" {r['decode_ms_per_token']:.1f} | {r['latency_ratio']:.2f} | {r['tokens_per_s']:.1f} |"
            f" {r['tokens_per_s_ratio']:.2f} | {r['prefill_ms']:.0f} | {'loaded' if r['shm_op'] else 'off'} |"
            f" {'yes' if r['same_tokens_as_tp1'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=positive_int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    parser.add_argument("--hidden", type=positive_int, default=1024)
    parser.add_argument("--layers", type=positive_int, default=8)
    parser.add_argument("--heads", type=positive_int, default=16)
    parser.add_argument("--vocab", type=positive_int, default=8192)
    parser.add_argument("--intermediate", type=positive_int, default=None, help="default 2.75 x hidden (rounded to 64)")
    parser.add_argument("--prompt-tokens", type=positive_int, default=32)
    parser.add_argument("--new-tokens", type=positive_int, default=32)
    parser.add_argument("--reps", type=positive_int, default=3)
    parser.add_argument("--rounds", type=positive_int, default=2)
    parser.add_argument("--timeout", type=positive_float, default=600)
    args = parser.parse_args(argv)
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} --heads {args.heads}: the hidden size must be a multiple of the heads")
    if args.worker:
        return worker(args)

    import deepspeed
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(args.out) if args.out else RESULTS
    raw = out / "raw" / "tp_inference"
    cfg = _llama_config(args)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**cfg)).parameters())
    meta = {
        "kind": "meta", "model": cfg, "parameters": parameters, "new_tokens": args.new_tokens,
        "prompt_tokens": args.prompt_tokens, "reps": args.reps, "rounds": args.rounds,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__, "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
        "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg()),
    }
    runs = []
    for i in range(args.rounds):
        for name in ARMS:
            print(f"round {i + 1}/{args.rounds}: {name} ...", flush=True)
            runs.append(run_arm(name, args, raw / f"round{i}"))
    rows = summarize(runs)
    text = markdown(rows, meta)
    with publish.staged(out) as stage:
        (stage.path / "tp_inference.jsonl").write_text("".join(
            json.dumps(line) + "\n" for line in [meta, *({"kind": "tp", **row} for row in rows)]))
        (stage.path / "tp_inference.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
