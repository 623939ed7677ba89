"""Tests of the launcher: hostfile parsing, the commands and environment each launcher gets, ports, the CLI, how
the strategy recognises externally launched processes, and (marked ``multiprocess``) the runner and its rank shim
with tiny stdlib-only scripts."""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
import time
from pathlib import Path

import pytest
from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment

from lightning_gaudi_ds.launch import (
    DistributedRunner,
    HostfileError,
    parse_hostfile,
    parse_hostfile_text,
    plan,
)
from lightning_gaudi_ds.launch import rank as rank_shim
from lightning_gaudi_ds.launch import runner as runner_module
from lightning_gaudi_ds.launch import _proc
from lightning_gaudi_ds.launch._proc import MPI_RANK_KEYS, MPI_SIZE_KEYS, free_port, port_in_use
from lightning_gaudi_ds.launch.environments import (
    DeepSpeedLauncherEnvironment,
    check_launcher_world_size,
    resolve_environment,
)

SHIM = str(Path(rank_shim.__file__).resolve())


def write(tmp_path: Path, text: str, name: str = "hostfile") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --------------------------------------------------------------------------------------------- hostfile
def test_hostfile_comments_blank_lines_and_order() -> None:
    hosts = parse_hostfile_text("# cluster\n\nworker-0 slots=8\n  worker-1   slots=4  \n#worker-2 slots=8\n")
    assert [(h.name, h.slots, h.line) for h in hosts] == [("worker-0", 8, 3), ("worker-1", 4, 4)]


def test_hostfile_agrees_with_deepspeeds_parser() -> None:
    from deepspeed.launcher.runner import _parse_hostfile

    text = "# c\nnode-a slots=2\n\nnode-b slots=3\n"
    ours = {h.name: h.slots for h in parse_hostfile_text(text)}
    assert ours == dict(_parse_hostfile(text.splitlines(keepends=True)))


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("a slots=1\nb\n", 2, ["'b'", "not a host entry", "hostname slots=N"]),
        ("a slots=1\nb slots=2 extra\n", 2, ["not a host entry"]),
        ("a slots=1\nb slots=x\n", 2, ["slots='x'", "whole number"]),
        ("a slots=1\n\nb slots=0\n", 3, ["slots=0", "at least 1 slot"]),
        ("a slots=1\nb slots=-2\n", 2, ["slots=-2", "at least 1 slot"]),
        ("a slots=1\nb slots=1\na slots=2\n", 3, ["'a' is listed again (first on line 1)"]),
        ("a gpus=1\n", 1, ["not a host entry"]),
    ],
)
def test_hostfile_errors_name_the_line(text: str, line: int, words: list[str]) -> None:
    with pytest.raises(HostfileError) as err:
        parse_hostfile_text(text, source="hf")
    message = str(err.value)
    assert message.startswith(f"hf:{line}:"), message
    for word in words:
        assert word in message


def test_hostfile_empty_or_missing(tmp_path: Path) -> None:
    with pytest.raises(HostfileError, match="lists no hosts"):
        parse_hostfile(write(tmp_path, "# nothing\n\n"))
    with pytest.raises(HostfileError, match="cannot read hostfile .*nope"):
        parse_hostfile(tmp_path / "nope")


# ---------------------------------------------------------------------------------- command construction
def test_world_size_one_is_plain_python() -> None:
    runner = DistributedRunner(["train.py --lr 0.1"])
    assert runner.launcher == "python"
    assert runner.build_command(runner.commands[0]) == [sys.executable, "-u", SHIM, "train.py", "--lr", "0.1"]


def test_only_an_interpreter_is_dropped_from_a_command() -> None:
    assert DistributedRunner(["python3.11 t.py"]).commands == [["t.py"]]
    assert DistributedRunner(["python_train.py --a"]).commands == [["python_train.py", "--a"]]


def test_commands_are_split_with_shlex_never_a_shell() -> None:
    runner = DistributedRunner(["python train.py --name 'a b' 'x;rm -rf /' $HOME `id`"], world_size=2)
    cmd = runner.build_command(runner.commands[0])
    assert cmd[-6:] == ["train.py", "--name", "a b", "x;rm -rf /", "$HOME", "`id`"]  # literal, unexpanded
    assert "python" not in cmd[cmd.index(SHIM) + 1:]  # the launcher supplies the interpreter


def test_torchrun_command_parses_as_intended() -> None:
    from torch.distributed.run import get_args_parser

    runner = DistributedRunner(["train.py --devices 2"], world_size=2, master_port=29611, master_addr="10.0.0.5")
    cmd = runner.build_command(runner.commands[0])
    assert cmd[:4] == [sys.executable, "-u", "-m", "torch.distributed.run"]
    args = get_args_parser().parse_args(cmd[4:])
    assert (args.nproc_per_node, args.nnodes, args.node_rank) == ("2", "1", 0)
    assert (args.master_addr, args.master_port, args.max_restarts) == ("10.0.0.5", 29611, 0)
    assert args.training_script == SHIM and args.training_script_args == ["train.py", "--devices", "2"]


def _deepspeed_args(cmd: list[str]):
    from deepspeed.launcher.runner import parse_args

    assert cmd[:4] == [sys.executable, "-u", "-m", "deepspeed.launcher.runner"]
    return parse_args(cmd[4:])


def test_deepspeed_single_node_command() -> None:
    runner = DistributedRunner(["train.py --x 1"], world_size=4, use_deepspeed=True, master_port=29612)
    args = _deepspeed_args(runner.build_command(runner.commands[0]))
    assert args.no_local_rank and (args.num_gpus, args.num_nodes, args.master_port) == (4, 1, 29612)
    assert args.hostfile == "/job/hostfile"  # DeepSpeed's default: absent, so it launches locally
    assert args.user_script == SHIM and args.user_args == ["train.py", "--x", "1"]


def test_deepspeed_multi_node_command_through_deepspeeds_pdsh_runner(tmp_path: Path) -> None:
    """The command DeepSpeed's multi-node runner would run over pdsh/ssh (neither is usable on this machine)."""
    from deepspeed.launcher.multinode_runner import PDSHRunner
    from deepspeed.launcher.runner import encode_world_info, fetch_hostfile, parse_inclusion_exclusion

    hostfile = write(tmp_path, "node-a slots=2\nnode-b slots=2\n")
    runner = DistributedRunner(["train.py"], hostfile=hostfile, use_deepspeed=True, master_port=29613)
    assert runner.world_size == 4 and runner.master_addr == "node-a"
    cmd = runner.build_command(runner.commands[0])
    args = _deepspeed_args(cmd)
    assert args.hostfile == str(hostfile.resolve()) and args.master_addr == "node-a" and not args.no_ssh_check
    active = parse_inclusion_exclusion(fetch_hostfile(args.hostfile), args.include, args.exclude)
    pdsh_cmd, _, _ = PDSHRunner(args, encode_world_info(active)).get_cmd(dict(os.environ), active)
    text = " ".join(pdsh_cmd)
    assert pdsh_cmd[0] == "pdsh" and "-w node-a,node-b" in text
    assert "deepspeed.launcher.launch" in text and "--node_rank=%n" in text and "--no_local_rank" in text
    assert "--master_addr=node-a" in text and "--master_port=29613" in text
    assert text.endswith(f"{SHIM} train.py")


def test_deepspeed_single_host_hostfile_skips_ssh(tmp_path: Path) -> None:
    runner = DistributedRunner(["t.py"], hostfile=write(tmp_path, "localhost slots=2\n"), use_deepspeed=True)
    args = _deepspeed_args(runner.build_command(runner.commands[0]))
    assert args.no_ssh_check and runner.world_size == 2 and runner.master_addr == "127.0.0.1"


def test_node_rank_commands(tmp_path: Path) -> None:
    from torch.distributed.run import get_args_parser

    hostfile = write(tmp_path, "n0 slots=1\nn1 slots=1\n")
    ds = DistributedRunner(["t.py"], hostfile=hostfile, node_rank=1, use_deepspeed=True, master_addr="127.0.0.1")
    args = _deepspeed_args(ds.build_command(ds.commands[0]))
    assert args.no_ssh and args.node_rank == 1 and args.master_addr == "127.0.0.1"
    tr = DistributedRunner(["t.py"], hostfile=hostfile, node_rank=1, master_addr="127.0.0.1", master_port=29614)
    targs = get_args_parser().parse_args(tr.build_command(tr.commands[0])[4:])
    assert (targs.nnodes, targs.nproc_per_node, targs.node_rank, targs.master_port) == ("2", "1", 1, 29614)


def test_mpirun_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = DistributedRunner(["t.py --a"], world_size=2, use_mpi=True)
    cmd = runner.build_command(runner.commands[0])
    assert Path(cmd[0]).name == "mpirun" and cmd[1:3] == ["-np", "2"]
    assert ("--allow-run-as-root" in cmd) == (os.geteuid() == 0)
    for key in ("MASTER_ADDR", "MASTER_PORT", "LIGHTNING_GAUDI_DS_RUN_DIR", "PYTHONPATH"):
        assert cmd[cmd.index(key) - 1] == "-x"
    assert cmd[-5:] == [sys.executable, "-u", SHIM, "t.py", "--a"]
    env = runner._environment(tmp_path, "tok", 29615)
    if os.geteuid() == 0:
        assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert env["MASTER_PORT"] == "29615" and env["LIGHTNING_GAUDI_DS_RUN_ID"] == "tok"
    multi = DistributedRunner(["t.py"], hostfile=write(tmp_path, "a slots=2\nb slots=2\n"), use_mpi=True)
    cmd = multi.build_command(multi.commands[0])
    assert cmd[1:3] == ["-np", "4"] and cmd[cmd.index("--hostfile") + 1].endswith("hostfile")
    monkeypatch.setattr(runner_module.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="needs Open MPI's `mpirun` on PATH.*apt-get install openmpi-bin"):
        runner.run()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 0}, r"world_size=0: .*>= 1"),
        ({"world_size": 2, "use_mpi": True, "use_deepspeed": True}, "pick one launcher"),
        ({"master_port": 70000}, "master_port=70000"),
        ({"node_rank": 0}, "node_rank=0 needs a hostfile"),
        ({"hostfile": "HF", "world_size": 3, "use_deepspeed": True}, r"world_size=3 but hostfile .* has 4 slots"),
        ({"hostfile": "HF"}, "torchrun starts the ranks of one node.*node_rank"),
        ({"hostfile": "HF", "node_rank": 2}, r"node_rank=2: the hostfile lists 2 nodes; pass 0..1"),
        ({"hostfile": "HF", "node_rank": 0, "use_mpi": True}, "mpirun starts every node itself"),
    ],
)
def test_runner_argument_errors(tmp_path: Path, kwargs: dict, match: str) -> None:
    if kwargs.get("hostfile") == "HF":
        kwargs["hostfile"] = write(tmp_path, "a slots=2\nb slots=2\n")
    with pytest.raises(ValueError, match=match):
        DistributedRunner(["t.py"], **kwargs)


def test_runner_command_errors() -> None:
    with pytest.raises(ValueError, match="empty command"):
        DistributedRunner(["  "])
    with pytest.raises(TypeError, match="one string"):
        DistributedRunner([["t.py", "--a"]])  # type: ignore[list-item]


def test_plan_is_data_for_each_launcher(tmp_path: Path) -> None:
    """The pure planner: the machine's facts come in as a value, so every branch is checked without mpirun."""
    machine = plan.Machine(python="/py", mpirun="/opt/mpirun", as_root=True, cpus=1)
    spec = plan.resolve(3, use_mpi=True, master_port=0)
    argv = plan.launch_argv(spec, ["t.py"], 4242, machine)
    assert argv[:6] == ["/opt/mpirun", "-np", "3", "--bind-to", "none", "--allow-run-as-root"]
    assert "--oversubscribe" in argv and argv[-4:] == ["/py", "-u", plan.SHIM, "t.py"]
    env = plan.launch_env(spec, {"PATH": "/bin", "OMPI_MCA_ess_singleton_isolated": "0"}, tmp_path, "tok", 4242,
                          machine)
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1" and env["OMPI_MCA_ess_singleton_isolated"] == "0"
    assert (env["MASTER_PORT"], env[plan.RUN_ID_ENV], env["PATH"]) == ("4242", "tok", "/bin")
    assert plan.launch_argv(plan.resolve(1), ["-m", "m"], 1, machine) == ["/py", "-u", plan.SHIM, "-m", "m"]
    torchrun = plan.launch_env(plan.resolve(2), {}, tmp_path, "t", 1, machine)
    assert torchrun["OMPI_MCA_ess_singleton_isolated"] == "1" and "OMPI_ALLOW_RUN_AS_ROOT" not in torchrun
    assert [plan.resolve(**kw).launcher for kw in ({}, {"world_size": 2}, {"use_deepspeed": True},
                                                   {"use_mpi": True})] == list(plan.LAUNCHERS)


# --------------------------------------------------------------------------------------------------- ports
def test_busy_port_is_replaced_by_a_free_one(capsys: pytest.CaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert port_in_use(port) is True
        runner = DistributedRunner(["t.py"], world_size=2, master_port=port)
        chosen = runner._choose_port()
        assert chosen != port and port_in_use(chosen) is False
        assert f"master port {port} is in use on this host; using free port {chosen}" in capsys.readouterr().err
        assert DistributedRunner(["t.py"], master_port=0)._choose_port() > 0


def test_busy_port_on_a_multi_node_master_is_an_error(tmp_path: Path) -> None:
    hostfile = write(tmp_path, "n0 slots=1\nn1 slots=1\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        node0 = DistributedRunner(["t.py"], hostfile=hostfile, node_rank=0, master_addr="127.0.0.1", master_port=port)
        with pytest.raises(RuntimeError, match=f"master_port={port} is already in use.*--master_port"):
            node0._choose_port()
        node1 = DistributedRunner(["t.py"], hostfile=hostfile, node_rank=1, master_addr="127.0.0.1", master_port=port)
        assert node1._choose_port() == port  # node 0's agent holds it: that is expected


@pytest.mark.parametrize("ephemeral", [None, (32768, 60999), (1024, 60999), (1024, 65535)],
                         ids=["this-host", "linux-default", "from-1024", "everything"])
def test_free_port_is_chosen_outside_the_ephemeral_range(ephemeral, monkeypatch) -> None:
    # Outgoing connections (mpirun's, ssh's) take source ports from the ephemeral range: a port picked there and
    # bound seconds later by rank 0 can be gone (EADDRINUSE); outside it only an explicit bind takes one.
    if ephemeral is not None:
        monkeypatch.setattr(_proc, "_ephemeral_ports", lambda: ephemeral)
    low, high = _proc._ephemeral_ports()
    ports = {free_port() for _ in range(5)}
    if (low, high) == (1024, 65535):  # no port outside: the OS's pick
        assert all(0 < p < 65536 for p in ports)
    else:
        assert all(20000 <= p < low or high < p < 65536 for p in ports), (ports, low, high)
    assert all(port_in_use(p) is False for p in ports)


def test_port_check_skips_addresses_of_other_hosts() -> None:
    assert port_in_use(29500, "192.0.2.1") is None  # TEST-NET-1: never an address of this host


# ------------------------------------------------------------------------------------------------------ CLI
def test_cli_spawn_arguments() -> None:
    from lightning_gaudi_ds.cli import build_parser

    args = build_parser().parse_args(
        ["spawn", "--world_size", "2", "--use_deepspeed", "--master_port", "1234", "train.py", "--world_size", "9",
         "--lr", "0.1"]
    )
    assert (args.world_size, args.use_deepspeed, args.use_mpi, args.master_port) == (2, True, False, 1234)
    assert args.training_script == "train.py" and args.training_script_args == ["--world_size", "9", "--lr", "0.1"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["spawn", "--use_mpi", "--use_deepspeed", "train.py"])


def test_cli_reports_bad_hostfile(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lightning_gaudi_ds.cli import main

    hostfile = write(tmp_path, "a slots=1\na slots=1\n")
    assert main(["spawn", "--use_deepspeed", "--hostfile", str(hostfile), "t.py"]) == 2
    assert f"error: {hostfile}:2: 'a slots=1': host 'a' is listed again" in capsys.readouterr().err


def test_distributed_runner_is_exported() -> None:
    import lightning_gaudi_ds

    assert lightning_gaudi_ds.DistributedRunner is DistributedRunner


@pytest.mark.multiprocess
@pytest.mark.parametrize("argv", [["--help"], ["spawn", "--help"]], ids=["help", "spawn-help"])
def test_cli_help_imports_neither_torch_nor_deepspeed(argv: list[str]) -> None:
    """The console script's start-up: the package, the CLI and spawn's parser load without the heavy stack."""
    import subprocess

    code = ("import sys\nfrom lightning_gaudi_ds.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n"
            "    pass\nheavy = sorted(m for m in ('torch', 'deepspeed', 'lightning') if m in sys.modules)\n"
            "print('HEAVY', heavy)\n")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert "usage: lightning-gaudi-ds" in done.stdout
    assert "HEAVY []" in done.stdout, f"--help imported {done.stdout.split('HEAVY', 1)[1].strip()}; keep those" \
        " imports inside the functions that need them (lightning_gaudi_ds/__init__.py, cli.py, launch/)"


@pytest.mark.multiprocess
@pytest.mark.parametrize("first", ["lightning_gaudi_ds", "lightning"])
def test_strategy_names_are_registered_whichever_package_is_imported_first(first: str) -> None:
    import subprocess

    second = "lightning" if first == "lightning_gaudi_ds" else "lightning_gaudi_ds"
    code = (f"import {first}, {second}\nfrom lightning.pytorch.strategies import StrategyRegistry\n"
            "from lightning.pytorch.accelerators import AcceleratorRegistry\n"
            "print('hpu_deepspeed_stage_3' in StrategyRegistry, 'hpu' in AcceleratorRegistry)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "True"]


# ------------------------------------------------------------------------------ externally launched ranks
LAUNCHER_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "CROSS_RANK", "LOCAL_SIZE", "GROUP_RANK", "NODE_RANK",
                 "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 *MPI_RANK_KEYS, *MPI_SIZE_KEYS)


@pytest.fixture
def launcher_env(monkeypatch: pytest.MonkeyPatch):
    """Set a launcher's variables for one test; put Lightning's rank-zero state back afterwards."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rz
    from lightning.pytorch.utilities.rank_zero import rank_zero_only as pl_rz

    for key in LAUNCHER_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OMPI_MCA_ess_singleton_isolated", "1")

    def apply(**values: object) -> None:
        for key, value in values.items():
            monkeypatch.setenv(key, str(value))

    yield apply
    fabric_rz.rank = pl_rz.rank = 0


def deepspeed_node(rank: int, local_rank: int, world: int, node: int, per_node: int) -> dict:
    """What deepspeed.launcher.launch exports to a rank."""
    return dict(RANK=rank, LOCAL_RANK=local_rank, WORLD_SIZE=world, CROSS_RANK=node, CROSS_SIZE=world // per_node,
                LOCAL_SIZE=per_node, MASTER_ADDR="127.0.0.1", MASTER_PORT=29599)


def make_trainer(devices: int, num_nodes: int = 1):
    import lightning as L

    from lightning_gaudi_ds import HPUDeepSpeedStrategy

    return L.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=HPUDeepSpeedStrategy(stage=2),
                     logger=False, enable_checkpointing=False, enable_progress_bar=False)


def test_deepspeed_launcher_second_node_gets_its_own_ranks(launcher_env) -> None:
    """Lightning's fallback environment would call this process global rank 0 (node rank 0): a duplicate rank."""
    launcher_env(**deepspeed_node(rank=2, local_rank=0, world=4, node=1, per_node=2))
    assert LightningEnvironment().node_rank() == 0  # Lightning's fallback: node rank 0 on every node
    trainer = make_trainer(devices=2, num_nodes=2)
    env = trainer.strategy.cluster_environment
    assert isinstance(env, DeepSpeedLauncherEnvironment) and env.creates_processes_externally
    assert (trainer.global_rank, trainer.node_rank, trainer.local_rank, trainer.world_size) == (2, 1, 0, 4)


def test_deepspeed_launcher_world_size_mismatch_is_reported_before_training(launcher_env) -> None:
    launcher_env(**deepspeed_node(rank=0, local_rank=0, world=2, node=0, per_node=2))
    with pytest.raises(ValueError) as err:
        make_trainer(devices=1)
    message = str(err.value)
    assert "DeepSpeed's launcher started 2 processes in all" in message
    assert "`Trainer(devices=1, num_nodes=1)` makes 1 × 1 = 1" in message and "Trainer(devices=2, num_nodes=1)" in message


def test_torchrun_world_size_mismatch(launcher_env) -> None:
    launcher_env(TORCHELASTIC_RUN_ID="x", RANK=0, LOCAL_RANK=0, GROUP_RANK=0, LOCAL_WORLD_SIZE=2, WORLD_SIZE=2,
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=29598)
    assert isinstance(make_trainer(devices=2).strategy.cluster_environment, TorchElasticEnvironment)
    with pytest.raises(ValueError, match=r"torchrun started 2 processes in all.*devices=4, num_nodes=1"):
        make_trainer(devices=4)


def test_processes_per_node_mismatch(launcher_env) -> None:
    launcher_env(TORCHELASTIC_RUN_ID="x", RANK=0, LOCAL_RANK=0, GROUP_RANK=0, LOCAL_WORLD_SIZE=4, WORLD_SIZE=4)
    with pytest.raises(ValueError, match=r"torchrun started 4 processes on this node \(LOCAL_WORLD_SIZE=4\)"):
        make_trainer(devices=2, num_nodes=2)


def test_mpirun_without_mpi4py_refuses_to_spawn(launcher_env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without mpi4py Lightning would not see MPI, and each of the N ranks would start N processes of its own."""
    launcher_env(OMPI_COMM_WORLD_SIZE=2, OMPI_COMM_WORLD_RANK=0)
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import fails
    with pytest.raises(RuntimeError, match=r"started by mpirun \(world size 2.*mpi4py cannot be imported.*pip install"):
        resolve_environment(LightningEnvironment())


@pytest.mark.parametrize("key", MPI_SIZE_KEYS)
def test_every_mpi_world_size_variable_is_recognised(launcher_env, monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    launcher_env(**{key: 2})
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(RuntimeError, match=r"started by mpirun \(world size 2"):
        resolve_environment(LightningEnvironment())


def test_unlaunched_and_user_environments_are_left_alone(launcher_env) -> None:
    plain = LightningEnvironment()
    assert resolve_environment(plain) is plain
    check_launcher_world_size(plain, devices=2, num_nodes=1)  # Lightning will start the processes itself
    launcher_env(**deepspeed_node(rank=0, local_rank=0, world=2, node=0, per_node=2))

    class Mine(LightningEnvironment):
        pass

    mine = Mine()
    assert resolve_environment(mine) is mine


# ----------------------------------------------- the runner and its shim with tiny stdlib-only scripts (fast)
def script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text("import os, sys, time, subprocess\n" + body)
    return path


@pytest.mark.multiprocess
def test_shim_records_exit_and_output(tmp_path: Path) -> None:
    import json
    import subprocess
    import time

    toy = script(tmp_path, "toy.py", "print('hello from', os.environ['RANK']); sys.exit(5)\n")
    run_dir = tmp_path / "run"
    env = {**os.environ, "RANK": "3", plan.RUN_DIR_ENV: str(run_dir)}
    done = subprocess.run([sys.executable, SHIM, str(toy)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 5 and "hello from 3" in done.stdout
    record = json.loads((run_dir / "rank3.json").read_text())
    assert record["returncode"] == 5 and record["child_pid"] != record["pid"]
    assert "failed_at" not in record and record["ended_at"] <= time.time()
    assert (run_dir / "rank3.log").read_text() == "hello from 3\n"
    raises = script(tmp_path, "raises.py", "raise ValueError('x')\n")
    done = subprocess.run([sys.executable, SHIM, str(raises)], env=env, capture_output=True, timeout=60)
    record = json.loads((run_dir / "rank3.json").read_text())
    assert done.returncode == 1 and record["returncode"] == 1 and record["failed_at"] <= record["ended_at"] + 2.0
    assert abs(record["clock_offset"]) < 1.0  # one host: the run directory's clock is this one


@pytest.mark.multiprocess
def test_isolated_mpi_singletons_get_a_session_directory_each(tmp_path: Path) -> None:
    """Isolated Open MPI singletons on one host share a job id: without a base each, one rank ending removed the
    session tree another was creating, and that rank's MPI_Init aborted (the suite saw it once in 15 runs; 8 of 1389
    singletons started 8 at a time failed that way, none with a base each)."""
    import subprocess

    pytest.importorskip("mpi4py")
    probe = script(tmp_path, "probe.py", "from mpi4py import MPI\n"  # Lightning's MPIEnvironment.detect()
                   "assert MPI.COMM_WORLD.Get_size() == 1\n"
                   "base = os.environ['OMPI_MCA_orte_tmpdir_base']\n"
                   "print('base', base, sorted(os.listdir(base)))\n")
    user_base = tmp_path / "ompi"  # a base of the user's own: each rank's is made inside it
    user_base.mkdir()
    env = {**os.environ, plan.RUN_DIR_ENV: str(tmp_path / "run"), "OMPI_MCA_ess_singleton_isolated": "1",
           "OMPI_MCA_orte_tmpdir_base": str(user_base)}
    for key in (*MPI_RANK_KEYS, *MPI_SIZE_KEYS):
        env.pop(key, None)
    shims = [subprocess.Popen([sys.executable, SHIM, str(probe)], env={**env, "RANK": str(rank)},
                              stdout=subprocess.PIPE, text=True, start_new_session=True) for rank in range(3)]
    try:
        outs = [shim.communicate(timeout=120)[0] for shim in shims]
    finally:
        for shim in shims:
            if shim.poll() is None:
                os.killpg(shim.pid, 9)  # only the sessions this test started
    assert [shim.returncode for shim in shims] == [0, 0, 0], outs
    bases = [line.split()[1] for out in outs for line in out.splitlines() if line.startswith("base ")]
    assert len(set(bases)) == 3 and all(Path(base).parent == user_base for base in bases), bases
    assert all("'ompi." in out for out in outs), outs  # Open MPI made its session tree in the rank's own base
    assert list(user_base.iterdir()) == []  # each shim removed its rank's base when the rank ended
    plain = {**env, "OMPI_MCA_ess_singleton_isolated": "0"}  # a daemon per singleton: Open MPI keeps them apart
    assert rank_shim.own_mpi_session_base(plain) is None and plain["OMPI_MCA_orte_tmpdir_base"] == str(user_base)
    under_mpirun = {**env, "OMPI_COMM_WORLD_RANK": "0"}
    assert rank_shim.own_mpi_session_base(under_mpirun) is None


@pytest.mark.parametrize("key", MPI_RANK_KEYS)
def test_shim_runs_scripts_through_mpi4py_under_mpirun(monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    for other in (*MPI_RANK_KEYS, *MPI_SIZE_KEYS):
        monkeypatch.delenv(other, raising=False)
    assert rank_shim.python_command(["t.py"]) == [sys.executable, "-u", "t.py"]
    monkeypatch.setenv(key, "1")  # Open MPI 4.1 sets OMPI_COMM_WORLD_RANK and PMIX_RANK, never PMIX_SIZE
    monkeypatch.setattr(rank_shim.importlib.util, "find_spec", lambda name: object())
    assert rank_shim.python_command(["t.py", "--a"]) == [sys.executable, "-u", "-m", "mpi4py", "t.py", "--a"]


def _record(run_dir: Path, rank: int, **fields: object) -> None:
    record = {"rank": rank, "pid": 1, "child_pid": 2, "host": "elsewhere", **fields}
    rank_shim._write_json(run_dir / f"rank{rank}.json", record)  # as the shim writes it: never half-written


def test_the_rank_whose_traceback_came_first_is_named_not_the_first_to_exit(tmp_path: Path) -> None:
    """Rank 1 raised at t and was still in its exit handlers (which end its process groups) when rank 0, failing
    because of it, exited at t+1: the first traceback names the cause, whatever the order of the exits."""
    from lightning_gaudi_ds.launch.supervise import _RankTable

    t = time.time() - 5
    table = _RankTable(tmp_path)
    _record(tmp_path, 0, returncode=1, failed_at=t + 0.5, ended_at=t + 1.0)
    _record(tmp_path, 1, failed_at=t)
    assert table.first_failure().rank == 0 and table.raising(t + 0.5) == [(t, 1)]  # rank 1 still exiting
    assert table.raising(t) == []
    _record(tmp_path, 1, returncode=1, failed_at=t, ended_at=t + 3.0)
    failure = table.first_failure()
    assert (failure.rank, failure.returncode, failure.at) == (1, 1, t) and table.raising(t + 1) == []
    assert not failure.ended_by_signal
    _record(tmp_path, 1, returncode=-15, failed_at=t, ended_at=t + 1.5)  # ended by mpirun while exiting
    failure = table.first_failure()
    assert (failure.rank, failure.returncode) == (1, 1), failure  # an uncaught exception's code, not SIGTERM's
    assert failure.how.startswith("raised (see its log), then was ended while exiting: exited with signal SIGTERM")
    assert failure.ended_by_signal  # what the supervisor asks before it waits for mpirun to name a lost host
    _record(tmp_path, 2, returncode=-9, ended_at=t - 1.0)  # killed before anyone raised: it is the cause
    failure = table.first_failure()
    assert (failure.rank, failure.returncode) == (2, 137)


def test_a_rank_killed_from_outside_is_the_cause_though_its_peer_raised_before_it_was_reaped(tmp_path: Path) -> None:
    """Rank 1 was SIGKILLed: its peer's gloo connection closed at once, and the peer's traceback showed before rank
    1's shim, on a busy machine, had reaped it. The exit order decides between a rank without a traceback and one
    with: the peer still ran its exit handlers, and exited later."""
    from lightning_gaudi_ds.launch.supervise import _RankTable

    t = time.time()
    _record(tmp_path, 1, returncode=-9, ended_at=t + 0.3)
    _record(tmp_path, 0, returncode=1, failed_at=t + 0.1, ended_at=t + 1.5)
    failure = _RankTable(tmp_path).first_failure()
    assert (failure.rank, failure.returncode) == (1, 137) and "exited with signal SIGKILL" in failure.how


def test_a_traceback_the_rank_survived_does_not_make_it_the_cause(tmp_path: Path) -> None:
    """Rank 0 logged a handled exception a minute before rank 1 died by a segfault, which ended rank 0 too: rank 1
    is named, with its own signal (a crash, not a launcher's stop), and rank 0's old traceback is no exit code 1."""
    from lightning_gaudi_ds.launch.supervise import _RankTable

    t = time.time()
    _record(tmp_path, 0, returncode=-15, failed_at=t - 60, ended_at=t + 0.5)
    _record(tmp_path, 1, returncode=-11, failed_at=t - 0.2, ended_at=t)
    failure = _RankTable(tmp_path).first_failure()
    assert (failure.rank, failure.returncode) == (1, 128 + 11) and "signal SIGSEGV" in failure.how
    _record(tmp_path, 1, returncode=0, ended_at=t)
    failure = _RankTable(tmp_path).first_failure()
    assert (failure.rank, failure.returncode) == (0, 143)  # only the exit counts
    _record(tmp_path, 2, failed_at=t - 60)  # running, with an old traceback: not waited for
    assert _RankTable(tmp_path).raising(t + 1) == []


def test_ranks_on_hosts_with_different_clocks_compare_on_the_run_directorys(tmp_path: Path) -> None:
    from lightning_gaudi_ds.launch.supervise import _RankTable

    t = time.time()
    _record(tmp_path, 0, returncode=1, failed_at=t + 1.0, ended_at=t + 1.5, clock_offset=0.0)
    _record(tmp_path, 1, returncode=1, failed_at=t - 3.5, ended_at=t - 3.0, clock_offset=5.0)  # clock 5 s slow
    assert _RankTable(tmp_path).first_failure().rank == 0


def test_a_local_rank_that_raised_and_vanished_is_not_waited_for(tmp_path: Path) -> None:
    from lightning_gaudi_ds.launch.supervise import _RankTable

    t = time.time() - 2
    table = _RankTable(tmp_path)
    _record(tmp_path, 0, returncode=1, failed_at=t + 0.5, ended_at=t + 1.0)
    _record(tmp_path, 1, failed_at=t, host=table.host, pid=_proc_that_ended())
    failure = table.first_failure()
    assert failure.rank == 1 and failure.at == t and "raised (see its log), then its process" in failure.how
    assert table.raising(t + 1) == []  # no exit status will come: nothing to wait for


def test_a_vanished_rank_is_timed_from_when_it_was_first_seen_gone(tmp_path: Path) -> None:
    from lightning_gaudi_ds.launch.supervise import _RankTable

    table = _RankTable(tmp_path)
    _record(tmp_path, 1, host=table.host, pid=_proc_that_ended())
    assert table.first_failure().rank == 1
    seen = table.vanished[1]
    time.sleep(0.05)
    _record(tmp_path, 0, returncode=1, failed_at=time.time(), ended_at=time.time())  # its peer, failing after
    assert table.first_failure().rank == 1 and table.vanished[1] == seen  # timed once, not at each look


def _proc_that_ended() -> int:
    import subprocess

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_the_supervisor_waits_for_a_rank_that_raised_first(tmp_path: Path) -> None:
    import threading

    from lightning_gaudi_ds.launch.supervise import Supervisor, _RankTable

    t = time.time() - 5
    _record(tmp_path, 0, returncode=1, failed_at=t + 0.5, ended_at=t + 1.0)
    _record(tmp_path, 1, failed_at=t)
    later = threading.Timer(0.2, _record, (tmp_path, 1), {"returncode": 3, "failed_at": t, "ended_at": t + 2.0})
    later.start()
    table = _RankTable(tmp_path)
    failure = Supervisor(stop_timeout=30)._settle(table, table.first_failure())
    later.join()
    assert (failure.rank, failure.returncode) == (1, 3)
    _record(tmp_path, 2, failed_at=t - 1)  # never exits: at min(stop_timeout, 10) s it is named, still exiting
    failure = Supervisor(stop_timeout=0.1)._settle(table, table.first_failure())
    assert (failure.rank, failure.returncode, failure.at) == (2, 1, t - 1), failure
    assert "raised (see its log), and was still exiting 0.1 s after rank 1 failed" in failure.how


def test_the_shim_sees_a_traceback_header_split_between_two_reads(tmp_path: Path,
                                                                  capsysbinary: pytest.CaptureFixture) -> None:
    import threading
    import time

    read_fd, write_fd = os.pipe()
    seen: list[float] = []
    log_path = tmp_path / "rank0.log"
    with open(log_path, "wb") as log:
        pump = threading.Thread(target=rank_shim._pump, args=(read_fd, log, lambda: seen.append(time.time())))
        pump.start()
        head, rest = rank_shim.TRACEBACK[:12], rank_shim.TRACEBACK[12:]
        os.write(write_fd, b"step 1\n" + head)
        deadline = time.monotonic() + 10
        while not log_path.read_bytes().endswith(head) and time.monotonic() < deadline:
            time.sleep(0.01)  # the first part is read alone
        assert not seen
        os.write(write_fd, rest + b"\nValueError: x\n" + rank_shim.TRACEBACK)
        os.close(write_fd)
        pump.join(timeout=10)
    assert len(seen) == 1  # once, at the first header
    assert log_path.read_bytes().count(rank_shim.TRACEBACK) == 2
    assert capsysbinary.readouterr().out == log_path.read_bytes()


@pytest.mark.multiprocess
def test_runner_returns_first_failure_and_prints_its_tail(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ok = script(tmp_path, "ok.py", "print('ok ran')\n")
    bad = script(tmp_path, "bad.py", "for i in range(30): print('line', i)\nsys.exit(3)\n")
    never = script(tmp_path, "never.py", f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    runner = DistributedRunner([str(ok), f"{bad} --flag", str(never)], master_port=0, tail_lines=5)
    assert runner.run() == 3
    assert not (tmp_path / "ran").exists()  # commands run in order and stop at the first failure
    err = capsys.readouterr().err
    assert "rank 0 failed: exited with exit code 3" in err
    assert "last 5 lines of rank 0" in err and "  | line 29" in err and "  | line 24" not in err


@pytest.mark.multiprocess
def test_runner_stops_processes_that_outlive_the_job(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A process that left the job's session (as torchrun's workers do) is still found, by the job's token."""
    import psutil

    pid_file = tmp_path / "pid"
    body = (f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True)\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n")
    runner = DistributedRunner([str(script(tmp_path, "leaky.py", body))], master_port=0, stop_timeout=1)
    assert runner.run() == 0
    pid = int(pid_file.read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert f"outlived the launcher and were stopped: [{pid}]" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_a_reused_log_dir_does_not_mix_runs(tmp_path: Path) -> None:
    bad = script(tmp_path, "bad.py", "print('bad'); sys.exit(4)\n")
    good = script(tmp_path, "good.py", "print('good')\n")
    logs = tmp_path / "logs"
    assert DistributedRunner([str(bad)], master_port=0, log_dir=logs).run() == 4
    assert DistributedRunner([str(good)], master_port=0, log_dir=logs).run() == 0  # the old record is not read
    assert sorted(p.read_text() for p in logs.glob("*/rank0.log")) == ["bad\n", "good\n"]


@pytest.mark.multiprocess
def test_cli_spawn_runs_a_module(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lightning_gaudi_ds.cli import main

    data = tmp_path / "a.json"
    data.write_text('{"b": [1, 2]}')
    assert main(["spawn", "--master_port", "0", "-m", "json.tool", "--compact", str(data)]) == 0
    assert main(["spawn", "--master_port", "0", "-m", "json.tool", str(tmp_path / "missing.json")]) != 0
    assert "rank 0 failed" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_killing_the_runner_leaves_no_rank_behind(tmp_path: Path) -> None:
    """SIGKILL to the runner: its launcher gets SIGTERM (PDEATHSIG), the shim passes it on, then SIGKILLs the
    script that ignores it. Every process of the job must be gone a few seconds later."""
    import signal
    import time

    from tests.procs import LiveJob

    body = "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(300)\n"
    job = LiveJob([sys.executable, "-m", "lightning_gaudi_ds", "spawn", "--master_port", "0", "--stop_timeout", "2",
                   str(script(tmp_path, "stubborn.py", body))])
    try:
        job.wait_for("ready", timeout=120)
        assert len(job.leftovers()) >= 3  # runner, shim, script
        job.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 15
        while job.leftovers() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not job.leftovers()
    finally:
        job.kill()


# ---------------------------------------------------------------- launches across hosts (issues 23 and 28)
MACHINE = plan.Machine(python="/py", mpirun="/opt/mpirun", as_root=True, cpus=1)


def across_hosts(tmp_path: Path, flag: str = "use_deepspeed", **kwargs: object) -> plan.LaunchSpec:
    return plan.resolve(2, write(tmp_path, "a slots=1\nb slots=1\n"), **{flag: True}, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("flag", ["use_deepspeed", "use_mpi"])
def test_remote_ranks_read_their_arguments_from_a_file(tmp_path: Path, flag: str) -> None:
    spec = across_hosts(tmp_path, flag)
    assert spec.across_hosts
    argv = plan.launch_argv(spec, ["job.py", "x'; touch PWNED; '"], 1, MACHINE, tmp_path / "argv.json")
    assert argv[-3:] == [plan.SHIM, "--lgds-args-file", str(tmp_path / "argv.json")]
    assert not any("PWNED" in a for a in argv)


def test_pdsh_settings_and_keepalives_on_every_device(tmp_path: Path) -> None:
    env = plan.launch_env(across_hosts(tmp_path, link_timeout=9.0, rendezvous_timeout=30.0),
                          {"PATH": "/bin", "PDSH_SSH_ARGS_APPEND": "-F cfg"}, tmp_path, "tok", 1, MACHINE)
    assert env["DS_ENV_FILE"] == str(tmp_path / "deepspeed_env")  # on CPU too, not only on Gaudi
    assert env["PDSH_SSH_ARGS_APPEND"] == "-F cfg -o ServerAliveInterval=3 -o ServerAliveCountMax=3"
    text = plan.deepspeed_env_text(env)
    for line in ("LIGHTNING_GAUDI_DS_RUN_ID=tok", "LIGHTNING_GAUDI_DS_STOP_TIMEOUT=10.0",
                 "LIGHTNING_GAUDI_DS_RENDEZVOUS_TIMEOUT=30", "LIGHTNING_GAUDI_DS_LINK_TIMEOUT=9",
                 "OMPI_MCA_ess_singleton_isolated=1", f"LIGHTNING_GAUDI_DS_RUN_DIR={tmp_path}"):
        assert line in text.splitlines()
    with pytest.raises(ValueError, match=r"HABANA_LOGS='/x/\$\(id\)'.*remote shell"):
        plan.deepspeed_env_text({**env, "HABANA_LOGS": "/x/$(id)"})


def test_mpirun_forwards_the_rendezvous_timeout_and_keepalives(tmp_path: Path) -> None:
    spec = across_hosts(tmp_path, "use_mpi", rendezvous_timeout=30.0)
    argv = plan.launch_argv(spec, ["job.py"], 1, MACHINE)
    exported = {argv[i + 1] for i, a in enumerate(argv) if a == "-x"}
    assert {"LIGHTNING_GAUDI_DS_RENDEZVOUS_TIMEOUT", "LIGHTNING_GAUDI_DS_LINK_TIMEOUT",
            "LIGHTNING_GAUDI_DS_RUN_DIR", "LIGHTNING_GAUDI_DS_RUN_ID"} <= exported
    env = plan.launch_env(spec, {}, tmp_path, "tok", 1, MACHINE)
    assert env["OMPI_MCA_plm_rsh_args"] == "-o ServerAliveInterval=20 -o ServerAliveCountMax=3"
    assert env["OMPI_MCA_oob_tcp_keepalive_time"] == "20" and env["OMPI_MCA_oob_tcp_keepalive_probes"] == "3"


def test_per_node_torchrun_gets_a_bounded_rendezvous(tmp_path: Path) -> None:
    spec = plan.resolve(2, write(tmp_path, "a slots=1\nb slots=1\n"), node_rank=1, rendezvous_timeout=12.5)
    argv = plan.launch_argv(spec, ["job.py"], 1, MACHINE)
    assert argv[argv.index("--rdzv-conf") + 1] == "timeout=13"
    assert "--rdzv-conf" in plan.launch_argv(plan.resolve(2, write(tmp_path, "a slots=1\nb slots=1\n"), node_rank=0),
                                             ["job.py"], 1, MACHINE)


@pytest.mark.parametrize("value", [0, -1, float("inf"), "5"])
def test_link_timeout_is_checked(tmp_path: Path, value: object) -> None:
    with pytest.raises(ValueError, match="link_timeout=.*a finite number > 0"):
        across_hosts(tmp_path, link_timeout=value)


def test_run_dir_and_private_files_modes_and_removal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pdsh launch: the run directory (under the shared working directory) is 0700, the env and argument files
    0600, and all of it is gone after the job, whether it succeeded or failed."""
    from lightning_gaudi_ds.launch import runner as runner_module

    seen: list[dict] = []

    class Recorder:
        def __init__(self, *args: object) -> None:
            pass

        def run(self, argv: list[str], env: dict[str, str], run_dir: Path, token: str, keep: bool) -> int:
            seen.append({"dir": run_dir, "modes": {p.name: stat.S_IMODE(p.stat().st_mode)
                                                   for p in [run_dir, *run_dir.iterdir()]},
                         "args": json.loads((run_dir / "argv.json").read_text())})
            return len(seen) - 1  # 0, then a failure

    monkeypatch.setattr(runner_module, "Supervisor", Recorder)
    monkeypatch.chdir(tmp_path)
    hostfile = write(tmp_path, "a slots=1\nb slots=1\n")
    for expected in (0, 1):
        launch = DistributedRunner(["job.py \"x'; touch PWNED; '\""], hostfile=hostfile, use_deepspeed=True,
                                   master_port=12345)
        assert launch.run() == expected
    for record in seen:
        assert record["dir"].parent == tmp_path and not record["dir"].exists()
        assert record["modes"] == {record["dir"].name: 0o700, "argv.json": 0o600, "deepspeed_env": 0o600}
        assert record["args"] == ["job.py", "x'; touch PWNED; '"]
