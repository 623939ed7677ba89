"""Checkpoints are pickles: with ``weights_only=True`` (torch's default) nothing in a checkpoint runs.

A poisoned checkpoint is a real one with an object added to one shard whose ``__reduce__`` opens (creates) a marker
file when unpickled. Each loading path refuses it with an error naming the file and how to opt in, and the marker is
never created; with ``weights_only=False`` (the opt-in) the same file does create it, which shows the payload is live.
Real checkpoints of every stage load through the safe path: the resume tests in test_checkpoint.py run with
Lightning's default (``weights_only=None``, torch's True).
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_gaudi_ds import UnsafeCheckpointError, _compat, convert_zero_checkpoint_to_fp32_state_dict
from lightning_gaudi_ds.checkpoint import io as ckpt_io
from lightning_gaudi_ds.checkpoint.io import MANIFEST
from lightning_gaudi_ds.engine import inference
from tests.test_checkpoint import fake_checkpoint, run_plan


class Payload:
    """Unpickled with Python's full unpickler, it creates ``marker`` (``Path(marker).touch()``, which returns None)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.marker),))


def poison(source: Path, target: Path, marker: Path) -> Path:
    """A copy of the checkpoint ``source`` whose rank-0 optimizer shard (the model states for stage 0) also holds a
    :class:`Payload`; the manifest, if any, lists the new size. Returns the poisoned file."""
    shutil.copytree(source, target, symlinks=True)
    tag = target / "checkpoint"
    shards = sorted(tag.glob("*zero_pp_rank_0_*optim_states.pt")) or sorted(tag.glob("*model_states.pt"))
    file = shards[0]
    state = torch.load(file, map_location="cpu", weights_only=False)  # our own file: trusted
    state["payload"] = Payload(marker)
    torch.save(state, file)
    manifest = target / MANIFEST
    if manifest.is_file():
        data = json.loads(manifest.read_text())
        data["files"][str(file.relative_to(target))] = file.stat().st_size
        manifest.write_text(json.dumps(data))
    return file


def assert_refused(message: str, file: Path, opt_in: str) -> None:
    assert str(file) in message, message
    assert "Unsupported global" in message, message  # torch says what it refused
    assert opt_in in message, message


# ------------------------------------------------------------------------------------------ unit tier
def test_the_payload_is_live_under_the_full_unpickler(tmp_path):
    file, marker = tmp_path / "x.pt", tmp_path / "PWNED"
    torch.save({"w": torch.zeros(1), "payload": Payload(marker)}, file)
    with pytest.raises(UnsafeCheckpointError) as caught:
        ckpt_io.load_file(file, True)
    assert_refused(str(caught.value), file, "weights_only=False")
    assert isinstance(caught.value, pickle.UnpicklingError)  # what torch.load raises for it
    assert not marker.exists()
    ckpt_io.load_file(file, False)
    assert marker.exists()


def test_a_blocked_module_is_refused_with_the_same_error(tmp_path):
    import os

    class System:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {tmp_path / 'PWNED'}",))

    torch.save({"x": System()}, tmp_path / "x.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"x.pt holds .*\(Trying to load unsupported GLOBAL posix.system"):
        ckpt_io.load_file(tmp_path / "x.pt")
    assert not (tmp_path / "PWNED").exists()


def test_deepspeed_checkpoint_types_load_safely_and_the_allowlist_is_restored(tmp_path):
    loss_scaler, dynamic, stage, fragment = _compat.checkpoint_safe_globals()
    saved = {"loss_scaler": loss_scaler(scale=1.0), "zero_stage": stage(2),
             "dynamic": dynamic(init_scale=2.0**8, scale_window=1000, min_scale=1, delayed_shift=1,
                                consecutive_hysteresis=False, dtype=torch.half),
             "mappings": [{"w": fragment(numel=4, start=0)}], "t": torch.ones(2)}
    torch.save(saved, tmp_path / "optim.pt")
    before = set(map(repr, torch.serialization.get_safe_globals()))
    loaded = ckpt_io.load_file(tmp_path / "optim.pt", True)
    assert set(map(repr, torch.serialization.get_safe_globals())) == before
    assert loaded["zero_stage"] == 2 and loaded["mappings"][0]["w"].numel == 4 and loaded["loss_scaler"].cur_scale == 1
    assert loaded["dynamic"].cur_scale == 2.0**8 and loaded["t"].tolist() == [1.0, 1.0]
    with pytest.raises(pickle.UnpicklingError, match="Unsupported global"):  # no allowlist left behind
        torch.load(tmp_path / "optim.pt", weights_only=True)


def test_weights_only_resolves_as_torch_does(monkeypatch):
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", raising=False)
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", raising=False)
    assert [ckpt_io.resolve_weights_only(v) for v in (None, True, False)] == [True, True, False]
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    assert [ckpt_io.resolve_weights_only(v) for v in (None, True, False)] == [False, True, False]
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "true")
    assert [ckpt_io.resolve_weights_only(v) for v in (None, True, False)] == [True, True, True]


def test_a_damaged_shard_is_not_reported_as_unsafe(tmp_path):
    path = fake_checkpoint(tmp_path, stage=0, world_size=1)
    (path / "checkpoint" / "mp_rank_00_model_states.pt").write_bytes(b"not a pickle at all")
    with pytest.raises(ckpt_io.IncompleteCheckpointError, match="unreadable"):
        ckpt_io.validate_checkpoint(path)


@pytest.mark.parametrize("stage", [0, 2])
def test_convert_refuses_a_payload_and_runs_it_only_with_trust_pickles(tmp_path, capsys, stage):
    from lightning_gaudi_ds.cli import main

    clean = fake_checkpoint(tmp_path / "clean", stage=stage, world_size=1)
    marker = tmp_path / "PWNED"
    file = poison(clean, tmp_path / "poisoned.ckpt", marker)
    out = tmp_path / "model.pt"
    assert main(["convert", str(tmp_path / "poisoned.ckpt"), str(out)]) == 2
    assert_refused(capsys.readouterr().out, file, "--trust-pickles")
    assert not marker.exists() and not out.exists()
    with pytest.raises(UnsafeCheckpointError) as caught:
        convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "poisoned.ckpt", out)
    assert_refused(str(caught.value), file, "weights_only=False")
    assert not marker.exists() and not out.exists()
    if stage == 0:  # (hand-made stage-2 shards cannot be merged: the real ones are, in the multiprocess test)
        assert main(["convert", str(tmp_path / "poisoned.ckpt"), str(out), "--trust-pickles"]) == 0
        assert marker.exists() and "payload" in torch.load(out, weights_only=True)


def test_serving_loads_refuse_a_payload(tmp_path):
    clean = fake_checkpoint(tmp_path / "clean", stage=2, world_size=1)
    marker = tmp_path / "PWNED"
    file = poison(clean, tmp_path / "poisoned.ckpt", marker)
    with pytest.raises(UnsafeCheckpointError) as caught:  # a directory: its shards are read before zero_to_fp32
        inference.load_full_state_dict(tmp_path / "poisoned.ckpt")
    assert_refused(str(caught.value), file, "weights_only=False")
    single = tmp_path / "model.pt"
    torch.save({"state_dict": {}, "hyper_parameters": {"x": Payload(marker)}}, single)
    for load in (inference.load_full_state_dict, inference.checkpoint_hparams):
        with pytest.raises(UnsafeCheckpointError, match="model.pt"):
            load(single)
    assert not marker.exists()
    assert "x" in inference.checkpoint_hparams(single, weights_only=False) and marker.exists()


# ------------------------------------------------------------------------------------------ real jobs
@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Real checkpoints written by 2 ranks: ZeRO-2 and ZeRO-3, fp32."""
    root = tmp_path_factory.mktemp("saved")
    plan = [{"name": f"s{stage}", "stage": stage, "dir": str(root / f"s{stage}"), "max_steps": 2, "epoch_steps": 2,
             "every": 2, "save_last": False} for stage in (2, 3)]
    run_plan(root / "out", 2, plan)
    return {f"s{stage}": root / f"s{stage}" / "epoch=0-step=2.ckpt" for stage in (2, 3)}


@pytest.mark.multiprocess
def test_every_loading_path_refuses_a_payload_and_nothing_runs(saved, tmp_path):
    poisoned: dict[str, tuple[Path, Path, Path]] = {}  # name -> (checkpoint, poisoned file, marker)
    for name, source in [("resume", "s2"), ("eval", "s3"), ("serve", "s3"), ("reshard", "s2"), ("trusted", "s2"),
                         ("convert", "s3")]:
        marker = tmp_path / f"PWNED-{name}"
        file = poison(saved[source], tmp_path / name / source, marker)
        poisoned[name] = (tmp_path / name / source, file, marker)

    def spec(name: str, stage: int, **kwargs: Any) -> dict[str, Any]:
        return {"name": name, "stage": stage, "dir": str(tmp_path / "new" / name), "max_steps": 4, "epoch_steps": 2,
                "every": 2, "save_last": False, "ckpt_path": str(poisoned[name][0]), "expect_error": True, **kwargs}

    two = [spec("resume", 2), spec("eval", 3, validate=True), spec("serve", 3, predict=True),
           spec("trusted", 2, load_weights_only=False)]
    one = [spec("reshard", 2, load_weights_only=True)]  # written by 2 ranks: resharded for 1
    _, fits = run_plan(tmp_path / "out2", 2, two)
    _, fits1 = run_plan(tmp_path / "out1", 1, one)
    fits.update(fits1)
    for name in ("resume", "eval", "serve", "reshard"):
        _, file, marker = poisoned[name]
        for rank in fits[name]:
            assert rank.get("error") == "UnsafeCheckpointError", (name, rank)
            assert "UnpicklingError" in rank["bases"] and "MisconfigurationException" in rank["bases"]
            assert_refused(rank["message"], file, "pass `weights_only=False` to trainer.fit")
        assert not marker.exists(), name
    assert all("returned" in rank for rank in fits["trusted"]), fits["trusted"]  # the opt-in loads and trains
    assert poisoned["trusted"][2].exists()  # ... and runs the payload: it is live

    checkpoint, file, marker = poisoned["convert"]
    with pytest.raises(UnsafeCheckpointError) as caught:
        convert_zero_checkpoint_to_fp32_state_dict(checkpoint, tmp_path / "model.pt")
    assert_refused(str(caught.value), file, "--trust-pickles")
    assert not marker.exists() and not (tmp_path / "model.pt").exists()
    converted = convert_zero_checkpoint_to_fp32_state_dict(checkpoint, tmp_path / "model.pt", weights_only=False)
    assert marker.exists() and converted["state_dict"]
