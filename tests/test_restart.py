"""Fault tolerance: ``spawn --max_restarts``, resuming from ``ckpt_path="last"``, and SIGTERM (preemption).

The unit tests check the arguments, the variable the ranks of a restart see, and which checkpoint "last" is among
hand-made complete and incomplete ones. The process tests run tests/jobs/restart_job.py under
``lightning-gaudi-ds spawn`` (torchrun, 2 ranks on gloo): once uninterrupted, and once with rank 1 SIGKILLed and
later every rank SIGTERMed, which must end with the same fp32 weights and every step run once after the last save.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_gaudi_ds import DistributedRunner
from lightning_gaudi_ds.checkpoint import resume
from lightning_gaudi_ds.cli import main
from lightning_gaudi_ds.launch import envvars, plan
from lightning_gaudi_ds.launch._proc import PREEMPTED_EXIT
from tests.procs import JOBS, REPO, run_job
from tests.test_checkpoint import fake_checkpoint

sys.path.insert(0, str(REPO / "benchmarks"))
import restart as restart_benchmark  # noqa: E402

RESTART_ENV, NUM_NODES_ENV = envvars.RESTART.name, envvars.NUM_NODES.name

SPAWN = [sys.executable, "-m", "lightning_gaudi_ds", "spawn", "--world_size", "2", "--master_port", "0"]


# ------------------------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_max_restarts_must_be_a_whole_number(value: object) -> None:
    with pytest.raises(ValueError, match=rf"max_restarts={value!r}: pass how many times .* whole number >= 0"):
        DistributedRunner(["t.py"], max_restarts=value)  # type: ignore[arg-type]


def test_cli_refuses_negative_max_restarts_before_starting(capsys: pytest.CaptureFixture) -> None:
    assert main(["spawn", "--world_size", "2", "--max_restarts", "-1", "no_such_script.py"]) == 2
    err = capsys.readouterr().err
    assert "max_restarts=-1" in err and "no_such_script" not in err and "torchrun" not in err


def test_every_rank_is_told_which_restart_it_is(tmp_path: Path) -> None:
    machine = plan.Machine(python="/py", mpirun="/opt/mpirun", as_root=False, cpus=1)
    assert plan.launch_env(plan.resolve(2), {}, tmp_path, "t", 1, machine)[RESTART_ENV] == "0"
    assert plan.launch_env(plan.resolve(2), {}, tmp_path, "t", 1, machine, restart=3)[RESTART_ENV] == "3"
    assert RESTART_ENV in plan._MPI_EXPORTS and RESTART_ENV in plan._DEEPSPEED_EXPORTS  # other hosts' ranks too
    assert resume.restart_count({RESTART_ENV: "2"}) == 2
    assert resume.restart_count({}) == 0 and resume.restart_count({RESTART_ENV: ""}) == 0
    with pytest.raises(envvars.EnvVarError, match=r"LIGHTNING_GAUDI_DS_RESTART='abc': pass .*a whole number >= 0"):
        resume.restart_count({RESTART_ENV: "abc"})  # not read as unset (issue 42)


def test_the_supervisor_tells_a_shim_from_a_launcher_that_starts_one() -> None:
    """SIGTERM to the runner goes to the rank shims (which pass it on once), not past them to the scripts: torchrun's
    command line names the shim too, and its children, the shims, are no shim's scripts."""
    from lightning_gaudi_ds.launch.plan import SHIM
    from lightning_gaudi_ds.launch.supervise import _is_shim

    assert _is_shim(["/py", "-u", SHIM, "train.py", "--x"])  # what torchrun and deepspeed's launch.py start
    assert _is_shim(["/py", SHIM, "train.py"])
    assert not _is_shim(["/py", "-u", "-m", "torch.distributed.run", "--nproc_per_node", "2", SHIM, "train.py"])
    assert not _is_shim(["/opt/mpirun", "-np", "2", "-x", "RANK", "/py", "-u", SHIM, "train.py"])
    assert not _is_shim(["/py", "-u", "train.py", SHIM])  # the script's argument, not the shim
    assert not _is_shim(["/py", "-u", "train.py"])


# ----------------------------------------------------------------------------------------------- min_nodes
def _hostfile(tmp_path: Path, *names: str, slots: int = 2) -> Path:
    path = tmp_path / "hostfile"
    path.write_text("".join(f"{name} slots={slots}\n" for name in names))
    return path


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"min_nodes": 0}, r"min_nodes=0: pass the fewest hosts .* whole number >= 1"),
    ({"min_nodes": True}, r"min_nodes=True: pass the fewest hosts"),
    ({"min_nodes": 4}, r"min_nodes=4, but hostfile .* lists 3 host\(s\); pass 1..3"),
    ({"min_nodes": 2, "max_restarts": 0}, r"min_nodes=2 applies when the job restarts, but max_restarts=0; pass"
                                          r" max_restarts >= 1"),
    ({"min_nodes": 1, "use_deepspeed": False, "node_rank": 0}, r"min_nodes=1 with node_rank=0: a runner started"
                                                                r" per node cannot leave other nodes out"),
    ({"min_nodes": 1, "hostfile": None, "world_size": 2}, r"min_nodes=1 needs a hostfile"),
])
def test_min_nodes_is_checked_before_anything_starts(tmp_path: Path, kwargs: dict, message: str) -> None:
    args = {"hostfile": _hostfile(tmp_path, "a", "b", "c"), "use_deepspeed": True, "max_restarts": 1, **kwargs}
    with pytest.raises(ValueError, match=message):
        DistributedRunner(["t.py"], **args)


def test_min_nodes_up_to_every_host_is_accepted(tmp_path: Path) -> None:
    hostfile = _hostfile(tmp_path, "a", "b", "c")
    for value in (1, 3):
        runner = DistributedRunner(["t.py"], hostfile=hostfile, use_mpi=True, max_restarts=2, min_nodes=value)
        assert runner.min_nodes == value and runner.world_size == 6


def test_cli_refuses_min_nodes_without_restarts_before_starting(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    hostfile = str(_hostfile(tmp_path, "a", "b"))
    assert main(["spawn", "--hostfile", hostfile, "--use_mpi", "--min_nodes", "1", "no_such_script.py"]) == 2
    err = capsys.readouterr().err
    assert "min_nodes=1 applies when the job restarts, but max_restarts=0" in err and "no_such_script" not in err


def test_select_hosts_leaves_out_the_unreachable_while_min_nodes_remain() -> None:
    from lightning_gaudi_ds.launch.hostfile import Host

    hosts = [Host("a", 2, 1), Host("b", 2, 2), Host("c", 2, 3)]
    choice = plan.select_hosts(hosts, {"b": "unreachable: ssh exited with 255"}, min_nodes=2)
    assert choice is not None and [h.name for h in choice.kept] == ["a", "c"] and choice.world_size == 4
    assert choice.left_out == ((hosts[1], "unreachable: ssh exited with 255"),)
    everyone = plan.select_hosts(hosts, {}, min_nodes=3)
    assert everyone is not None and everyone.kept == tuple(hosts) and not everyone.left_out
    assert plan.select_hosts(hosts, {"a": "x", "b": "y"}, min_nodes=2) is None  # one host left, two needed
    assert plan.select_hosts(hosts, {"a": "x", "b": "y"}, min_nodes=1).kept == (hosts[2],)  # type: ignore[union-attr]


@pytest.mark.parametrize("use_mpi", [False, True], ids=["pdsh", "mpirun"])
def test_a_restart_on_fewer_hosts_tells_the_ranks_how_many_nodes(tmp_path: Path, use_mpi: bool) -> None:
    spec = plan.resolve(hostfile=_hostfile(tmp_path, "a", "b", "c"), use_mpi=use_mpi, use_deepspeed=not use_mpi)
    assert spec.master_addr == "a" and spec.world_size == 6
    choice = plan.select_hosts(spec.hosts or (), {"a": "unreachable"}, min_nodes=1)
    assert choice is not None
    smaller = tmp_path / "smaller"
    smaller.write_text(plan.hostfile_text(choice.kept))
    shrunk = plan.shrink(spec, choice, smaller)
    assert (shrunk.world_size, shrunk.master_addr, shrunk.left_out, shrunk.hostfile) == (4, "b", ("a",), smaller)
    assert [(h.name, h.slots) for h in plan.parse_hostfile(smaller)] == [("b", 2), ("c", 2)]
    machine = plan.Machine(python="/py", mpirun="/opt/mpirun", as_root=False, cpus=1)
    env = plan.launch_env(shrunk, {NUM_NODES_ENV: "9"}, tmp_path, "t", 1, machine)
    assert env[NUM_NODES_ENV] == "2" and env["MASTER_ADDR"] == "b"
    assert NUM_NODES_ENV not in plan.launch_env(spec, {NUM_NODES_ENV: "9"}, tmp_path, "t", 1, machine)  # no stale one
    argv = plan.launch_argv(shrunk, ["t.py"], 1, machine)
    assert str(smaller) in argv
    if use_mpi:
        assert NUM_NODES_ENV in argv and "-np" in argv and argv[argv.index("-np") + 1] == "4"
    else:
        assert f"{NUM_NODES_ENV}=2" in plan.deepspeed_env_text(env)


def test_the_strategy_takes_the_runners_node_count() -> None:
    from lightning_gaudi_ds.launch.environments import launcher_num_nodes

    assert launcher_num_nodes(2, {NUM_NODES_ENV: "1"}) == 1
    assert launcher_num_nodes(2, {}) == 2  # no hosts left out: the Trainer's
    for bad in ("0", "two"):  # not read as unset (issue 42)
        with pytest.raises(envvars.EnvVarError, match=rf"LIGHTNING_GAUDI_DS_NUM_NODES='{bad}': pass .* >= 1"):
            launcher_num_nodes(2, {NUM_NODES_ENV: bad})


def test_a_trainer_for_two_nodes_runs_on_the_one_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """What mpirun's one remaining rank looks like to Lightning (no MPI seen in a world of 1, no LOCAL_RANK): the
    strategy still takes the runner's count, so Lightning's launcher would not start a second process."""
    import lightning as L

    from lightning_gaudi_ds import HPUDeepSpeedStrategy

    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(NUM_NODES_ENV, "1")
    trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=HPUDeepSpeedStrategy(stage=2),
                        logger=False, enable_progress_bar=False)
    assert (trainer.num_nodes, trainer.world_size) == (1, 1)
    assert trainer.strategy.distributed_sampler_kwargs["num_replicas"] == 1


@pytest.mark.parametrize("min_nodes", [1, 2])
def test_a_restart_leaves_out_what_the_probe_lost_or_does_not_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture, min_nodes: int
                                                                    ) -> None:
    """The restart loop with the probe and the job replaced (no process): b is lost; with min_nodes=1 the restart
    runs on a alone from a hostfile of its own, removed after; with min_nodes=2 it is not started."""
    from types import SimpleNamespace

    from lightning_gaudi_ds.launch import runner as runner_module
    from lightning_gaudi_ds.launch.supervise import Failure

    monkeypatch.setattr(runner_module, "probe_hosts", lambda hosts, launcher, timeout: {"b": "unreachable: ssh 255"})
    runner = DistributedRunner(["t.py"], hostfile=_hostfile(tmp_path, "a", "b"), use_deepspeed=True, max_restarts=1,
                               min_nodes=min_nodes)
    starts: list[plan.LaunchSpec] = []

    def run_one(user: list[str], index: int, attempt: int = 0) -> tuple[int, object]:
        starts.append(runner._attempt)
        assert runner._attempt.hostfile is not None and runner._attempt.hostfile.is_file()
        failure = Failure(None, 255, "host b (ranks 2-3) unreachable", None, ("b",)) if not attempt else None
        return (255 if not attempt else 0), SimpleNamespace(failure=failure, ended_at=0.0, signalled=False)

    monkeypatch.setattr(runner, "_run_one", run_one)
    code = runner.run()
    err = capsys.readouterr().err
    if min_nodes == 2:
        assert code == 255 and len(starts) == 1
        assert "restart 1 of 1: not started: 1 of 2 host(s) answer (b: unreachable: ssh 255), fewer than" \
               " min_nodes=2." in err and "attempt 1: the job failed: host b (ranks 2-3) unreachable" in err
        return
    assert code == 0 and [s.world_size for s in starts] == [4, 2] and starts[1].left_out == ("b",)
    assert [h.name for h in starts[1].hosts or ()] == ["a"] and starts[1].master_addr == "a"
    assert not starts[1].hostfile.exists() and runner._attempt is runner.spec  # type: ignore[union-attr]
    assert "restart 1: leaving out host b (2 rank(s)): its ranks were the ones lost; unreachable: ssh 255." in err
    assert "restart 1: 1 of 2 hosts remain (min_nodes=1): a; world size 4 -> 2, num_nodes 2 -> 1" in err


def test_probe_names_the_hosts_that_do_not_answer(tmp_path: Path) -> None:
    """With a stand-in ``ssh`` on PATH (the only process this starts): the launcher's ssh options and the time-out
    reach it, and a non-zero exit is an unreachable host, with ssh's last line."""
    from lightning_gaudi_ds.launch.hostfile import Host
    from lightning_gaudi_ds.launch.runner import probe_hosts

    ssh = tmp_path / "ssh"
    ssh.write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/calls"\n'
                   'case "$*" in *down*) echo "ssh: connect to host down: No route to host" >&2; exit 255;; esac\n')
    ssh.chmod(0o755)
    env = {"PATH": str(tmp_path), "PDSH_SSH_ARGS_APPEND": "-o ServerAliveInterval=2"}
    hosts = [Host("localhost", 1, 1), Host("up", 1, 2), Host("down", 1, 3)]
    assert probe_hosts(hosts, "deepspeed", 7, env) == {
        "down": "unreachable: ssh exited with 255 (ssh: connect to host down: No route to host)"}
    calls = sorted((tmp_path / "calls").read_text().splitlines())
    assert calls == [f"-o ServerAliveInterval=2 -o BatchMode=yes -o ConnectTimeout=7 {name} true"
                     for name in ("down", "up")]  # this host is not probed


# --------------------------------------------------------------------------------------- ckpt_path="last"
def _trainer(dirpath: Path):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.trainer.states import TrainerFn

    from lightning_gaudi_ds import HPUDeepSpeedStrategy

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HPUDeepSpeedStrategy(stage=2), logger=False,
                        enable_progress_bar=False, callbacks=[ModelCheckpoint(dirpath=str(dirpath), save_last=True)])
    model = L.LightningModule()
    model.trainer = trainer  # what Trainer.fit does (attach_data) before _run connects the strategy
    trainer.state.fn = TrainerFn.FITTING
    trainer.strategy.connect(model)
    return trainer


def test_last_is_the_newest_complete_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.trainer.states import TrainerFn

    monkeypatch.delenv(RESTART_ENV, raising=False)
    complete = fake_checkpoint(tmp_path, name="last.ckpt")
    time.sleep(0.05)
    shard = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    newer_incomplete = fake_checkpoint(tmp_path, name="last-v1.ckpt", skip=(shard,))
    fake_checkpoint(tmp_path, name="last-v2.ckpt.partial", latest=False)  # a save in progress
    os.utime(newer_incomplete, (time.time() + 60, time.time() + 60))
    trainer = _trainer(tmp_path)
    # Lightning alone takes the newest last*.ckpt, a half-written one
    lightning = trainer._checkpoint_connector._parse_ckpt_path(TrainerFn.FITTING, "last", True, False)
    assert lightning == str(newer_incomplete)
    with pytest.warns(UserWarning, match=r"skipping an incomplete checkpoint, .*last-v1\.ckpt"):
        assert resume.resolve_ckpt_path(trainer, lightning) == str(complete)
    assert resume.resolve_ckpt_path(trainer, str(complete)) == str(complete)  # a complete one: as given
    assert resume.resolve_ckpt_path(trainer, None) is None  # no restart: as Lightning
    monkeypatch.setenv(RESTART_ENV, "1")  # a restart: fit without ckpt_path resumes
    with pytest.warns(UserWarning, match="skipping"):
        assert resume.resolve_ckpt_path(trainer, None) == str(complete)
    trainer.state.fn = TrainerFn.VALIDATING
    assert resume.resolve_ckpt_path(trainer, None) is None  # only fit resumes
    candidates = [str(p) for p in tmp_path.iterdir()]
    assert resume.newest_complete(candidates)[0] == str(complete)


def test_last_on_a_first_run_is_lightnings_message_not_an_error(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the hook that ``strategy.connect`` puts on the Trainer's restore (``resume_start``)."""
    monkeypatch.setenv(RESTART_ENV, "1")
    trainer = _trainer(tmp_path / "none_yet")
    connector = trainer._checkpoint_connector
    with pytest.warns(UserWarning, match="there is no last checkpoint available. No checkpoint will be loaded"):
        connector.resume_start(None)
    assert trainer.ckpt_path is None
    fake_checkpoint(tmp_path / "none_yet", name="last.ckpt", skip=("mp_rank_00_model_states.pt",))
    with pytest.warns(UserWarning, match="no complete checkpoint to resume from"):
        connector.resume_start(str(tmp_path / "none_yet" / "last.ckpt"))
    assert trainer.ckpt_path is None


def _cut_before_rename(folder: Path, name: str) -> Path:
    """A save of ``name`` that died between its manifest and its rename: a complete ``<name>.partial``."""
    from lightning_gaudi_ds.checkpoint import io

    final = folder / name
    io.commit_save(fake_checkpoint(folder, name=name + ".partial"), final, zero_stage=2, world_size=2)
    final.rename(io.partial_path(final))
    return final


def test_last_adopts_a_complete_save_cut_short_before_its_rename(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RESTART_ENV, raising=False)
    folder = tmp_path / "ckpts"
    final = _cut_before_rename(folder, "last.ckpt")
    cut_short = fake_checkpoint(folder, name="last-v3.ckpt.partial", latest=False)  # no manifest: not adopted
    trainer = _trainer(folder)
    # Lightning lists no "last" (only *.partial there): ckpt_path=None, or "last" resolved to None
    with pytest.warns(UserWarning, match=r"last\.ckpt\.partial was a complete checkpoint whose save stopped before"
                                         r" its rename \(its manifest verifies\): renamed to .*last\.ckpt\. This fit"
                                         r' starts without it .*pass ckpt_path="last"'):
        assert resume.resolve_ckpt_path(trainer, None) is None
    assert final.is_dir() and not (folder / "last.ckpt.partial").exists() and cut_short.is_dir()
    assert resume.resolve_ckpt_path(trainer, str(final)) == str(final)  # now Lightning's "last"

    # a restart (or "last" that Lightning resolved to an older one) resumes from it when it is the newest
    again = _cut_before_rename(tmp_path / "again", "last.ckpt")
    older = fake_checkpoint(tmp_path / "again", name="last-v1.ckpt")
    os.utime(older, (time.time() - 60, time.time() - 60))
    trainer = _trainer(tmp_path / "again")
    assert resume.resolve_ckpt_path(trainer, str(older)) == str(again) and again.is_dir()
    third = _cut_before_rename(tmp_path / "third", "last.ckpt")
    monkeypatch.setenv(RESTART_ENV, "1")
    assert resume.resolve_ckpt_path(_trainer(tmp_path / "third"), None) == str(third)


# ------------------------------------------------------------------------------------------- process tests
STEPS = 10


def spawn_job(out: Path, spawn_args: tuple[str, ...] = (), job_args: tuple[str, ...] = (), timeout: float = 600):
    return run_job([*SPAWN, *spawn_args, str(JOBS / "restart_job.py"), "--out", str(out), "--steps", str(STEPS),
                    *job_args], timeout=timeout)


def reference_job(out: Path, job_args: tuple[str, ...] = (), timeout: float = 600):
    """The uninterrupted run a restart is compared with: no launcher under test, so its 2 ranks start warm."""
    return run_job([sys.executable, str(JOBS / "restart_job.py"), "--out", str(out), "--steps", str(STEPS),
                    *job_args], timeout=timeout, ranks=2)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory):
    """Attempt 0: rank 1 SIGKILLs itself at step 5 (last save: step 4). Attempt 1: SIGTERM reaches the ranks at
    different steps (rank 1 in step 5, rank 0 in step 6); they agree at the start of step 6, which ends, and save at
    that boundary (step 7) and exit 75. Attempt 2 runs to the end."""
    out = tmp_path_factory.mktemp("interrupted")
    result = spawn_job(out, ("--max_restarts", "2"),
                       ("--kill", "0:5:1:KILL", "--kill", "1:5:1:TERM", "--kill", "1:6:0:TERM"))
    return out, result


@pytest.mark.multiprocess
def test_restarts_resume_exactly(interrupted, tmp_path: Path) -> None:
    out, result = interrupted
    result.check()
    text = result.output
    assert "rank 1 failed: exited with signal SIGKILL" in text
    assert f"exited with exit code {PREEMPTED_EXIT} (preempted: SIGTERM, checkpoint saved)" in text
    assert "restart 1 of 2" in text and "restart 2 of 2" in text and "the job completed after 2 restart(s)" in text
    steps = {a: json.loads((out / f"attempt{a}-rank0.json").read_text()) for a in range(3)}
    assert steps[0]["steps"] == [0, 1, 2, 3, 4, 5] and steps[0]["resumed_from"] is None
    last = str(out / "ckpt" / "last.ckpt")
    assert steps[1]["steps"] == [4, 5, 6] and steps[1]["resumed_from"] == last  # the save at step 4
    # SIGTERM seen by all at step 6: step 6 ends, the checkpoint is taken at that boundary, no step twice or lost
    assert f"SIGTERM: saved {last} at step 7; exiting with {PREEMPTED_EXIT}" in text
    assert steps[2]["steps"] == [7, 8, 9] and steps[2]["resumed_from"] == last and steps[2]["global_step"] == STEPS
    assert json.loads((out / "attempt2-rank1.json").read_text())["steps"] == [7, 8, 9]

    reference = tmp_path / "reference"
    reference_job(reference).check()
    expected, got = torch.load(reference / "weights.pt"), torch.load(out / "weights.pt")
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)
    # benchmarks/restart.py's figures of this run (its own --tiny run costs three more job start-ups)
    figures = restart_benchmark.measure(out, reference)
    assert (figures["failed_in_step"], figures["resumed_at_step"], figures["steps_lost"]) == (5, 4, 1)
    assert 0 < figures["failure_to_processes_s"] < figures["failure_to_first_step_s"] < 300
    assert figures["max_abs_diff"] <= 1e-6


FAILING = """
import os, sys, time
if os.environ["RANK"] == "1":
    sys.exit(3)
time.sleep(60)
"""


@pytest.mark.multiprocess
def test_exhausted_restarts_name_every_failure(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(FAILING)
    result = run_job([*SPAWN, "--max_restarts", "1", str(script)], timeout=300)
    assert result.returncode == 3, result.output[-3000:]
    assert "max_restarts=1 exhausted; the job failed 2 times:" in result.output
    assert "attempt 1: rank 1 failed: exited with exit code 3" in result.output
    assert "attempt 2: rank 1 failed: exited with exit code 3" in result.output


STOP_TIMEOUT_S = 300  # the runner's grace in the SIGTERM test: never the bound (the test's own is, see there)


@pytest.mark.multiprocess
def test_sigterm_to_the_runner_saves_and_exits_75(tmp_path: Path) -> None:
    """What Kubernetes and SLURM do: SIGTERM to the job's processes, here the runner, which passes it on."""
    from lightning_gaudi_ds.checkpoint import validate_checkpoint
    from tests.procs import LiveJob

    # What SIGTERM starts here (the step under way, a save, the ranks' exit) takes 1-3 s on an idle machine, and
    # crossed the runner's default grace (10 s, then SIGKILL: exit 143) at load 18. That grace is the user's setting
    # (its SIGKILL is tested with --stop_timeout 5 in tests/test_launch_e2e.py); here the runner waits as long as the
    # test does, and the test's bound comes from this run: the job's start until step 3 (start-up, 4 steps and a
    # save, under the same load) is more work than the stop, so twice that time leaves headroom for twice the load.
    args = [*SPAWN, "--stop_timeout", str(STOP_TIMEOUT_S), str(JOBS / "restart_job.py"), "--out", str(tmp_path),
            "--steps", "1000"]
    job = LiveJob(args)
    try:
        ready_s = job.wait_for("step 3 rank 1", timeout=400) - job.start
        job.send_signal(signal.SIGTERM)
        result = job.wait(timeout=min(2 * ready_s, STOP_TIMEOUT_S) + 10)  # + the runner's own exit
    finally:
        if job.proc.poll() is None:
            job.kill()
    assert result.returncode == PREEMPTED_EXIT, result.output[-3000:]
    assert f"every rank saved a checkpoint and exited with {PREEMPTED_EXIT} (preempted)" in result.output
    saved = int(result.output.split("SIGTERM: saved ")[1].split(" at step ")[1].split(";")[0])
    last_step = json.loads((tmp_path / "attempt0-rank0.json").read_text())["steps"][-1]
    assert saved == last_step + 1  # the step under way when SIGTERM came ended, then the save: none lost
    assert validate_checkpoint(tmp_path / "ckpt" / "last.ckpt").has_manifest
