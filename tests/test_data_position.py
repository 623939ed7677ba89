"""Exact mid-epoch resume (lightning_gaudi_ds/checkpoint/data_position.py): a resumed fit goes on with the batch after
the last one its checkpoint consumed.

The unit tests take the skipping samplers apart. The process test is one real 2-rank job (tests/jobs/ckpt_job.py on
gloo): per loader kind a single-epoch run of 8 steps saving every 4, the same cut at step 6, and a
``ckpt_path="last"`` resume of the cut run that must equal the uninterrupted run step by step; the same with the
option off (Lightning's behaviour: the epoch is re-read from its start, so the steps differ), and an IterableDataset,
whose position cannot be restored (one warning). Another runs tests/jobs/restart_job.py under ``spawn --max_restarts
1`` with a rank SIGKILLed mid-epoch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from lightning_gaudi_ds import HPUDeepSpeedStrategy
from lightning_gaudi_ds.checkpoint.data_position import SkipBatchSampler, SkipSampler, skip_batches, unrestorable
from lightning_gaudi_ds.errors import ConfigError
from tests.test_checkpoint import flat, run_plan, steps

E = 8  # optimizer steps in the one epoch; checkpoints every 4, the cut run stops at 6
VARIANTS = {  # Lightning's DistributedSampler(shuffle=True), the user's own sampler (wrapped by Lightning), the user's
    "plain": {}, "own": {"sampler": "reversed"}, "unshuffled": {"sampler": "unshuffled"},  # DistributedSampler
    "accumulate": {"accumulate": 2},  # (shuffle=False), and accumulate_grad_batches=2
}
SAMPLERS = {"plain": "DistributedSampler", "own": "DistributedSamplerWrapper", "unshuffled": "DistributedSampler",
            "accumulate": "DistributedSampler"}


# --------------------------------------------------------------------------------------------------- unit
@pytest.mark.parametrize("drop_last", [False, True])
def test_a_batch_sampler_skips_its_first_batches_once(drop_last: bool) -> None:
    inner = BatchSampler(SequentialSampler(range(23)), batch_size=4, drop_last=drop_last)
    skipping = SkipBatchSampler(inner, 3)
    assert len(skipping) == len(inner)  # Lightning counts the skipped batches as done
    assert list(skipping) == list(inner)[3:]
    assert list(skipping) == list(inner)  # the next epoch is whole


def test_a_custom_batch_sampler_skips_whole_batches() -> None:
    batches = [[5, 1], [0], [7, 2, 3], [4, 6]]
    assert list(SkipBatchSampler(batches, 2)) == batches[2:]


def test_a_distributed_sampler_keeps_its_epoch_and_order() -> None:
    data = TensorDataset(torch.arange(40.0))
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=2, rank=1, shuffle=True))
    loader.sampler.set_epoch(3)  # type: ignore[attr-defined]
    expected = [b[0].tolist() for b in loader][2:]
    skip_batches(loader, 2)
    loader.batch_sampler.sampler.set_epoch(3)  # type: ignore[union-attr]  # what Lightning's _set_sampler_epoch calls
    assert [b[0].tolist() for b in loader] == expected
    assert len(loader) == 5


def test_a_loader_without_batch_size_skips_samples() -> None:
    loader = DataLoader(TensorDataset(torch.arange(6.0)), batch_size=None)
    skip_batches(loader, 4)
    assert isinstance(loader.sampler, SkipSampler) and [float(b[0]) for b in loader] == [4.0, 5.0]


def test_what_cannot_be_restored_is_named_with_the_fix() -> None:
    data = TensorDataset(torch.arange(8.0))
    assert unrestorable(DataLoader(data, batch_size=2)) is None
    assert unrestorable(DataLoader(data, sampler=RandomSampler(data, generator=torch.Generator()))) is None
    assert "generator=torch.Generator().manual_seed" in str(unrestorable(DataLoader(data, shuffle=True)))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self) -> Any:
            return iter(range(3))

    assert "StatefulDataLoader" in str(unrestorable(DataLoader(Stream())))


def test_resume_data_position_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match=r"resume_data_position='yes': pass True .* or False"):
        HPUDeepSpeedStrategy(resume_data_position="yes")  # type: ignore[arg-type]
    assert HPUDeepSpeedStrategy().resume_data_position is True


def test_the_skip_benchmark_skips_half_an_epoch_by_index() -> None:
    from benchmarks.data_skip import measure

    figures = measure(samples=100_000, batch=32, ranks=2)
    assert figures["skipped_batches"] == 781 and figures["first_batch_after_skip_s"] < 5


# ------------------------------------------------------------------------------------------------ real job
@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("data_position")
    base = {"stage": 2, "epoch_steps": E, "max_steps": E, "every": 4}
    plan: list[dict[str, Any]] = []
    for name, extra in VARIANTS.items():
        cut = str(root / f"{name}-cut")
        plan += [{**base, **extra, "name": f"{name}-full", "dir": str(root / f"{name}-full")},
                 {**base, **extra, "name": f"{name}-cut", "dir": cut, "max_steps": 6},
                 {**base, **extra, "name": f"{name}-last", "dir": cut, "ckpt_path": "last"}]
    plan += [{**base, "name": "off", "dir": str(root / "off"), "resume_data_position": False,
              "ckpt_path": str(root / "plain-cut" / "epoch=0-step=4.ckpt")},
             {**base, "name": "iterable-cut", "dir": str(root / "iterable"), "iterable": True, "max_steps": 6},
             {**base, "name": "iterable-last", "dir": str(root / "iterable"), "iterable": True, "ckpt_path": "last"}]
    result, fits = run_plan(Path(root / "out"), 2, plan, timeout=600)
    return {"fits": fits, "output": result.output}


def _same_as_uninterrupted(full: dict[str, Any], resumed: dict[str, Any]) -> None:
    assert resumed["start"]["global_step"] == 4 and resumed["global_step"] == E
    assert sorted(resumed["records"], key=int) == [str(s) for s in range(5, E + 1)]
    assert steps(resumed, 5, E) == pytest.approx(steps(full, 5, E), rel=1e-6, abs=1e-7)
    assert flat(resumed["end"]["outputs"]) == pytest.approx(flat(full["end"]["outputs"]), rel=1e-6, abs=1e-7)


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_last_resume_mid_epoch_equals_the_uninterrupted_run(job: dict[str, Any], variant: str) -> None:
    fits = job["fits"]
    for full, resumed in zip(fits[f"{variant}-full"], fits[f"{variant}-last"], strict=True):
        assert full["sampler"] == SAMPLERS[variant] and full["shuffled"] == (variant != "unshuffled")
        _same_as_uninterrupted(full, resumed)


@pytest.mark.multiprocess
def test_turned_off_the_epoch_is_reread_from_its_start_as_lightning_does(job: dict[str, Any]) -> None:
    for full, resumed in zip(job["fits"]["plain-full"], job["fits"]["off"], strict=True):
        assert resumed["start"]["global_step"] == 4
        assert steps(resumed, 5, E) != pytest.approx(steps(full, 5, E), rel=1e-6, abs=1e-7)
    assert job["output"].count("You're resuming from a checkpoint that ended before the epoch ended") == 1


@pytest.mark.multiprocess
def test_an_iterable_dataset_is_named_once_and_the_fit_goes_on(job: dict[str, Any]) -> None:
    assert [r["global_step"] for r in job["fits"]["iterable-last"]] == [E, E]
    warned = [line for line in job["output"].splitlines() if "cannot be restored" in line]
    assert len(warned) == 1 and "train loader 0 (DataLoader)" in warned[0] and "StatefulDataLoader" in warned[0]



RESTART_JOB = ("--data", "--steps", "16", "--every", "4")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.test_restart import reference_job

    out = tmp_path_factory.mktemp("uninterrupted")
    reference_job(out, RESTART_JOB).check()
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize(("kill", "resumed_at"), [("0:6:1:KILL", 4), ("0:6:all:TERM", 7)], ids=["sigkill", "sigterm"])
def test_a_restart_mid_epoch_ends_with_the_uninterrupted_weights(uninterrupted: Path, tmp_path: Path, kill: str,
                                                                 resumed_at: int) -> None:
    """``spawn --max_restarts 1``, one 16-step epoch saving every 4: rank 1 SIGKILLed at step 6 (the restart resumes
    from "last", step 4), or every rank SIGTERMed there (preempted: saved after step 6, at 7). The restart skips the
    epoch's batches the checkpoint consumed and ends with the uninterrupted run's fp32 weights."""
    from tests.test_restart import spawn_job

    spawn_job(tmp_path, ("--max_restarts", "1"), (*RESTART_JOB, "--kill", kill)).check()
    attempts = [json.loads((tmp_path / f"attempt{a}-rank0.json").read_text()) for a in range(2)]
    assert attempts[0]["steps"][-1] == 6 and attempts[1]["steps"] == list(range(resumed_at, 16))
    ran = json.loads((uninterrupted / "attempt0-rank0.json").read_text())["batches"]
    assert attempts[1]["batches"] == pytest.approx(ran[resumed_at:], rel=1e-9)  # the batches after the checkpoint's
    expected, got = torch.load(uninterrupted / "weights.pt"), torch.load(tmp_path / "weights.pt")
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)
