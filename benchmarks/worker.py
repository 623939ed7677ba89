"""One rank of the benchmark job.

The driver (run_all.py) starts one of these per rank, all in one process group. Each imports torch,
Lightning and DeepSpeed once, then runs the plan's cases in order, every case in a fresh child forked from
this clean parent (no threads, no process group, no torch work done here): the ranks' children meet
through a file store named after the case, train, write ``<out>/cases/<case>.rank<r>.json`` and exit.
A child that overruns its time-out is killed by pid; the parent records that and goes on.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_pre_hook  # noqa: E402

import lightning_gaudi_ds  # noqa: E402,F401  (registers names)
from bench_model import BenchModule, ModelSize, ZeroSettings, build_net, deepspeed_config, loss_fn  # noqa: E402
from bench_model import LR, SEED, WEIGHT_DECAY, make_dataset, make_loader  # noqa: E402
from cases import Case  # noqa: E402
from lightning_gaudi_ds import HPUDeepSpeedStrategy  # noqa: E402
from meter import (  # noqa: E402
    CollectiveCounter, delta, live_tensor_storages, peak_rss_bytes, reset_peak_rss, rss_bytes, take_census,
)


# Imported once here, before any fork, so that no case pays for them (DeepSpeed imports its Muon optimizer, and
# with it torch.compile's inductor, on every deepspeed.initialize: ~2-10 s).
PRELOAD = (
    "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3",
    "deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.bf16_optimizer", "deepspeed.ops.adam",
    "lightning.pytorch.strategies.deepspeed", "lightning.pytorch.strategies.ddp",
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
)


def preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - an optional speed-up only
            print(f"preload {name}: {err}", flush=True)


# ------------------------------------------------------------------------------------------ helpers
def quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "DeepSpeed", "deepspeed", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)


def make_strategy(case: Case) -> Any:
    if case.stage is None:
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend="gloo")
    config = deepspeed_config(case.stage, ZeroSettings.for_hidden(case.hidden), case.offload_optimizer,
                              case.offload_parameters, case.spec.zero)
    config["train_micro_batch_size_per_gpu"] = case.batch_size
    return HPUDeepSpeedStrategy(stage=case.stage, config=config)


def make_trainer(case: Case, strategy: Any, callbacks: list[L.Callback], world: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=world, num_nodes=1, strategy=strategy, precision=case.precision,
        max_steps=case.steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks, default_root_dir=os.environ.get("BENCH_ROOT_DIR"),
    )


def engine_of(trainer: L.Trainer) -> Optional[Any]:
    return getattr(trainer.strategy, "deepspeed_engine", None) if isinstance(trainer.strategy, HPUDeepSpeedStrategy) else None


# ------------------------------------------------------------------------------------- memory case
class MemoryProbe(L.Callback):
    """Tensor census at three points of step ``census_step``; collective bytes of every step."""

    def __init__(self, case: Case, counter: CollectiveCounter) -> None:
        self.case = case
        self.counter = counter
        self.step = -1
        self.census: dict[str, Any] = {}
        self.comm_steps: list[dict[str, Any]] = []
        self._comm0: dict[str, Any] = {}
        self._hook: Any = None
        self.live_at_step: int = 0
        self.ddp_bucket_bytes: Optional[int] = None
        self.baseline: set[int] = set()  # storages alive before the model was built
        self.heap: Any = None  # planner benchmark: C-heap peak over the census step (all of the rank's memory)
        self.heap_peak: Optional[int] = None
        self.heap_step_start: Optional[int] = None
        self.heap_peak_op = ""

    def _take(self, trainer: L.Trainer, pl_module: L.LightningModule, point: str) -> None:
        engine = engine_of(trainer)
        optimizer = engine.optimizer if engine is not None else trainer.optimizers[0]
        c = take_census(pl_module, optimizer, engine, self.case.offload_optimizer, self.case.offload_parameters)
        if engine is None:
            c.add_opaque(self._ddp_bucket_bytes(trainer), "buffers", "ddp.reducer.buckets (C++)")
        self.census[point] = c.summary()

    def _ddp_bucket_bytes(self, trainer: L.Trainer) -> int:
        """DDP's gradient buckets (a second copy of the gradients unless gradient_as_bucket_view=True)."""
        model = trainer.strategy.model
        if not hasattr(model, "_get_ddp_logging_data"):
            return 0
        sizes = str(model._get_ddp_logging_data().get("bucket_sizes", "") or "")
        try:
            self.ddp_bucket_bytes = sum(int(s) for s in sizes.split(",") if s.strip())
        except ValueError:
            self.ddp_bucket_bytes = 0
        return self.ddp_bucket_bytes

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from meter import inner_optimizer

        engine = engine_of(trainer)
        inner = inner_optimizer(engine.optimizer if engine is not None else trainer.optimizers[0])
        if engine is None:
            # DDP's C++ reducer all-reduces out of Python's sight; its Python default hook sends the same bytes
            # through torch.distributed.all_reduce, where the counter sees them (Lightning registers hooks on
            # CUDA only, so register it here)
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            trainer.strategy.model.register_comm_hook(None, default_hooks.allreduce_hook)

        def pre_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            if optimizer is inner and self.step == self.case.census_step and "in_step" not in self.census:
                self._take(trainer, pl_module, "in_step")
                if self.case.extra.get("gc_check"):
                    live = live_tensor_storages()
                    self.live_at_step = sum(n for p, n in live.items() if p not in self.baseline)

        self._hook = register_optimizer_step_pre_hook(pre_step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._hook is not None:
            self._hook.remove()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.step = batch_idx
        self._comm0 = self.counter.snapshot()
        if self.case.extra.get("heap_peak") and batch_idx == self.case.census_step:
            from lightning_gaudi_ds.planning.activations import HostPeak

            self._take(trainer, pl_module, "step_start")
            self.heap = HostPeak().__enter__()
            self.heap_step_start = self.heap.start

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.step == self.case.census_step:
            self._take(trainer, pl_module, "before_step")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.heap is not None:
            self.heap.__exit__(None, None, None)
            self.heap_peak, self.heap_peak_op, self.heap = self.heap.peak, self.heap.peak_op, None
        self.comm_steps.append(delta(self.counter.snapshot(), self._comm0))
        self.comm_steps[-1]["detail"] = list(self.counter.detail)
        self.counter.detail.clear()
        if self.step == self.case.census_step:
            self._take(trainer, pl_module, "rest")


def gpt_module(case: Case) -> tuple[L.LightningModule, Any, int]:
    """The example's GPT (examples/train_lm.py) at the case's size, random tokens, and its parameter count."""
    sys.path.insert(0, str(HERE.parent / "examples"))
    from train_lm import LitGPT
    from torch.utils.data import TensorDataset

    from lightning_gaudi_ds.planning.model import build_on_meta, spec_from_module

    kwargs = dict(case.extra["gpt"])
    g = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, 256, (case.batch_size * 2 * case.steps, kwargs["block_size"] + 1), generator=g)
    dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return LitGPT(**kwargs), dataset, spec_from_module(build_on_meta(LitGPT, kwargs)).params


def heap_in_use() -> int:
    from lightning_gaudi_ds.planning.activations import HostPeak

    return HostPeak().start


def run_memory(case: Case, rank: int, world: int) -> dict[str, Any]:
    counter = CollectiveCounter().install()
    init_process_group(case, rank, world)
    if case.extra.get("gpt"):
        module, dataset, params = gpt_module(case)
    else:
        size = ModelSize(case.hidden, case.layers)
        dataset, module, params = make_dataset(size, case.batch_size * world * case.steps), None, size.params
    loader = make_loader(dataset, case.batch_size)
    probe = MemoryProbe(case, counter)
    if case.extra.get("gc_check"):
        probe.baseline = set(live_tensor_storages())
    reset_peak_rss()
    rss_start = rss_bytes()
    heap_start = heap_in_use()
    module = module or BenchModule(size, fused=case.spec.fused)
    trainer = make_trainer(case, make_strategy(case), [probe], world)
    t0 = time.perf_counter()
    trainer.fit(module, loader)
    return {
        "params": params,
        "census": probe.census,
        "live_at_step": probe.live_at_step,
        "ddp_bucket_bytes": probe.ddp_bucket_bytes,
        "comm_steps": probe.comm_steps,
        "rss_start": rss_start,
        "rss_peak": peak_rss_bytes(),
        "rss_end": rss_bytes(),
        "heap_start": heap_start,
        "heap_peak": probe.heap_peak,
        "heap_step_start": probe.heap_step_start,
        "heap_peak_op": probe.heap_peak_op,
        "fit_s": time.perf_counter() - t0,
        "config": copy.deepcopy(getattr(trainer.strategy, "config", None)),
    }


# -------------------------------------------------------------------------------------- speed case
class RawArm:
    """The same training written by hand: ``deepspeed.initialize`` (or torch DDP) and a plain loop."""

    def __init__(self, case: Case, config: Optional[dict[str, Any]], rank: int, world: int, fused: bool) -> None:
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        size = ModelSize(case.hidden, case.layers)
        self.case = case
        self.bf16 = case.precision.startswith("bf16")
        self.fused = fused
        dataset = make_dataset(size, case.batch_size * world * (case.steps + 1))
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
        self.loader = DataLoader(dataset, batch_size=case.batch_size, sampler=sampler, drop_last=True)
        self.batches = iter(self.loader)
        if case.stage is None:
            torch.manual_seed(SEED)
            self.net: Any = torch.nn.parallel.DistributedDataParallel(build_net(size))
            self.optimizer = torch.optim.AdamW(self.net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                               fused=True if fused else None)
            self.engine = None
        else:
            import deepspeed

            assert config is not None
            with deepspeed.zero.Init(config_dict_or_path=config, enabled=case.stage == 3):
                torch.manual_seed(SEED)
                net = build_net(size)
            if case.offload_optimizer:  # what the strategy turns AdamW into under ZeRO-Offload (DeepSpeed refuses it)
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                optimizer: Any = DeepSpeedCPUAdam(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, adamw_mode=True)
            else:  # fused as the strategy made the Trainer's (on CPU, lightning_gaudi_ds.engine.train.fuse_on_cpu)
                optimizer = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                              fused=True if fused else None)
            self.engine, _, _, _ = deepspeed.initialize(
                model=net, optimizer=optimizer, model_parameters=list(net.parameters()), config=config,
                dist_init_required=False,
            )

    def step(self) -> dict[str, float]:
        """One training step; returns the wall/CPU time of its phases (data+forward, backward, optimizer step)."""
        marks = [_now()]
        try:
            x, y = next(self.batches)
        except StopIteration:
            self.batches = iter(self.loader)
            x, y = next(self.batches)
        if self.engine is not None:
            if self.bf16:
                x, y = x.to(torch.bfloat16), y.to(torch.bfloat16)
            loss = loss_fn(self.engine(x), y)
            marks.append(_now())
            self.engine.backward(loss)
            marks.append(_now())
            self.engine.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
                loss = loss_fn(self.net(x), y)
            marks.append(_now())
            loss.backward()
            marks.append(_now())
            self.optimizer.step()
        marks.append(_now())
        return _phases(marks, ("forward", "backward", "step"))


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _phases(marks: list[tuple[float, float]], names: tuple[str, ...]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, a, b in zip(names, marks, marks[1:]):
        out[name] = b[0] - a[0]
        out[name + "_cpu"] = b[1] - a[1]
    return out


class PairedTimer(L.Callback):
    """After each Trainer step, one raw step: the two arms alternate step by step in the same processes.

    Trainer step i = start(i+1) - start(i) - raw(i): everything Lightning does between two batches is in.
    """

    def __init__(self, case: Case, rank: int, world: int) -> None:
        self.case, self.rank, self.world = case, rank, world
        self.starts: list[float] = []
        self.raw: list[float] = []
        self.cpu_starts: list[float] = []  # process CPU time: insensitive to other jobs on a loaded machine
        self.raw_cpu: list[float] = []
        self.arm: Optional[RawArm] = None
        self.marks: dict[str, tuple[float, float]] = {}
        self.trainer_phases: list[dict[str, float]] = []
        self.raw_phases: list[dict[str, float]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from meter import inner_optimizer

        config = copy.deepcopy(getattr(trainer.strategy, "config", None))
        engine = engine_of(trainer)
        inner = inner_optimizer(engine.optimizer if engine is not None else trainer.optimizers[0])
        fused = any(group.get("fused") for group in inner.param_groups)
        self.arm = RawArm(self.case, config, self.rank, self.world, fused)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())
        self.marks = {"start": _now()}

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Any) -> None:
        self.marks["before_backward"] = _now()

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.marks["after_backward"] = _now()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        m = self.marks
        if len(m) == 3:  # forward (from the batch's arrival), backward, optimizer step with Lightning's hooks
            self.trainer_phases.append(_phases([m["start"], m["before_backward"], m["after_backward"], _now()],
                                               ("forward", "backward", "step")))
        assert self.arm is not None
        t0, c0 = time.perf_counter(), time.process_time()
        self.raw_phases.append(self.arm.step())
        self.raw.append(time.perf_counter() - t0)
        self.raw_cpu.append(time.process_time() - c0)

    def trainer_steps(self, cpu: bool = False) -> list[float]:
        starts, raw = (self.cpu_starts, self.raw_cpu) if cpu else (self.starts, self.raw)
        return [starts[i + 1] - starts[i] - raw[i] for i in range(len(starts) - 1)]


def run_speed(case: Case, rank: int, world: int) -> dict[str, Any]:
    init_process_group(case, rank, world)
    size = ModelSize(case.hidden, case.layers)
    loader = make_loader(make_dataset(size, case.batch_size * world * (case.steps + 1)), case.batch_size)
    timer = PairedTimer(case, rank, world)
    trainer = make_trainer(case, make_strategy(case), [timer], world)
    trainer.fit(BenchModule(size, fused=case.spec.fused), loader)
    w = case.warmup
    return {
        "params": size.params,
        "trainer_s": timer.trainer_steps()[w:],
        "raw_s": timer.raw[w:len(timer.starts) - 1],
        "trainer_cpu_s": timer.trainer_steps(cpu=True)[w:],
        "raw_cpu_s": timer.raw_cpu[w:len(timer.starts) - 1],
        "trainer_phases": timer.trainer_phases[w:len(timer.starts) - 1],
        "raw_phases": timer.raw_phases[w:len(timer.starts) - 1],
        "samples_per_step": case.batch_size * world,
        "fused": timer.arm is not None and timer.arm.fused,
    }


# ------------------------------------------------------------------------------------------ plumbing
def init_process_group(case: Case, rank: int, world: int) -> None:
    store = Path(os.environ["BENCH_RDV_DIR"]) / case.id
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=case.timeout))


def pin_mmap_threshold(nbytes: int) -> bool:
    """glibc: serve every allocation >= nbytes with its own mmap, returned to the OS on free.

    By default glibc raises this threshold as large blocks are freed (up to 32 MiB), after which freed tensor
    memory stays in the heap and in RSS: peak RSS then measures the allocator's history as much as the model.
    """
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, nbytes))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def run_child(case: Case, rank: int, world: int, out: Path) -> int:
    if case.extra.get("mmap_threshold"):
        pin_mmap_threshold(int(case.extra["mmap_threshold"]))
    torch.set_num_threads(1)
    if not os.environ.get("BENCH_VERBOSE"):
        quiet()
    result: dict[str, Any] = {"case": case.to_json(), "rank": rank, "ok": False}
    t0 = time.perf_counter()
    try:
        run = run_memory if case.kind == "memory" else run_speed
        if os.environ.get("BENCH_PROFILE"):  # development aid: where a case's time goes
            import cProfile

            prof = cProfile.Profile()
            result.update(prof.runcall(run, case, rank, world))
            prof.dump_stats(str(out / f"{case.id}.rank{rank}.prof"))
        else:
            result.update(run(case, rank, world))
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - report everything, the parent goes on
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
    result["seconds"] = time.perf_counter() - t0
    (out / f"{case.id}.rank{rank}.json").write_text(json.dumps(result))
    return 0 if result["ok"] else 1


def wait_child(pid: int, timeout: float) -> tuple[int, bool]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        time.sleep(0.05)
    os.kill(pid, 9)  # only the child this parent forked, by its pid
    os.waitpid(pid, 0)
    return -9, True


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    plan = json.loads(Path(args.plan).read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    preload()
    failures = 0
    for raw_case in plan["cases"]:
        case = Case.from_json(raw_case)
        t0 = time.monotonic()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = run_child(case, rank, world, out)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        code, timed_out = wait_child(pid, case.timeout + 30)
        failures += code != 0
        print(f"[rank {rank}] {case.id}: exit {code}{' (timed out)' if timed_out else ''} "
              f"in {time.monotonic() - t0:.1f}s", flush=True)
        if timed_out:
            (out / f"{case.id}.rank{rank}.json").write_text(json.dumps(
                {"case": case.to_json(), "rank": rank, "ok": False, "error": f"timed out after {case.timeout + 30}s"}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
