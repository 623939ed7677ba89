"""``lightning-gaudi-ds plan``: predicted memory per rank for every ZeRO stage and offload, and what fits.

Only argparse is imported at module level: ``--help`` starts fast and imports no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from lightning_gaudi_ds.errors import PlanError
from lightning_gaudi_ds.planning.memory import NO_DEVICE_MEMORY, format_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("model (one of)")
    group = source.add_mutually_exclusive_group(required=True)
    group.add_argument("--params", help="number of trainable parameters, e.g. 7e9")
    group.add_argument("--model", metavar="PKG.MODULE:CLASS",
                       help="a LightningModule / nn.Module class, built on the meta device (configure_model too)")
    group.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (or its directory); no download")
    source.add_argument("--init-args", default="{}", metavar="JSON", help="keyword arguments for --model, as JSON")
    source.add_argument("--hidden-size", type=int, help="hidden size, to size DeepSpeed's buckets (with --params)")
    parser.add_argument("--devices", type=int, help="devices per node (default: the accelerators here, else 1)")
    parser.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    parser.add_argument("--device-memory", help="memory per device, e.g. 96GiB (default: read from the device)")
    parser.add_argument("--device", choices=("cpu", "cuda", "hpu"),
                        help="device type whose communication defaults to assume (default: the device here)")
    parser.add_argument("--host-memory", help="memory per node, e.g. 1TiB (default: this machine's RAM)")
    parser.add_argument("--precision", default="bf16-mixed",
                        help="Lightning precision: bf16-mixed (default), 16-mixed, bf16-true, 16-true, 32-true")
    parser.add_argument("--optimizer", default="adamw", help="adamw (default), adam, sgd, adagrad, lamb")
    parser.add_argument("--param-groups", type=int, default=1,
                        help="the optimizer's parameter groups (ZeRO-1/2 hold more through the step with >1)")
    parser.add_argument("--headroom", type=float, default=0.10, help="fraction of memory kept free (default 0.10)")
    parser.add_argument("--hpz", action="store_true",
                        help="ZeRO-3 rows with ZeRO++ hpZ: a secondary partition per node (zero_hpz_partition_size ="
                             " devices per node); needs --nodes 2 or more")
    act = parser.add_argument_group("activations")
    act.add_argument("--measure-activations", action="store_true",
                     help="run one forward/backward of one micro batch on one device and add its peak")
    act.add_argument("--batch-size", type=int, default=1, help="micro batch for --hf-config (default 1)")
    act.add_argument("--seq-len", type=int, help="sequence length for --hf-config (default: the model's maximum)")
    act.add_argument("--sequence-parallel-size", type=int, default=1, metavar="K",
                     help="ranks sharing each sequence (sequence parallelism): each holds 1/K of the activations")
    step = parser.add_argument_group("step time (--step-time)")
    step.add_argument("--step-time", action="store_true",
                      help="also predict samples/s per configuration (compute, communication, optimizer step)")
    step.add_argument("--hardware", help="row of the step-time table: gaudi2, gaudi3, h100, cpu (this machine,"
                      " benchmarks/hardware.py); default: by --device (hpu: gaudi2, cuda: h100, cpu: cpu)")
    step.add_argument("--flops-per-sample", help="training FLOPs of one sample (default: 6 per parameter per token of"
                      " --seq-len, the attention added for --hf-config)")
    step.add_argument("--activation-checkpointing", action="store_true",
                      help="the forward runs twice (the default FLOPs per sample x 4/3)")
    step.add_argument("--efficiency", type=float, default=1.0,
                      help="fraction of the peak FLOP/s the model's kernels reach (default 1: an upper bound)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")


# Options whose value may start with "-": argparse would take "-7e9" or "-24GiB" for an option ("expected one
# argument"); joined as "--params=-7e9" they reach the checks below, which name what is allowed.
_VALUE_OPTIONS = ("--params", "--hidden-size", "--devices", "--nodes", "--device-memory", "--host-memory",
                  "--param-groups", "--headroom", "--batch-size", "--seq-len", "--flops-per-sample", "--efficiency",
                  "--sequence-parallel-size")
# Whole-number options: (what the number means) for the message; each must be >= 1.
_COUNTS = {"devices": "devices per node", "nodes": "nodes", "param_groups": "the optimizer's parameter groups",
           "hidden_size": "the model's hidden size", "batch_size": "samples per micro batch",
           "seq_len": "tokens per sample", "sequence_parallel_size": "ranks sharing each sequence"}


def prepare_args(argv: list[str]) -> list[str]:
    """``--option -value`` as ``--option=-value`` for :data:`_VALUE_OPTIONS` (see there)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token, value = argv[i], argv[i + 1] if i + 1 < len(argv) else ""
        if token in _VALUE_OPTIONS and value.startswith("-") and not value.startswith("--") and value != "-h":
            out.append(f"{token}={value}")
            i += 2
        else:
            out.append(token)
            i += 1
    return out


def _fail(message: str) -> SystemExit:
    sys.stderr.write(f"lightning-gaudi-ds plan: error: {message}\n")
    return SystemExit(2)


def _check_numbers(args: argparse.Namespace) -> None:
    import math

    for name, meaning in _COUNTS.items():
        value = getattr(args, name)
        if value is not None and value < 1:
            raise PlanError(f"argument --{name.replace('_', '-')}: {value} is not allowed; pass a whole number >= 1"
                             f" ({meaning})")
    if not (math.isfinite(args.headroom) and 0 <= args.headroom < 1):
        raise PlanError(f"argument --headroom: {args.headroom} is not allowed; pass a fraction in [0, 1) of the"
                         " memory kept free (default 0.10)")


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    from lightning_gaudi_ds.devices import detect_device_type
    from lightning_gaudi_ds.planning.detect import detect_device_count, detect_device_memory, detect_host_memory
    from lightning_gaudi_ds.planning.inputs import PlanInputs, plan_rows
    from lightning_gaudi_ds.planning.units import parse_bytes

    try:
        init_args = json.loads(args.init_args)
    except json.JSONDecodeError as err:
        raise _fail(f"--init-args {args.init_args!r} is not JSON: {err}") from None
    if not isinstance(init_args, dict):
        raise _fail(f"--init-args must be a JSON object, got {args.init_args!r}")
    try:
        _check_numbers(args)
        device_memory = parse_bytes(args.device_memory, "--device-memory") if args.device_memory else None
        host_memory = parse_bytes(args.host_memory, "--host-memory") if args.host_memory else None
        module, spec, inputs = _model(args, init_args)
        if args.hidden_size is not None:
            spec = dataclasses.replace(spec, hidden_size=args.hidden_size)
        activations = None
        if args.measure_activations:
            activations = _measure(args, module, inputs)

        device_type = args.device or detect_device_type()

        def plan(model: Any) -> list[dict[str, Any]]:  # the inputs stage="auto" plans with (strategy's defaults)
            return plan_rows(PlanInputs.build(
                model, device_type=device_type, optimizer=args.optimizer,
                devices=args.devices if args.devices is not None else detect_device_count(args.device),
                nodes=args.nodes, precision=args.precision,
                device_memory=device_memory or detect_device_memory(args.device),
                host_memory=host_memory or detect_host_memory(), headroom=args.headroom,
                activation_bytes=activations, param_groups=args.param_groups, hpz=args.hpz,
                sequence_parallel_size=args.sequence_parallel_size,
            ))

        rows = plan(spec)
        note = bucket_note(spec, rows, plan) if spec.hidden_size is None else None
        steps = step_times(args, rows, spec, module, device_type) if args.step_time else None
    except ValueError as err:
        raise _fail(str(err)) from None
    if args.json:
        json.dump(rows if steps is None else {"memory": rows, "step_time": steps[0]}, out, indent=1)
        out.write("\n")
        if rows[0]["device_memory"] is None:
            sys.stderr.write(f"note: {NO_DEVICE_MEMORY}\n")
        if note:
            sys.stderr.write(f"note: {note}\n")
    else:
        out.write(format_table(rows, spec.name) + (f"\n{note}" if note else "") + "\n")
        if steps is not None:
            out.write("\n" + steps[1] + "\n")
    return 0


def step_times(args: argparse.Namespace, rows: list[dict[str, Any]], spec: Any, source: Any,
               device_type: str) -> tuple[list[dict[str, Any]], str]:
    """``--step-time``: the rows' predicted step (planning/steptime.py) and its table."""
    import math

    from lightning_gaudi_ds.planning import steptime

    hardware = args.hardware or steptime.hardware_for(device_type)
    if hardware not in steptime.HARDWARE:
        raise PlanError(f"--hardware {hardware!r} is not in the step-time table. Allowed:"
                         f" {', '.join(steptime.HARDWARE)}")
    if not (math.isfinite(args.efficiency) and 0 < args.efficiency <= 1):
        raise PlanError(f"argument --efficiency: {args.efficiency} is not allowed; pass a fraction in (0, 1] of the"
                         " peak FLOP/s (default 1)")
    seq = args.seq_len or 1
    if args.flops_per_sample is not None:
        try:
            flops = float(args.flops_per_sample)
        except ValueError:
            flops = -1.0
        if not (math.isfinite(flops) and flops > 0):
            raise PlanError(f"argument --flops-per-sample: {args.flops_per_sample!r} is not allowed; pass a number"
                             " > 0, e.g. 1.3e13")
    elif args.hf_config is not None:
        layers = int(getattr(source, "num_hidden_layers", 0) or getattr(source, "n_layer", 0) or 0)
        hidden = int(getattr(source, "hidden_size", 0) or getattr(source, "n_embd", 0) or 0)
        seq = args.seq_len or int(getattr(source, "max_position_embeddings", 0) or getattr(source, "n_positions", 0)
                                  or 1024)
        flops = steptime.transformer_flops_per_sample(spec.params, layers, hidden, seq, args.activation_checkpointing)
    else:
        flops = 6.0 * spec.params * seq * (4 / 3 if args.activation_checkpointing else 1)
    workload = steptime.Workload(spec.params, flops, args.batch_size, args.precision)
    steps = steptime.plan_step_times(rows, workload, hardware, args.efficiency)
    return steps, steptime.format_step_table(steps, workload, hardware, args.efficiency)


def _fastest_fitting(rows: Sequence[dict[str, Any]]) -> str:
    from lightning_gaudi_ds.planning.memory import fastest_fitting

    row = fastest_fitting(rows)
    return "nothing" if row is None else str(row["label"])


def bucket_note(spec: Any, rows: Sequence[dict[str, Any]], plan: Any) -> str:
    """What the bucket sizes were without a hidden size, and whether a hidden size (``--hidden-size``,
    ``--model``) would change which configuration fits: the strategy (and ``stage="auto"``) sizes DeepSpeed's
    buckets from the model's hidden size h (h² elements), not with the 200M-element defaults used here."""
    import dataclasses
    import math

    b = rows[0]["buckets"]
    note = (f"bucket sizes assumed: Lightning's and DeepSpeed's defaults (reduce/allgather {b['reduce_bucket_size']:,}"
            f" elements, ZeRO-3 prefetch {b['stage3_prefetch_bucket_size']:,}): no hidden size is known. The strategy"
            " (and stage='auto') sizes them from the model's hidden size h (h² elements).")
    if rows[0]["device_memory"] is None:
        return note
    here = _fastest_fitting(rows)
    # hidden sizes from 64 up to one matrix holding every parameter, doubling
    sizes = [2**k for k in range(6, max(7, int(math.log2(math.isqrt(spec.params))) + 1))]
    answers = [(h, _fastest_fitting(plan(dataclasses.replace(spec, hidden_size=h)))) for h in sizes]
    if all(answer == here for _, answer in answers):
        return note + f" A hidden size of {sizes[0]:,}-{sizes[-1]:,} gives the same answer ({here})."
    ranges: list[tuple[int, int, str]] = []
    for h, answer in answers:
        if ranges and ranges[-1][2] == answer:
            ranges[-1] = (ranges[-1][0], h, answer)
        else:
            ranges.append((h, h, answer))
    parts = "; ".join(f"hidden size {lo:,}{f'-{hi:,}' if hi != lo else ''}: {answer}" for lo, hi, answer in ranges)
    return (note + f" With buckets sized from the model the answer changes ({parts}; here: {here}): pass"
            " --hidden-size or --model for this model's own.")



def _model(args: argparse.Namespace, init_args: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(module or None, ModelSpec, one micro batch or None) for the source the user gave."""
    from lightning_gaudi_ds.planning import model as sources
    from lightning_gaudi_ds.planning.memory import ModelSpec

    if args.params is not None:
        try:
            n = float(args.params)
        except ValueError:
            raise PlanError(f"--params {args.params!r} is not a number; write e.g. 7e9 or 125000000") from None
        if not (n > 0 and n != float("inf")) or n != int(n):
            raise PlanError(f"argument --params: {args.params!r} is not allowed; pass a whole, finite number of"
                             " trainable parameters > 0, e.g. 7e9 or 125000000")
        if args.measure_activations:
            raise PlanError("--measure-activations needs the model itself: use --model or --hf-config")
        from lightning_gaudi_ds.planning.memory import parameter_count

        return None, ModelSpec(params=parameter_count(n), name=f"{n:.3g} parameters"), None
    if args.model is not None:
        if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` would: modules of the directory
            sys.path.insert(0, os.getcwd())
        cls = sources.import_class(args.model)
        module = sources.build_on_meta(cls, init_args, args.model)
        spec = sources.spec_from_module(module, name=args.model)
        inputs = getattr(module, "example_input_array", None)
        if args.measure_activations and inputs is None:
            raise PlanError(f"--measure-activations: {args.model} has no `example_input_array` (one micro batch);"
                             " set it in the module's __init__ (a Lightning convention)")
        return (cls, init_args), spec, inputs
    config = sources.load_hf_config(args.hf_config)
    try:
        built = sources.build_hf_on_meta(config)
    except (RuntimeError, TypeError, ValueError, AssertionError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PlanError(f"--hf-config {args.hf_config!r}: transformers cannot build {type(config).__name__} from it"
                         f" ({first}); check its sizes") from None
    spec = sources.spec_from_module(built, name=f"{type(config).__name__}")
    return config, spec, None


def _measure(args: argparse.Namespace, built: Any, inputs: Any) -> int:
    """Peak activation bytes of one micro batch, with the real module on this machine's first device."""
    import torch

    from lightning_gaudi_ds.devices import detect_device_type
    from lightning_gaudi_ds.planning.activations import measure_activation_bytes

    kind = detect_device_type()
    device = torch.device(kind, 0) if kind != "cpu" else torch.device("cpu")
    if args.model is not None:
        cls, init_args = built
        module = cls(**init_args)
        if callable(getattr(module, "configure_model", None)):
            module.configure_model()
        inputs = module.example_input_array  # the real one: the meta-built module's holds no data
    else:
        from transformers import AutoModel, AutoModelForCausalLM

        try:
            module = AutoModelForCausalLM.from_config(built)
        except ValueError:
            module = AutoModel.from_config(built)
        seq = args.seq_len or int(getattr(built, "max_position_embeddings", 0) or 512)
        ids = torch.randint(0, int(getattr(built, "vocab_size", 2) or 2), (args.batch_size, seq))
        inputs = {"input_ids": ids, "labels": ids}
    return measure_activation_bytes(module, inputs, args.precision, device)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-gaudi-ds plan", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(prepare_args(list(sys.argv[1:] if argv is None else argv))))
