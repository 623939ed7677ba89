"""Benchmark scripts (issue 42): every flag is checked before any work starts (argparse's own error, exit code 2),
and a run that fails leaves the results folder as it was (benchmarks/publish.py)."""

from __future__ import annotations

import importlib
import json
import stat
import sys
import tempfile
from pathlib import Path

import lightning  # noqa: F401  (its import sets two torch variables: before the tests, which check os.environ)
import pytest

from tests.procs import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import publish  # noqa: E402

COMMITTED = REPO / "benchmarks" / "results"


@pytest.mark.parametrize(
    ("script", "argv", "flag"),
    [
        ("capacity", ["--hidden", "0"], "--hidden"),
        ("capacity", ["--cap", "lots"], "--cap"),
        ("capacity", ["--tolerance", "0"], "--tolerance"),
        ("capacity", ["--steps", "-1"], "--steps"),
        ("capacity", ["--trial-timeout", "nan"], "--trial-timeout"),
        ("capacity", ["--mmap-threshold", "0"], "--mmap-threshold"),
        ("capacity", ["--world", "two"], "--world"),
        ("sequence", ["--cap", "lots"], "--cap"),
        ("sequence", ["--sizes", "1", "3"], "--sizes"),
        ("sequence", ["--hidden", "100"], "--hidden"),
        ("sequence", ["--steps", "0"], "--steps"),
        ("sequence", ["--tolerance", "1"], "--tolerance"),
        ("sequence", ["--world", "two"], "--world"),
        ("boundary", ["--world", "1"], "--world"),
        ("boundary", ["--tolerance", "2"], "--tolerance"),
        ("boundary", ["--mlp-width", "0"], "--mlp-width"),
        ("boundary", ["--stages", "4"], "--stages"),
        ("boundary", ["--models", "gpt3"], "--models"),
        ("planner", ["--hidden", "0"], "--hidden"),
        ("planner", ["--timeout", "-5"], "--timeout"),
        ("recipes", ["--steps", "0"], "--steps"),
        ("recipes", ["--timeout", "inf"], "--timeout"),
        ("restart", ["--every", "0"], "--every"),
        ("restart", ["--tag", "../elsewhere"], "--tag"),
        ("startup", ["--iters", "5"], "--iters"),
        ("startup", ["--sizes", "1024,lots"], "--sizes"),
        ("startup", ["--rounds", "0"], "--rounds"),
        ("compile_speed", ["--steps", "0"], "--steps"),
        ("compile_speed", ["--hidden", "-8"], "--hidden"),
        ("tp_inference", ["--heads", "0"], "--heads"),
        ("tp_inference", ["--new-tokens", "0"], "--new-tokens"),
        ("run_all", ["--hidden", "0"], "--hidden"),
        ("run_all", ["--speed-measured", "0"], "--speed-measured"),
        ("run_all", ["--cases", "(unclosed"], "--cases"),
        ("spread", ["a.jsonl", "b.jsonl"], "run1"),
        ("wire", ["--steps", "0"], "--steps"),
        ("wire", ["--hidden", "8"], "--hidden"),
        ("hardware", ["--seconds", "0"], "--seconds"),
        ("steptime", ["--speed", "no/such/results.jsonl"], "--speed"),
        ("suite", ["no/such/folder"], "folder"),
    ],
)
def test_a_bad_flag_is_refused_before_any_work(script: str, argv: list[str], flag: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    before = sorted(COMMITTED.rglob("*"))
    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as exit_:
        module.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: " in err and ("is not allowed" in err or "not a" in err
                                                   or "does not exist" in err), err
    assert "Traceback" not in err and sorted(COMMITTED.rglob("*")) == before and not list(tmp_path.iterdir())


def test_boundary_report_only_on_an_empty_folder_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import boundary

    assert boundary.main(["--report-only", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"no results to report in {tmp_path} (no boundary.jsonl)" in err and "Run boundary.py first" in err
    assert not list(tmp_path.iterdir())


def test_capacity_report_only_on_an_empty_folder_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import capacity

    assert capacity.main(["--report-only", "--no-readme", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"no results to report in {tmp_path} (no capacity.jsonl)" in err and "Run capacity.py first" in err
    assert not list(tmp_path.iterdir())


def test_sequence_report_only_on_an_empty_folder_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import sequence

    assert sequence.main(["--report-only", "--no-readme", "--out", str(tmp_path)]) == 2
    assert f"no results to report in {tmp_path} (no sequence.jsonl)" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_sequence_report_is_rebuilt_from_the_committed_rows(tmp_path: Path) -> None:
    """The committed table is what --report-only makes of the committed rows (K = 2 at least 1.8x K = 1's longest)."""
    import sequence

    (tmp_path / "sequence.jsonl").write_bytes((COMMITTED / "sequence" / "sequence.jsonl").read_bytes())
    assert sequence.main(["--report-only", "--no-readme", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "sequence.md").read_text()
    assert table == (COMMITTED / "sequence" / "sequence.md").read_text()
    assert "K = 2 trains sequences" in table and "(goal >= 1.8) ✓" in table


def test_sequence_refuses_to_measure_without_a_cgroup(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import sequence

    monkeypatch.setattr(sequence, "check_cgroups", lambda: "no memory cgroup controller: test")
    assert sequence.main(["--world", "2", "--sizes", "1", "2", "--out", str(tmp_path)]) == sequence.EXIT_NO_CGROUP
    assert "Not measuring" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_a_capacity_report_that_fails_leaves_the_last_results_as_they_were(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import capacity

    for name in ("capacity.jsonl", "capacity.md"):
        (tmp_path / name).write_bytes((COMMITTED / "capacity" / name).read_bytes())
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def broken_chart(rows: object, path: Path) -> None:
        raise RuntimeError("the chart failed")

    monkeypatch.setattr(capacity, "chart", broken_chart)  # after the table and the CSV were written
    with pytest.raises(RuntimeError, match="the chart failed"):
        capacity.main(["--report-only", "--no-readme", "--out", str(tmp_path)])
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no .csv, the .md untouched, no staging


def test_a_recipe_run_with_a_failure_writes_no_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    import recipes

    kept_root = tmp_path / "system-temp"  # the failed run's files are kept in the system's temp folder: this test's
    kept_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(kept_root))
    out = tmp_path / "results"
    out.mkdir()
    (out / "recipes.jsonl").write_text('{"type": "meta", "started": "then", "steps": 3}\n')
    monkeypatch.setattr(recipes, "run_recipe", lambda name, *a: {"recipe": name, "ok": False, "error": "boom"})
    assert recipes.main(["--only", "zero1_bf16", "--steps", "3", "--out", str(out)]) == 1
    assert [p.name for p in out.iterdir()] == ["recipes.jsonl"]
    assert (out / "recipes.jsonl").read_text() == '{"type": "meta", "started": "then", "steps": 3}\n'
    err = capsys.readouterr().err
    assert "recipe(s) failed: zero1_bf16: no results written" in err and "This run's files are in" in err
    kept = Path(err.split("This run's files are in ")[1].split()[0].rstrip("."))
    assert kept.parent == kept_root
    assert sorted(p.name for p in kept.iterdir()) == ["recipes.jsonl", "recipes.md"]


def test_staged_results_replace_the_old_ones_only_on_success(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("old\n")
    with pytest.raises(ValueError), publish.staged(tmp_path) as stage:
        (stage.path / "a.jsonl").write_text("half")
        raise ValueError("the run failed")
    assert [p.name for p in tmp_path.iterdir()] == ["a.jsonl"] and (tmp_path / "a.jsonl").read_text() == "old\n"
    with publish.staged(tmp_path) as stage:
        (stage.path / "a.jsonl").write_text("new\n")
        (stage.path / "b.md").write_text("table\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.md"]
    assert (tmp_path / "a.jsonl").read_text() == "new\n"


def test_write_text_and_append_text_replace_the_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "r.jsonl"
    publish.write_text(path, json.dumps({"a": 1}) + "\n")
    publish.append_text(path, json.dumps({"b": 2}) + "\n")
    assert path.read_text() == '{"a": 1}\n{"b": 2}\n'
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 and [p.name for p in path.parent.iterdir()] == ["r.jsonl"]
