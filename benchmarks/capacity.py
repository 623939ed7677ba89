"""The largest model each configuration trains under a memory cap per rank (issue 27).

Every rank's training runs in its own memory cgroup with a hard limit (cgroup v1 ``memory.limit_in_bytes``, or v2
``memory.max``; swap off for it): a model that does not fit is OOM-killed by the kernel, as on a device that runs
out of memory. For each configuration (Lightning DDP, ZeRO-1/2/3, ZeRO-3 with parameters and optimizer states
offloaded to NVMe) the benchmark searches the number of layers of the benchmark model (``bench_model.py``,
``layers x Linear(hidden, hidden)``) for the largest that completes a few optimizer steps, starting from the
planner's prediction (``plan_memory`` with the cap as the device memory), and reports it beside the ZeRO paper's
ratio over DDP and the planner's prediction. When no cgroup can be made it says so and stops: nothing is ever
measured without a cap.

Each rank process imports torch, Lightning and DeepSpeed once and runs every trial in a fresh child forked from that
clean parent (as ``worker.py``): the child joins its trial's cgroup first, so the cap counts what the trial itself
allocates (model, optimizer, buffers, its share of the Python heap it touches), not the imports. All ranks run the
same search: after each trial every rank writes its outcome, and the next size follows from all of them.

    python benchmarks/capacity.py                          # N = 2 and 4, cap 300 MiB per rank
    python benchmarks/capacity.py --world 2 --configs ddp z3 --cap 300MiB --out /tmp/cap
    python benchmarks/capacity.py --report-only            # table and chart from the last results

A run that names only some ``--configs`` / ``--world`` keeps the other rows of the last ``capacity.jsonl`` (same cap
and model), so that one configuration can be run again alone.

Writes ``<out>/capacity.jsonl`` (one row per configuration and N, and every trial), ``capacity.md``, ``capacity.csv``
and ``capacity.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for path in (str(HERE), str(REPO)):
    if path not in sys.path:
        sys.path.insert(0, path)

import publish  # noqa: E402
from flags import at_least_one, fraction, positive_float, positive_int, size  # noqa: E402

from lightning_gaudi_ds.planning.units import format_bytes  # noqa: E402

RESULTS = HERE / "results" / "capacity"
EXIT_NO_CGROUP = 3


@dataclass(frozen=True)
class Config:
    name: str
    label: str
    stage: int | None  # None: Lightning's DDPStrategy
    nvme: bool = False

    @property
    def plan_key(self) -> tuple[int, bool, bool]:
        """The planner's row: DDP as ZeRO-0 (same states; DDP adds its gradient buckets), NVMe as full offload."""
        return (self.stage or 0, self.nvme, self.nvme)


CONFIGS = {c.name: c for c in (
    Config("ddp", "Lightning DDP", None),
    Config("z1", "ZeRO-1", 1),
    Config("z2", "ZeRO-2", 2),
    Config("z3", "ZeRO-3", 3),
    Config("z3_nvme", "ZeRO-3 + NVMe offload (params & optimizer)", 3, nvme=True),
)}


@dataclass
class Settings:
    worlds: tuple[int, ...] = (2, 4)
    configs: tuple[str, ...] = tuple(CONFIGS)
    cap: int = 300 * 2**20
    hidden: int = 512
    batch_size: int = 4
    steps: int = 3
    tolerance: float = 0.05  # stop when (hi - lo) / lo is at most this
    max_ratio: float = 5.0  # search no higher than this x DDP's largest (NVMe: disk and time are the limit)
    max_layers: int = 4000
    trial_timeout: float = 300.0
    nvme_dir: str = ""
    precision: str = "bf16-mixed"
    # glibc's mmap threshold pinned in each trial (0: glibc's dynamic default). Pinned low, every freed tensor
    # returns to the OS at once, as a device's caching allocator would hand it back for reuse; by default glibc
    # raises the threshold as blocks are freed and keeps later frees in its heap, counted against the cap.
    mmap_threshold: int = 0

    def params(self, layers: int) -> int:
        return layers * (self.hidden * self.hidden + self.hidden)


# ------------------------------------------------------------------------------------------- cgroups
class CgroupError(RuntimeError):
    pass


@dataclass
class Cgroup:
    """One memory cgroup with a hard limit; the process that joins it (and its children) are capped."""

    path: Path
    version: int

    @classmethod
    def create(cls, name: str, limit: int) -> Cgroup:
        v1 = Path("/sys/fs/cgroup/memory")
        v2 = Path("/sys/fs/cgroup")
        try:
            if (v1 / "memory.limit_in_bytes").exists():
                cg = cls(v1 / name, 1)
                cg.path.mkdir()
                (cg.path / "memory.limit_in_bytes").write_text(str(limit))
                if (cg.path / "memory.memsw.limit_in_bytes").exists():  # no escape into swap
                    (cg.path / "memory.memsw.limit_in_bytes").write_text(str(limit))
                (cg.path / "memory.swappiness").write_text("0")
                return cg
            if (v2 / "cgroup.controllers").exists():
                control = v2 / "cgroup.subtree_control"
                if "memory" not in control.read_text().split():
                    control.write_text("+memory")
                cg = cls(v2 / name, 2)
                cg.path.mkdir()
                (cg.path / "memory.max").write_text(str(limit))
                if (cg.path / "memory.swap.max").exists():
                    (cg.path / "memory.swap.max").write_text("0")
                return cg
        except OSError as err:
            raise CgroupError(f"cannot make a memory cgroup ({err}); run as root on a machine with the memory"
                              " controller (v1 at /sys/fs/cgroup/memory, or v2 at /sys/fs/cgroup)") from None
        raise CgroupError("no memory cgroup controller: neither /sys/fs/cgroup/memory (v1) nor cgroup v2 at"
                          " /sys/fs/cgroup is mounted")

    def join(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def peak(self) -> int | None:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        failcnt = self.path / "memory.failcnt"  # kernels without the oom_kill counter (v1)
        return int(failcnt.read_text()) if self.version == 1 and failcnt.exists() else 0

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def check_cgroups() -> str | None:
    """None when a capped cgroup can be made and joined here, else why not."""
    try:
        cg = Cgroup.create(f"lgds-capacity-check-{os.getpid()}", 64 * 2**20)
    except CgroupError as err:
        return str(err)
    cg.remove()
    return None


# ------------------------------------------------------------------------------------------- the model
def zero_config(s: Settings, c: Config, nvme_dir: str) -> dict[str, Any]:
    from bench_model import ZeroSettings, deepspeed_config

    assert c.stage is not None
    h2 = s.hidden * s.hidden
    config = deepspeed_config(c.stage, ZeroSettings.for_hidden(s.hidden))
    zero = config["zero_optimization"]
    if c.stage == 3:
        # keep no more gathered than the prefetch bucket and the running layer (DeepSpeed's defaults, 1e9
        # elements, would keep a small model gathered whole on every rank)
        zero.update(stage3_max_live_parameters=2 * h2, stage3_max_reuse_distance=h2)
    if c.nvme:
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": False, "buffer_count": 5,
                                 "buffer_size": h2, "max_in_cpu": 0}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": False,
                                     "buffer_count": 4, "pipeline_read": False, "pipeline_write": False}
        zero["sub_group_size"] = 4 * h2  # the optimizer swaps one sub-group at a time
        config["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                         "overlap_events": True}
    config["train_micro_batch_size_per_gpu"] = s.batch_size
    return config


def planner_largest(s: Settings, c: Config, world: int) -> dict[str, Any]:
    """The planner's largest layer count whose device bytes fit the cap (its default headroom kept free)."""
    from lightning_gaudi_ds.planning import Buckets, ModelSpec, plan_memory

    zero = zero_config(s, c, "/nonexistent")["zero_optimization"] if c.stage is not None else {}
    buckets = Buckets.for_model(s.hidden, zero, device_type="cpu")

    def row(layers: int) -> dict[str, Any]:
        spec = ModelSpec(params=s.params(layers), hidden_size=s.hidden,
                         param_numels=(s.hidden * s.hidden, s.hidden) * layers)
        (r,) = plan_memory(spec, devices=world, precision=s.precision, device_memory=s.cap, buckets=buckets,
                           configurations=[c.plan_key], device_type="cpu")
        return r

    lo, hi = 0, 1
    while hi <= 10**6 and row(hi)["fits_device"]:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if row(mid)["fits_device"] else (lo, mid)
    return {"planner_layers": lo, "planner_params": s.params(lo) if lo else 0,
            "planner_headroom": row(max(lo, 1))["headroom"]}


def paper_ratio(c: Config, world: int, precision: str) -> float | None:
    """The ZeRO paper's model-state bytes of DDP over the configuration's: its capacity ratio (NVMe: none)."""
    from lightning_gaudi_ds.planning.memory import paper_bytes_per_param

    if c.nvme:
        return None
    return paper_bytes_per_param(None, precision, world) / paper_bytes_per_param(c.stage, precision, world)


# ------------------------------------------------------------------------------------------- one trial
def train_trial(s: Settings, c: Config, layers: int, rank: int, world: int, store: Path, nvme_dir: str) -> None:
    """Inside the capped child: a few optimizer steps of the benchmark model with configuration ``c``."""
    import logging
    import warnings
    from datetime import timedelta

    import lightning as L
    import torch
    import torch.distributed as dist
    from bench_model import BenchModule, ModelSize, make_dataset, make_loader

    from lightning_gaudi_ds import HPUDeepSpeedStrategy

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "DeepSpeed", "deepspeed", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=s.trial_timeout))
    size = ModelSize(s.hidden, layers)
    if c.stage is None:
        from lightning.pytorch.strategies import DDPStrategy

        strategy: Any = DDPStrategy(process_group_backend="gloo")
    else:
        strategy = HPUDeepSpeedStrategy(stage=c.stage, config=zero_config(s, c, nvme_dir))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, precision=s.precision,
                        max_steps=s.steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(store.parent / "root"))
    trainer.fit(BenchModule(size), make_loader(make_dataset(size, s.batch_size * world * s.steps), s.batch_size))
    if trainer.global_step != s.steps:
        raise RuntimeError(f"trained {trainer.global_step} steps, not {s.steps}")


def run_trial(s: Settings, c: Config, layers: int, rank: int, world: int, work: Path, tag: str) -> dict[str, Any]:
    """Train ``layers`` layers of configuration ``c`` under the cap (:func:`run_capped`)."""
    nvme_dir = str(work / "nvme" / f"{tag}-r{rank}")
    if c.nvme:
        Path(nvme_dir).mkdir(parents=True, exist_ok=True)
    try:
        return run_capped(lambda: train_trial(s, c, layers, rank, world, work / "rdv" / tag, nvme_dir), cap=s.cap,
                          rank=rank, work=work, tag=tag, timeout=s.trial_timeout, mmap_threshold=s.mmap_threshold,
                          extra={"config": c.name, "layers": layers, "params": s.params(layers)})
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)


def run_capped(train: Callable[[], Any], *, cap: int, rank: int, work: Path, tag: str, timeout: float,
               mmap_threshold: int = 0, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Fork a child into a fresh cgroup capped at ``cap`` bytes, run ``train`` there, and say how it ended: ok, oom,
    error or peer (killed because another rank's trial failed); written to ``<work>/trials/<tag>.rank<N>.json``
    (with ``extra``) for :func:`agree`. ``train`` may return a JSON-able value: the result's ``value``."""
    trials = work / "trials"
    cg = Cgroup.create(f"lgds-capacity-{os.getppid()}-{tag}-r{rank}", cap)
    error_file = trials / f"{tag}.rank{rank}.error"
    value_file = trials / f"{tag}.rank{rank}.value"
    sys.stdout.flush()
    sys.stderr.flush()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            cg.join(os.getpid())
            if mmap_threshold:
                from worker import pin_mmap_threshold

                pin_mmap_threshold(mmap_threshold)
            value = train()
            if value is not None:
                value_file.write_text(json.dumps(value))
            code = 0
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            import traceback

            error_file.write_text(f"{type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}")
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    try:
        status, killed_for_peer = wait_rank(pid, timeout, trials, tag, rank, t0)
    finally:
        oom, peak = cg.oom_kills(), cg.peak()
        cg.remove()
    if status == 0:
        outcome = "ok"
    elif oom:
        outcome = "oom"
    elif killed_for_peer:
        outcome = "peer"
    elif status == -signal.SIGKILL:
        outcome = "timeout"
    else:
        outcome = "error"
    result = {"tag": tag, **(extra or {}), "rank": rank, "outcome": outcome, "exit": status, "peak_bytes": peak,
              "seconds": round(time.monotonic() - t0, 1)}
    if error_file.exists():
        result["error"] = error_file.read_text()[:3000]
    if value_file.exists():
        result["value"] = json.loads(value_file.read_text())
    out = trials / f"{tag}.rank{rank}.json"
    out.with_suffix(".tmp").write_text(json.dumps(result))
    out.with_suffix(".tmp").rename(out)
    return result


def wait_rank(pid: int, timeout: float, trials: Path, tag: str, rank: int, t0: float) -> tuple[int, bool]:
    """The child's exit status, and whether it was killed because another rank's trial had failed."""
    killed_for_peer = False
    deadline = t0 + timeout + 30
    while True:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(raw)
            break
        peers_failed = any(json.loads(p.read_text()).get("outcome") != "ok"
                           for p in trials.glob(f"{tag}.rank*.json") if p.name != f"{tag}.rank{rank}.json")
        if peers_failed or time.monotonic() > deadline:
            time.sleep(5 if peers_failed else 0)  # let it finish on its own if it was about to
            done, raw = os.waitpid(pid, os.WNOHANG)
            if not done:
                killed_for_peer = peers_failed
                os.kill(pid, signal.SIGKILL)  # only the child this process forked, by its pid
                raw = os.waitpid(pid, 0)[1]
            status = os.waitstatus_to_exitcode(raw)
            break
        time.sleep(0.1)
    return status, killed_for_peer


def agree(work: Path, tag: str, world: int, timeout: float) -> list[dict[str, Any]]:
    """Every rank's outcome of trial ``tag`` (waits for them)."""
    deadline = time.monotonic() + timeout
    while True:
        files = [work / "trials" / f"{tag}.rank{r}.json" for r in range(world)]
        if all(f.exists() for f in files):
            return [json.loads(f.read_text()) for f in files]
        if time.monotonic() > deadline:
            raise TimeoutError(f"trial {tag}: not every rank reported within {timeout:.0f}s")
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------- the search
@dataclass
class Search:
    """Largest layer count that trains: from a guess, step by x1.25 until the outcome flips, then bisect."""

    guess: int
    limit: int
    tolerance: float
    lo: int = 0  # largest known to train
    hi: int | None = None  # smallest known not to
    tried: list[tuple[int, bool]] = field(default_factory=list)

    def next(self) -> int | None:
        if not self.tried:
            return max(1, min(self.guess, self.limit))
        if self.hi is None:  # every trial trained: grow
            return None if self.lo >= self.limit else min(self.limit, max(self.lo + 1, int(self.lo * 1.25)))
        if self.lo == 0:  # every trial failed: shrink
            return None if self.hi <= 1 else max(1, min(self.hi - 1, int(self.hi * 0.8)))
        if self.hi - self.lo <= max(1, int(self.tolerance * self.lo)):
            return None
        return (self.lo + self.hi) // 2

    def record(self, layers: int, ok: bool) -> None:
        self.tried.append((layers, ok))
        if ok:
            self.lo = max(self.lo, layers)
        else:
            self.hi = layers if self.hi is None else min(self.hi, layers)


def search_rank(s: Settings, rank: int, world: int, work: Path) -> int:
    """What every rank process runs: the same search, trial by trial; rank 0 writes the rows."""
    rows = []
    ddp_layers: int | None = None
    for name in s.configs:
        c = CONFIGS[name]
        plan = planner_largest(s, c, world)
        limit = s.max_layers
        if ddp_layers and name != "ddp":
            limit = min(limit, max(2, int(s.max_ratio * ddp_layers)))
        search = Search(max(1, plan["planner_layers"]), limit, s.tolerance)
        t0 = time.monotonic()
        trials, errors = [], []
        base_tag = f"n{world}-{name}-base"
        run_trial(s, c, 1, rank, world, work, base_tag)  # the fixed cost: peak with one layer
        base = agree(work, base_tag, world, s.trial_timeout + 120)
        baseline = max((r["peak_bytes"] or 0) for r in base) if all(r["outcome"] == "ok" for r in base) else None
        while (layers := search.next()) is not None:
            tag = f"n{world}-{name}-l{layers}"
            run_trial(s, c, layers, rank, world, work, tag)
            results = agree(work, tag, world, s.trial_timeout + 120)
            ok = all(r["outcome"] == "ok" for r in results)
            if any(r["outcome"] == "oom" for r in results):  # the others' errors follow from it (peer gone)
                for r in results:
                    r["outcome"] = "peer" if r["outcome"] == "error" else r["outcome"]
            outcomes = sorted({r["outcome"] for r in results})
            errors += [r["error"] for r in results if r["outcome"] == "error" and "error" in r]
            peak = max((r["peak_bytes"] or 0) for r in results)
            trials.append({"layers": layers, "params": s.params(layers), "ok": ok, "outcomes": outcomes,
                           "peak_bytes": peak, "seconds": max(r["seconds"] for r in results)})
            if rank == 0:
                print(f"[N={world}] {c.label}: {layers} layers ({s.params(layers) / 1e6:.1f}M) -> "
                      f"{'/'.join(outcomes)}, peak {format_bytes(peak)}, {trials[-1]['seconds']}s", flush=True)
            search.record(layers, ok)
            if "error" in outcomes and not ok:
                break  # not a memory limit: report it, do not search on
        if name == "ddp":
            ddp_layers = search.lo
        zero = zero_config(s, c, "nvme")["zero_optimization"] if c.stage is not None else {}
        rows.append({"type": "capacity", "world_size": world, "config": name, "label": c.label, "hidden": s.hidden,
                     "zero": {k: v for k, v in zero.items() if isinstance(v, (int, float, bool))},
                     "largest_layers": search.lo, "largest_params": s.params(search.lo) if search.lo else 0,
                     "smallest_failing_layers": search.hi, "at_search_limit": search.hi is None,
                     "search_limit_layers": limit, **plan, "paper_ratio": paper_ratio(c, world, s.precision),
                     "baseline_peak_bytes": baseline,
                     "errors": errors[:2], "trials": trials, "seconds": round(time.monotonic() - t0, 1)})
    if rank == 0:
        (work / f"rows-n{world}.json").write_text(json.dumps(rows))
    return 0


# ------------------------------------------------------------------------------------------- report
def planner_after_fixed_cost(row: dict[str, Any], meta: dict[str, Any]) -> int | None:
    """The planner's largest parameter count when given the cap less the configuration's measured 1-layer peak.

    That peak is what the planner does not model: the pages the trial touches of the imported libraries, gloo's and
    DeepSpeed's set-up, mpi4py loaded by Lightning's environment detection. On a GPU it has no counterpart inside
    device memory (the planner's question is whether the model fits the memory left free), so the cap less it is
    the planner's like-for-like input here. None when the baseline trial failed."""
    base = row.get("baseline_peak_bytes")
    if not base or base >= meta["cap"]:
        return None
    names = {f.name for f in dataclasses.fields(Settings)}
    s = Settings(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in meta.items() if k in names})
    s = dataclasses.replace(s, cap=meta["cap"] - base)
    return int(planner_largest(s, CONFIGS[row["config"]], row["world_size"])["planner_params"])


def derive(rows: list[dict[str, Any]], meta: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Ratios to DDP's largest at the same N, and the planner's error (NVMe: not modeled by the planner)."""
    ddp = {r["world_size"]: r["largest_params"] for r in rows if r["config"] == "ddp"}
    for r in rows:
        nvme = CONFIGS[r["config"]].nvme
        if nvme:  # plan_memory has no NVMe row: its full-offload row counts the device side only, ~0 on CPU
            r["planner_params"] = None
        r["planner_free_params"] = planner_after_fixed_cost(r, meta) if meta and not nvme else None
        r["planner_free_error"] = (r["planner_free_params"] / r["largest_params"] - 1
                                   if r["planner_free_params"] and r["largest_params"] else None)
        if all("oom" in t["outcomes"] for t in r["trials"] if "error" in t["outcomes"]):
            r["errors"] = []  # a rank OOM-killed: the others lose their peer (results of before that rule)
        r["planner_bpp"] = planner_bytes_per_param(r)
        ok = [t for t in r["trials"] if t["ok"] and t["layers"] == r["largest_layers"]]
        base, psi1 = r.get("baseline_peak_bytes"), r["largest_params"] / max(r["largest_layers"], 1)
        r["measured_bpp"] = ((ok[0]["peak_bytes"] - base) / (r["largest_params"] - psi1)
                             if ok and base and r["largest_layers"] > 1 else None)
        base = ddp.get(r["world_size"])
        r["ratio_to_ddp"] = r["largest_params"] / base if base else None
        r["planner_error"] = (r["planner_params"] / r["largest_params"] - 1
                              if r["largest_params"] and r["planner_params"] is not None else None)
        r["of_paper"] = (r["ratio_to_ddp"] / r["paper_ratio"]) if r["ratio_to_ddp"] and r["paper_ratio"] else None
    return rows


def planner_bytes_per_param(row: dict[str, Any]) -> float | None:
    """The planner's device bytes per parameter at the row's largest size (buckets and all)."""
    from lightning_gaudi_ds.planning import Buckets, ModelSpec, plan_memory

    meta_hidden = row.get("hidden")
    if not meta_hidden or not row["largest_layers"] or CONFIGS[row["config"]].nvme:
        return None
    c, layers = CONFIGS[row["config"]], row["largest_layers"]
    spec = ModelSpec(params=layers * (meta_hidden**2 + meta_hidden), hidden_size=meta_hidden,
                     param_numels=(meta_hidden**2, meta_hidden) * layers)
    zero = row.get("zero") or {}
    (r,) = plan_memory(spec, devices=row["world_size"], buckets=Buckets.for_model(meta_hidden, zero, "cpu"),
                       configurations=[c.plan_key], device_type="cpu")
    return r["device_bytes"] / spec.params


def _fmt(value: float | None, spec: str = ".2f", none: str = "–") -> str:
    return none if value is None else format(value, spec)


def write_report(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> str:
    for r in rows:
        r.setdefault("hidden", meta["hidden"])
    rows = derive(rows, meta)
    head = ["N", "configuration", "largest trained (params)", "layers", "first failing layers", "÷ DDP",
            "paper's ÷ DDP", "÷ paper's", "planner's largest at the cap (params)", "planner ÷ measured − 1",
            "planner's largest at the cap − 1-layer peak", "planner ÷ measured − 1 ", "peak of largest",
            "peak with 1 layer", "measured B/param above it", "planner's B/param"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    csv = [",".join(["world_size", "config", "largest_params", "largest_layers", "smallest_failing_layers",
                     "ratio_to_ddp", "paper_ratio", "of_paper", "planner_params", "planner_error",
                     "peak_bytes_of_largest"])]
    for r in rows:
        ok = [t for t in r["trials"] if t["ok"] and t["layers"] == r["largest_layers"]]
        peak = ok[0]["peak_bytes"] if ok else None
        failing = "≥ search limit" if r["at_search_limit"] else str(r["smallest_failing_layers"])
        largest = f"{r['largest_params']:,}" + (" (limit)" if r["at_search_limit"] else "")
        if r["errors"]:
            largest += " ✗ error: " + r["errors"][0].splitlines()[0][:120].replace("|", "/")
        lines.append("| " + " | ".join([
            str(r["world_size"]), r["label"], largest, str(r["largest_layers"]), failing,
            _fmt(r["ratio_to_ddp"]), _fmt(r["paper_ratio"]), _fmt(r["of_paper"]),
            f"{r['planner_params']:,}" if r["planner_params"] is not None else "not modeled",
            _fmt(r["planner_error"], "+.1%"),
            f"{r['planner_free_params']:,}" if r["planner_free_params"] else "–",
            _fmt(r["planner_free_error"], "+.1%"),
            format_bytes(peak) if peak else "–",
            format_bytes(r["baseline_peak_bytes"]) if r.get("baseline_peak_bytes") else "–",
            _fmt(r["measured_bpp"], ".1f"), _fmt(r["planner_bpp"], ".1f")]) + " |")
        csv.append(",".join(str(x) for x in [
            r["world_size"], r["config"], r["largest_params"], r["largest_layers"], r["smallest_failing_layers"] or "",
            _fmt(r["ratio_to_ddp"], ".4f", ""), _fmt(r["paper_ratio"], ".4f", ""), _fmt(r["of_paper"], ".4f", ""),
            r["planner_params"] if r["planner_params"] is not None else "", _fmt(r["planner_error"], ".4f", ""),
            peak or ""]))
    goals = goal_lines(rows)
    text = "\n".join([
        f"Cap {format_bytes(meta['cap'])} per rank (memory cgroup v{meta['cgroup']}, swap off), model"
        f" layers x Linear({meta['hidden']}, {meta['hidden']}), {meta['precision']}, AdamW, micro-batch"
        f" {meta['batch_size']}, {meta['steps']} optimizer steps per trial"
        + (f", glibc's mmap threshold pinned to {format_bytes(meta['mmap_threshold'])} (freed tensors returned at"
           " once)" if meta.get("mmap_threshold") else ", glibc's default allocator settings")
        + f"; search tolerance"
        f" {meta['tolerance']:.0%}; {meta['seconds']:.0f} s of searching in all ({meta['trials']} trials), on"
        f" {meta['machine']}. Planner: `plan_memory` with the cap as device memory and its default headroom"
        f" ({meta['headroom']:.0%}), DDP as its ZeRO-0 row; once with the cap, once with the cap less the"
        " configuration's measured 1-layer peak (the fixed cost it does not model). The planner has no NVMe row.",
        "", *lines, "", *goals, ""])
    (out / "capacity.md").write_text(text)
    (out / "capacity.csv").write_text("\n".join(csv) + "\n")
    chart(rows, out / "capacity.png")
    return text


def goal_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for key, what in (("planner_error", "the cap"), ("planner_free_error", "the cap less the 1-layer peak")):
        errs = [abs(r[key]) for r in rows if r.get(key) is not None and not r["at_search_limit"]]
        if errs:
            lines.append(f"- Planner given {what} within 10% of the measured boundary: {sum(e <= 0.10 for e in errs)}"
                         f" of {len(errs)} configurations (largest error {max(errs):.1%})"
                         f" {'✓' if max(errs) <= 0.10 else '✗'}")
    for r in rows:
        if r["config"] == "z3" and r["world_size"] == 4 and r["of_paper"] is not None:
            lines.append(f"- ZeRO-3 at N = 4: {r['ratio_to_ddp']:.2f}x DDP, {r['of_paper']:.2f} of the paper's"
                         f" {r['paper_ratio']:.2f}x (goal >= 0.8) {'✓' if r['of_paper'] >= 0.8 else '✗'}")
        if r["config"] == "z3_nvme" and r["ratio_to_ddp"] is not None:
            at = " (search limit reached: at least this)" if r["at_search_limit"] else ""
            lines.append(f"- NVMe offload at N = {r['world_size']}: {r['ratio_to_ddp']:.2f}x DDP's largest{at}"
                         f" (goal >= 4) {'✓' if r['ratio_to_ddp'] >= 4 else '✗'}")
    return lines


def chart(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib, the bench extra)", file=sys.stderr)
        return
    worlds = sorted({r["world_size"] for r in rows})
    names = [n for n in CONFIGS if any(r["config"] == n for r in rows)]
    fig, axes = plt.subplots(1, len(worlds), figsize=(5.5 * len(worlds), 4), squeeze=False)
    for ax, world in zip(axes[0], worlds, strict=True):
        by = {r["config"]: r for r in rows if r["world_size"] == world}
        xs = range(len(names))
        measured = [by[n]["largest_params"] / 1e6 if n in by else 0 for n in names]
        planned = [(by[n].get("planner_free_params") or 0) / 1e6 if n in by else 0 for n in names]
        ax.bar([x - 0.2 for x in xs], measured, 0.4, label="measured largest")
        ax.bar([x + 0.2 for x in xs], planned, 0.4, label="planner's largest (cap − 1-layer peak)", alpha=0.6)
        ddp = by.get("ddp", {}).get("largest_params", 0) / 1e6
        paper = [ddp * by[n]["paper_ratio"] if n in by and by[n]["paper_ratio"] else None for n in names]
        marks = [(x, p) for x, p in zip(xs, paper, strict=True) if p]
        ax.scatter([x for x, _ in marks], [p for _, p in marks], marker="_", s=600, color="k",
                   label="paper's ratio x DDP's", zorder=3)
        for x, n in zip(xs, names, strict=True):
            if n in by and by[n]["at_search_limit"]:
                ax.annotate("≥", (x - 0.2, measured[x]), ha="center", va="bottom")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([CONFIGS[n].label.replace(" + NVMe offload (params & optimizer)", "\n+ NVMe")
                            for n in names], fontsize=8)
        ax.set_ylabel("parameters (M)")
        ax.set_title(f"N = {world} ranks")
        ax.legend(fontsize=7)
    fig.suptitle("Largest model trained under the same memory cap per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def update_readme(text: str, readme: Path) -> None:
    chart = "![largest model per configuration under the cap](results/capacity/capacity.png)\n"
    publish.replace_section(readme, "capacity", text + "\n" + chart)


# ------------------------------------------------------------------------------------------- driver
def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Settings]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=positive_int, nargs="+", default=[2, 4], help="ranks (default: 2 4)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--cap", type=size, default="300MiB", help="memory per rank (default 300MiB)")
    p.add_argument("--hidden", type=positive_int, default=512)
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--steps", type=positive_int, default=3, help="optimizer steps per trial (default 3)")
    p.add_argument("--tolerance", type=fraction, default=0.05)
    p.add_argument("--max-ratio", type=at_least_one, default=5.0,
                   help="search up to this x DDP's largest (default 5)")
    p.add_argument("--max-layers", type=positive_int, default=4000)
    p.add_argument("--trial-timeout", type=positive_float, default=300.0)
    p.add_argument("--nvme-dir", default="", help="local directory for NVMe offload (default: under --out)")
    p.add_argument("--mmap-threshold", type=size, default=None,
                   help="pin glibc's mmap threshold in every trial (e.g. 64KiB):"
                   " freed tensors leave the process at once (default: glibc's dynamic threshold)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--no-readme", action="store_true", help="do not rewrite benchmarks/README.md's section")
    p.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.settings:
        return args, Settings(**{k: tuple(v) if isinstance(v, list) else v
                                 for k, v in json.loads(args.settings).items()})
    for n in args.world:
        if n < 2:
            p.error(f"--world {n}: ZeRO needs at least 2 ranks to shard anything; pass 2 or more")
    s = Settings(worlds=tuple(args.world), configs=tuple(args.configs), cap=args.cap,
                 hidden=args.hidden, batch_size=args.batch_size, steps=args.steps, tolerance=args.tolerance,
                 max_ratio=args.max_ratio, max_layers=args.max_layers, trial_timeout=args.trial_timeout,
                 nvme_dir=args.nvme_dir,
                 mmap_threshold=args.mmap_threshold or 0)
    return args, s


def main(argv: list[str] | None = None) -> int:
    args, s = parse(argv)
    out = Path(args.out).resolve()  # absolute: the trials meet through file:// stores under it
    if args.rank_worker:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        from worker import preload

        preload()
        import gc

        import lightning  # noqa: F401  (before any fork: every trial starts from the same imported parent)

        # The imports' objects leave the collector's reach (Python's remedy for copy-on-write after fork): ZeRO-3's
        # set-up calls gc.collect() (deepspeed.runtime.zero.utils.defragment), which in a forked trial writes to
        # every object of this parent's heap and so copied ~130 MiB of imported pages into the ZeRO-3 and NVMe
        # trials' cgroups alone (1-layer ZeRO-3 trial: 293 -> 156 MiB). Every configuration is charged for what it
        # allocates, not for the collector touching the imports.
        gc.collect()
        gc.freeze()
        return search_rank(s, rank, world, out)
    if args.report_only:
        return publish.report_only("capacity.py", out, "capacity", write_report,
                                   None if args.no_readme else lambda text: update_readme(text, HERE / "README.md"))
    why = check_cgroups()
    if why:
        print(f"capacity.py: {why}. Not measuring: without a cap per rank the sizes would mean nothing.",
              file=sys.stderr)
        return EXIT_NO_CGROUP
    if "z3_nvme" in s.configs:
        from lightning_gaudi_ds.jit_ops.build import ASYNC_IO, OPS, ds_builder

        builder = ds_builder(OPS[ASYNC_IO])
        ok = builder is not None and builder.is_compatible(verbose=False)
        if ok:  # built here, outside any cap: a trial must not JIT-compile it under its memory limit
            from lightning_gaudi_ds.jit_ops.build import build_ops

            ok = all(r.ok for r in build_ops([ASYNC_IO]))
        if not ok:
            print("capacity.py: DeepSpeed's async_io op cannot be built here (libaio-dev missing?): NVMe offload"
                  " is left out; install it with scripts/setup.sh", file=sys.stderr)
            s = Settings(**{**asdict(s), "configs": tuple(c for c in s.configs if c != "z3_nvme")})
    from launch import run_ranks

    out.mkdir(parents=True, exist_ok=True)
    work = Path(s.nvme_dir) if s.nvme_dir else out / "raw"
    shutil.rmtree(work, ignore_errors=True)
    rows: list[dict[str, Any]] = []
    for world in s.worlds:
        run_dir = work / f"n{world}"
        for sub in ("trials", "rdv", "nvme"):
            (run_dir / sub).mkdir(parents=True, exist_ok=True)
        budget = len(s.configs) * 12 * (s.trial_timeout + 60)
        job = run_ranks([sys.executable, str(Path(__file__).resolve()), "--rank-worker", "--out", str(run_dir),
                         "--settings", json.dumps(asdict(s))], world, run_dir / "logs", budget)
        rows_file = run_dir / f"rows-n{world}.json"
        if not rows_file.exists():
            print(f"capacity.py: the N={world} job ended without results ({job}); logs in {run_dir / 'logs'}",
                  file=sys.stderr)
            return 1
        rows += json.loads(rows_file.read_text())
    import platform

    from lightning_gaudi_ds.planning.memory import DEFAULT_HEADROOM

    # rows of configurations not run this time come from the last results (same cap and model only)
    previous = out / "capacity.jsonl"
    if previous.exists():
        old = [json.loads(x) for x in previous.read_text().splitlines()]
        old_meta = next((x for x in old if x["type"] == "meta"), {})
        same = all(old_meta.get(k, 0 if k == "mmap_threshold" else None) == getattr(s, k)
                   for k in ("cap", "hidden", "batch_size", "steps", "precision", "mmap_threshold"))
        ran = {(r["world_size"], r["config"]) for r in rows}
        if same:
            rows = [r for r in old if r["type"] == "capacity" and (r["world_size"], r["config"]) not in ran] + rows
            order = {n: i for i, n in enumerate(CONFIGS)}
            rows.sort(key=lambda r: (r["world_size"], order[r["config"]]))
    meta = {"type": "meta", **asdict(s), "seconds": sum(r["seconds"] for r in rows), "headroom": DEFAULT_HEADROOM,
            "cgroup": 1 if Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists() else 2,
            "trials": sum(len(r["trials"]) for r in rows),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"}
    with publish.staged(out) as stage:  # a report that fails leaves the last results as they were
        (stage.path / "capacity.jsonl").write_text("".join(json.dumps(line) + "\n" for line in [meta, *rows]))
        text = write_report(rows, meta, stage.path)
    if not args.no_readme and out.resolve() == RESULTS.resolve():
        update_readme(text, HERE / "README.md")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
