"""The package's environment variables, read in one place (lightning_gaudi_ds/launch/envvars.py): a bad value is an
error naming the variable, the value and what is allowed, given before anything starts (issue 42)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest

from lightning_gaudi_ds import HPUDeepSpeedStrategy
from lightning_gaudi_ds.cli import main
from lightning_gaudi_ds.launch import DistributedRunner, envvars, plan
from tests.procs import job_env

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "lightning_gaudi_ds" / "launch"


@pytest.mark.parametrize(
    ("var", "text", "value"),
    [
        (envvars.STOP_TIMEOUT, "0", 0.0),
        (envvars.LINK_TIMEOUT, "9", 9.0),
        (envvars.RESTART, "3", 3),
        (envvars.NUM_NODES, " 2 ", 2),
        (envvars.RENDEZVOUS_TIMEOUT, "30", 30.0),
        (envvars.SHM_COMM, " ON ", "on"),
        (envvars.RUN_DIR, "/tmp/run", "/tmp/run"),
    ],
)
def test_values_are_parsed_and_unset_is_the_default(var: envvars.EnvVar, text: str, value: object) -> None:
    assert envvars.read(var, {var.name: text}) == value
    assert envvars.read(var, {}) == var.default and envvars.read(var, {var.name: ""}) == var.default


@pytest.mark.parametrize(
    ("var", "text", "allowed"),
    [
        (envvars.LINK_TIMEOUT, "abc", "a number > 0"),
        (envvars.LINK_TIMEOUT, "0", "a number > 0"),
        (envvars.STOP_TIMEOUT, "-1", "a number >= 0"),
        (envvars.STOP_TIMEOUT, "nan", "a number >= 0"),
        (envvars.RESTART, "abc", "a whole number >= 0"),
        (envvars.RESTART, "1.5", "a whole number >= 0"),
        (envvars.NUM_NODES, "two", "a whole number >= 1"),
        (envvars.NUM_NODES, "0", "a whole number >= 1"),
        (envvars.RENDEZVOUS_TIMEOUT, "inf", "a number > 0"),
        (envvars.SHM_COMM, "yes", "one of off, on"),
    ],
)
def test_a_bad_value_names_the_variable_the_value_and_what_is_allowed(var: envvars.EnvVar, text: str,
                                                                      allowed: str) -> None:
    with pytest.raises(envvars.EnvVarError) as err:
        envvars.read(var, {var.name: text})
    assert isinstance(err.value, ValueError)
    assert str(err.value).startswith(f"{var.name}={text!r}: pass ") and allowed in str(err.value)
    assert "or unset it" in str(err.value)
    with pytest.raises(envvars.EnvVarError, match=var.name):
        envvars.check({var.name: text})


def test_every_package_variable_is_listed_once() -> None:
    names = [var.name for var in envvars.ALL]
    assert len(set(names)) == len(names) and all(name.startswith("LIGHTNING_GAUDI_DS_") for name in names)
    found = set()
    for path in (REPO / "lightning_gaudi_ds").rglob("*.py"):
        if path.name != "envvars.py":
            text = path.read_text()
            found |= {name for name in names if f'"{name}"' in text}
    assert found == set(), f"a variable's name is spelled out again outside envvars.py: {sorted(found)}"
    docs = (REPO / "docs" / "launching.md").read_text()
    assert all(f"| `{name}`" in docs for name in names), "docs/launching.md's table lists every variable"


@pytest.mark.parametrize("key", ["LIGHTNING_GAUDI_DS_LINK_TIMEOUT", "LIGHTNING_GAUDI_DS_SHM_COMM",
                                 "LIGHTNING_GAUDI_DS_STOP_TIMEOUT"])
def test_the_runner_refuses_a_bad_variable_before_anything_starts(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture, key: str) -> None:
    monkeypatch.setenv(key, "abc")
    with pytest.raises(ValueError, match=rf"{key}='abc': pass "):
        DistributedRunner(["train.py"], world_size=2)
    assert main(["spawn", "--world_size", "2", "no_such_script.py"]) == 2
    err = capsys.readouterr().err
    assert f"error: {key}='abc'" in err and "torchrun" not in err and "no_such_script" not in err


@pytest.mark.multiprocess
def test_the_rank_shim_reads_the_same_variables_and_starts_no_script(tmp_path: Path) -> None:
    """The shim (stdlib only, run by path) parses with envvars too: a rank started some other way with a bad value
    says which variable, and its script never runs."""
    marker = tmp_path / "ran"
    script = tmp_path / "t.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = {"PATH": "/usr/bin:/bin", envvars.RUN_DIR.name: str(tmp_path / "run"), envvars.LINK_TIMEOUT.name: "abc",
           "RANK": "1"}
    done = subprocess.run([sys.executable, str(LAUNCH / "rank.py"), str(script)], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "rank 1: error: LIGHTNING_GAUDI_DS_LINK_TIMEOUT='abc': pass " in done.stderr
    assert "Traceback" not in done.stderr
    assert not marker.exists() and not (tmp_path / "run").exists()


@pytest.mark.multiprocess
def test_the_rank_shim_imports_envvars_without_the_package() -> None:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import rank; "
            "print(sorted(m for m in sys.modules if m.startswith(('lightning', 'torch'))))")
    done = subprocess.run([sys.executable, "-c", code, str(LAUNCH)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


@pytest.mark.parametrize(("key", "value"), [("LIGHTNING_GAUDI_DS_RESTART", "abc"),
                                            ("LIGHTNING_GAUDI_DS_NUM_NODES", "two")])
def test_the_trainer_refuses_a_bad_variable_at_construction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            key: str, value: str) -> None:
    """Read as unset before (issue 42): a restart count or node count that is not one is refused, naming it."""
    monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=rf"{key}='{value}': pass .*whole number"):
        L.Trainer(accelerator="cpu", devices=1, strategy=HPUDeepSpeedStrategy(stage=2), default_root_dir=tmp_path,
                  logger=False)


def test_torchrun_keeps_its_logs_in_the_run_directory(tmp_path: Path) -> None:
    """Without --log-dir torchrun leaves an empty torchelastic_* tree in the system's temp directory on every launch."""
    from torch.distributed.run import get_args_parser

    runner = DistributedRunner(["train.py"], world_size=2)
    args = get_args_parser().parse_args(runner.build_command(runner.commands[0], run_dir=tmp_path)[4:])
    assert args.log_dir == str(tmp_path / plan.TORCHRUN_LOG_NAME)


@pytest.mark.multiprocess
def test_a_torchrun_spawn_leaves_nothing_in_the_temp_directory(tmp_path: Path) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    script = tmp_path / "t.py"
    # one write per rank: two ranks' print() pieces interleave on the shared pipe ('rankrank 0\n 1\n' seen in CI)
    script.write_text("import os; os.write(1, f\"rank {os.environ['RANK']}\\n\".encode())\n")
    env = job_env({"TMPDIR": str(temp)})
    done = subprocess.run([sys.executable, "-m", "lightning_gaudi_ds", "spawn", "--world_size", "2", "--master_port",
                           "0", str(script)], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 0" in done.stdout and "rank 1" in done.stdout
    assert sorted(p.name for p in temp.iterdir()) == []
