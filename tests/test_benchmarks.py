"""benchmarks/: the paper's formulas, and the --quick memory benchmark run for real (2 ranks on gloo).

No timing is asserted anywhere: the machine is shared. What is asserted are properties that hold on any
machine: the census adds up, DDP holds 16 bytes of model state per parameter, and every ZeRO stage holds
fewer bytes per rank than DDP.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.procs import REPO, run_job

sys.path.insert(0, str(REPO / "benchmarks"))

from report import fit_line, formula  # noqa: E402
from run_all import FLIPPED_ARMS, Settings, plan  # noqa: E402
import spread  # noqa: E402
from recipes import summary_fields  # noqa: E402


def test_paper_formulas_at_two_ranks() -> None:
    # Rajbhandari et al. 2020, mixed-precision Adam: DDP 16Ψ, ZeRO-1 4Ψ+12Ψ/N, ZeRO-2 2Ψ+14Ψ/N, ZeRO-3 16Ψ/N
    assert [formula(a, "bf16-mixed", 2) for a in ("ddp", "z0", "z1", "z2", "z3")] == [16, 16, 10, 9, 8]
    assert [formula(a, "32-true", 2) for a in ("ddp", "z1", "z2", "z3")] == [16, 12, 10, 8]
    assert formula("z3", "bf16-mixed", 8) == 2
    a, b, r2 = fit_line([1, 2, 3], [12, 22, 32])
    assert (a, b, r2) == pytest.approx((10, 2, 1))


def _speed_file(path: Path, ratios: dict[str, tuple[float, float]]) -> Path:
    rows = [{"type": "meta"}] + [{"type": "speed", "arm": arm, "ok": True, "cpu_overhead": o, "cpu_vs_ddp": v,
                                  "vs_ddp": v} for arm, (o, v) in ratios.items()]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_spread_judges_every_cpu_ratio_of_two_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one = _speed_file(tmp_path / "one.jsonl", {"ddp": (1.00, 1.0), "z1": (1.02, 0.80), "z3": (0.99, 0.70)})
    close = _speed_file(tmp_path / "close.jsonl", {"ddp": (1.04, 1.0), "z1": (1.00, 0.75), "z3": (1.01, 0.74)})
    far = _speed_file(tmp_path / "far.jsonl", {"ddp": (1.00, 1.0), "z1": (1.02, 0.60), "z3": (0.99, 0.70)})
    assert spread.main([str(one), str(close), "--write", str(tmp_path / "spread.md")]) == 0
    table = (tmp_path / "spread.md").read_text()
    assert "| ZeRO-1 | 1.020 / 1.000 | 2.0% | 0.800 / 0.750 | 6.7% |" in table
    assert "Largest difference 6.7%; 0 ratio(s)" in table
    assert spread.main([str(one), str(far)]) == 1
    assert "33.3% ✗" in capsys.readouterr().out  # 0.80 vs 0.60: |a - b| / min(a, b)


def test_recipe_benchmark_reads_the_examples_summary() -> None:
    """benchmarks/recipes.py parses the summary train_lm.py prints (the README shows one)."""
    readme = (REPO / "README.md").read_text()
    fields = summary_fields(readme)
    assert fields["processes"] == 2 and fields["device"] == "cpu" and fields["stage"] == 2
    assert fields["samples_per_s"] > 0 and fields["tokens_per_s"] > fields["samples_per_s"] and fields["timed_steps"] > 0
    assert 0 < fields["val_loss"] < fields["first_loss"]


def test_quick_plan_leaves_out_the_flipped_defaults() -> None:
    common = dict(hidden=64, layers=(2,), main_layers=2, batch_size=4, memory_steps=3, speed_rounds=2,
                  speed_warmup=1, speed_measured=2, offload=False, fp32=False, mmap_sweep=False, speed=True,
                  memory=True)
    full = plan(Settings(**common))
    assert set(FLIPPED_ARMS) <= {c.arm for c in full if c.kind == "memory"}
    assert not set(FLIPPED_ARMS) & {c.arm for c in full if c.kind == "speed"}  # only with --flipped-speed
    assert set(FLIPPED_ARMS) <= {c.arm for c in plan(Settings(**common, flipped_speed=FLIPPED_ARMS)) if c.kind == "speed"}
    assert not set(FLIPPED_ARMS) & {c.arm for c in plan(Settings(**common, flipped=False))}  # --quick


@pytest.mark.multiprocess
def test_quick_memory_benchmark(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    run_job([sys.executable, str(REPO / "benchmarks" / "run_all.py"), "--quick", "--only", "memory",
             "--layers", "2", "4", "--out", str(out), "--timeout", "900"], timeout=1000).check()
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert rows[0]["type"] == "meta" and rows[0]["settings"]["world_size"] == 2
    mem = {r["arm"]: r for r in rows if r["type"] == "memory" and r["precision"] == "bf16-mixed"}
    assert {"ddp", "z0", "z1", "z2", "z3"} <= set(mem), mem.keys()
    for arm, r in mem.items():
        assert r["ok"], (arm, r.get("error"))
        parts = r["peak_parts_bpp"]
        assert sum(parts.values()) == pytest.approx(r["peak_bpp"])
        assert r["peak_ratio"] == pytest.approx(r["peak_bpp"] / r["formula_bpp"])
        assert r["entry_bpp"] <= r["peak_bpp"] + 1e-9
    ddp_states = mem["ddp"]["ddp_states_bpp"]
    assert ddp_states == pytest.approx(16.0, rel=0.01)  # fp32 parameters, gradients, Adam's two moments
    for arm in ("z1", "z2", "z3"):
        assert mem[arm]["entry_bpp"] < ddp_states, arm
        assert mem[arm]["peak_bpp"] < mem["ddp"]["peak_bpp"], arm
        assert mem[arm]["vs_ddp_states_entry"] < 1.0, arm
    # what each stage shards: optimizer states from ZeRO-1 on, parameters at ZeRO-3
    z0, z1, z2, z3 = (mem[a]["peak_parts_bpp"] for a in ("z0", "z1", "z2", "z3"))
    assert z1["optimizer"] == pytest.approx(z0["optimizer"] / 2, rel=0.02)
    assert z3["params"] < z2["params"] / 1.5
    comm = {r["arm"]: r for r in rows if r["type"] == "comm"}
    assert comm["ddp"]["ring_bytes"] > 0 and comm["z3"]["ring_vs_ddp"] > 0
    for arm in ("z1", "z2"):  # the device defaults reduce each gradient slice to its owner: DDP's volume, not 1.5x
        assert comm[arm]["ring_vs_ddp"] <= 1.05 * comm[arm]["theory_vs_ddp"], comm[arm]
        assert "reduce" in comm[arm]["calls"], comm[arm]["calls"]
    fits = {r["arm"] for r in rows if r["type"] == "rss_fit"}
    assert fits == {"ddp", "z0", "z1", "z2", "z3"}
    assert (out / "table.md").read_text().count("|") > 50


# ------------------------------------------------------------------------------------------ capacity (issue 27)
def test_capacity_search_finds_the_boundary_from_either_side() -> None:
    from capacity import Search

    for guess, boundary in ((10, 37), (80, 37), (37, 37), (1, 1)):
        search = Search(guess, limit=1000, tolerance=0.0)
        while (layers := search.next()) is not None:
            search.record(layers, layers <= boundary)
        assert (search.lo, search.hi) == (boundary, boundary + 1), (guess, boundary)
    capped = Search(5, limit=8, tolerance=0.05)
    while (layers := capped.next()) is not None:
        capped.record(layers, True)
    assert (capped.lo, capped.hi) == (8, None)  # reported as "at the search limit", not as a boundary


def test_capacity_refuses_to_measure_without_a_cgroup(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import capacity

    monkeypatch.setattr(capacity, "check_cgroups", lambda: "no memory cgroup controller: test")
    assert capacity.main(["--world", "2", "--out", str(tmp_path)]) == capacity.EXIT_NO_CGROUP
    assert "Not measuring" in capsys.readouterr().err and not list(tmp_path.iterdir())


@pytest.mark.multiprocess
def test_capacity_benchmark_runs_under_a_cap_and_writes_well_formed_rows(tmp_path: Path) -> None:
    """benchmarks/capacity.py at a tiny size: 2 ranks, DDP and ZeRO-3, each rank in its own memory cgroup; the
    cap binds (a trial over it is OOM-killed, none peaks above it), and the rows, table and CSV are well formed."""
    import capacity

    why = capacity.check_cgroups()
    if why:
        pytest.skip(f"no memory cgroup can be made here ({why}): the capacity benchmark refuses to run uncapped")
    out = tmp_path / "cap"
    job = run_job([sys.executable, str(REPO / "benchmarks" / "capacity.py"), "--world", "2", "--configs", "ddp", "z3",
                   "--cap", "300MiB", "--hidden", "1024", "--steps", "2", "--tolerance", "0.5", "--max-layers", "16",
                   "--out", str(out), "--no-readme"], timeout=900)
    assert job.returncode == 0, job.output[-3000:]
    lines = [json.loads(x) for x in (out / "capacity.jsonl").read_text().splitlines()]
    rows = {r["config"]: r for r in lines if r["type"] == "capacity"}
    assert set(rows) == {"ddp", "z3"} and all(r["world_size"] == 2 for r in rows.values())
    ddp = rows["ddp"]
    assert ddp["largest_layers"] >= 1 and (ddp["smallest_failing_layers"] or 0) > ddp["largest_layers"], ddp
    outcomes = {o for t in ddp["trials"] for o in t["outcomes"]}
    assert "oom" in outcomes and "ok" in outcomes, ddp["trials"]  # the cap binds: some size was OOM-killed
    for row in rows.values():
        assert all(0 < t["peak_bytes"] <= 300 * 2**20 for t in row["trials"]), row["trials"]
        assert 0 < row["baseline_peak_bytes"] < 300 * 2**20 and row["largest_layers"] >= 1 and not row["errors"]
        assert row["largest_params"] == row["largest_layers"] * (1024**2 + 1024) and row["planner_params"] > 0
    assert rows["z3"]["paper_ratio"] == pytest.approx(2.0) and rows["ddp"]["paper_ratio"] == pytest.approx(1.0)
    csv = (out / "capacity.csv").read_text().splitlines()
    assert csv[0].startswith("world_size,config,largest_params") and len(csv) == 3
    md = (out / "capacity.md").read_text()
    assert "| 2 | ZeRO-3 |" in md and "Planner given the cap less the 1-layer peak within 10%" in md


# ------------------------------------------------------------------------------------------ boundary (issue 43)
def test_boundary_search_brackets_the_smallest_cap_from_either_side() -> None:
    from boundary import CapSearch

    for guess, boundary in ((300, 170), (100, 170), (170, 170)):
        search = CapSearch(guess, floor=50, tolerance=0.02)
        while (cap := search.next()) is not None:
            search.record(cap, cap >= boundary)
        assert search.fails < boundary <= search.trains, (guess, search)
        assert search.trains - search.fails <= 0.02 * (search.trains - 50)
    never = CapSearch(100, floor=50, tolerance=0.02)
    while (cap := never.next()) is not None:
        never.record(cap, False)
    assert never.trains is None and never.fails <= 8 * 100  # gives up at 8x the guess: no boundary reported


def test_boundary_refuses_to_measure_without_a_cgroup(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import boundary

    monkeypatch.setattr(boundary, "check_cgroups", lambda: "no memory cgroup controller: test")
    assert boundary.main(["--out", str(tmp_path)]) == boundary.EXIT_NO_CGROUP
    assert "Not measuring" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_boundary_twins_own_bytes_are_negligible(tmp_path: Path) -> None:
    """The fixed cost is the tiny twin's boundary, its own bytes included, and comes off the model's: as the planner
    counts them they must be a small part of the model's (the GPT-2 twin at 128 positions held 2.5 MiB of
    activations, 5% of the model's bytes above its fixed cost)."""
    pytest.importorskip("transformers")
    import boundary

    s = boundary.Settings()
    for model, of_model in (("mlp", 50 * 2**20), ("gpt2", 45 * 2**20)):  # the least measured - fixed of any stage
        for row in boundary.planned(model, s, tmp_path, tiny=True):
            assert row["device_bytes"] < 0.01 * of_model, (model, row["label"], row["device_bytes"])

@pytest.mark.multiprocess
def test_boundary_benchmark_finds_where_a_stage_starts_to_fit_under_a_cap(tmp_path: Path) -> None:
    """benchmarks/boundary.py on issue 43's MLP at width 1024, ZeRO-0 and ZeRO-3, 2 ranks in memory cgroups: each search
    ends on a cap that trains just above one that is OOM-killed, above the tiny model's boundary, and the planner's
    rows are those `plan --json` prints for the model."""
    import boundary

    why = boundary.check_cgroups()
    if why:
        pytest.skip(f"no memory cgroup can be made here ({why}): the boundary benchmark refuses to run uncapped")
    out = tmp_path / "boundary"
    job = run_job([sys.executable, str(REPO / "benchmarks" / "boundary.py"), "--models", "mlp", "--stages", "0", "3",
                   "--mlp-width", "1024", "--steps", "2", "--tolerance", "0.2", "--out", str(out)], timeout=900)
    assert job.returncode == 0, job.output[-3000:]
    lines = [json.loads(x) for x in (out / "boundary.jsonl").read_text().splitlines()]
    rows = {r["stage"]: r for r in lines if r["type"] == "boundary"}
    assert set(rows) == {0, 3}
    plan = json.loads((out / "raw" / "plan-mlp.json").read_text())
    for stage, row in rows.items():
        assert row["planned_bytes"] == next(r["device_bytes"] for r in plan if r["stage"] == stage
                                            and not r["offload_optimizer"])
        assert 0 < row["fixed_bytes"] < row["failing_bytes"] < row["measured_bytes"], row
        outcomes = {o for t in row["trials"] for o in t["outcomes"]}
        assert "oom" in outcomes and "ok" in outcomes, row["trials"]  # the cap binds
        assert all(t["peak_bytes"] <= t["cap"] for t in row["trials"])
        assert row["bytes_error"] == row["planned_bytes"] / (row["measured_bytes"] - row["fixed_bytes"]) - 1
    assert "| mlp | ZeRO-3 |" in (out / "boundary.md").read_text()
