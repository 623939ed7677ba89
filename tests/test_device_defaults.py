"""Unit tests of the per-device ZeRO communication defaults (devices.DeviceSpec.zero_defaults) and of their
application by config resolution: only where the user set nothing, reported in ``filled`` with the reason."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_gaudi_ds.config import AutoContext, resolve_config
from lightning_gaudi_ds.config.resolve import ConfigResolver
from lightning_gaudi_ds.devices import DEVICES

Z = "zero_optimization"


def ctx(device: str, **kwargs: Any) -> AutoContext:
    return AutoContext(world_size=2, micro_batch_size=8, precision="bf16-mixed", hidden_size=64, device_type=device,
                       zero_defaults=DEVICES[device].zero_defaults, **kwargs)


def zero(device: str, section: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    return resolve_config({Z: section}, ctx(device, **kwargs)).config[Z]


@pytest.mark.parametrize("stage", [1, 2])
def test_cpu_zero12_reduces_to_the_owner_without_overlap(stage: int) -> None:
    out = resolve_config({Z: {"stage": stage}}, ctx("cpu"))
    assert out.config[Z] == {"stage": stage, "overlap_comm": False, "reduce_scatter": True,
                             "contiguous_gradients": True, "use_multi_rank_bucket_allreduce": False}
    reasons = [line for line in out.filled if line.startswith(f"{Z}.use_multi_rank_bucket_allreduce = false")]
    assert reasons == [f"{Z}.use_multi_rank_bucket_allreduce = false (cpu default for ZeRO-{stage}: reduce each"
                       " gradient slice to its owner: 1.0x DDP's bytes instead of all-reduce's 1.5x)"]
    overlap = f"{Z}.overlap_comm = false (cpu default for ZeRO-{stage}: no streams"
    assert any(line.startswith(overlap) for line in out.filled)


def test_each_device_has_its_own_defaults() -> None:
    assert zero("cuda", {"stage": 2}) == {"stage": 2, "overlap_comm": True, "reduce_scatter": True,
                                          "contiguous_gradients": True, "use_multi_rank_bucket_allreduce": False}
    # Habana's validated Gaudi ZeRO-2: overlap, reduce-scatter and contiguous gradients off (all-reduce path)
    assert zero("hpu", {"stage": 2}) == {"stage": 2, "overlap_comm": False, "reduce_scatter": False,
                                         "contiguous_gradients": False}
    assert zero("hpu", {"stage": 1}) == {"stage": 1, "overlap_comm": False, "contiguous_gradients": False}
    # ZeRO-3 has its own reduction (stage3.py): the ZeRO-1/2 switch is not added
    assert zero("cpu", {"stage": 3}) == {"stage": 3, "overlap_comm": False, "contiguous_gradients": True}


def test_user_values_win() -> None:
    section = {"stage": 2, "overlap_comm": True, "reduce_scatter": False, "use_multi_rank_bucket_allreduce": True}
    out = resolve_config({Z: section}, ctx("cpu"))
    assert out.config[Z] == {**section, "contiguous_gradients": True}
    assert [line.split(" = ")[0] for line in out.filled if line.startswith(Z)] == [f"{Z}.contiguous_gradients"]
    # the seed's Gaudi-style ZeRO-2 (all-reduce): kept as written, no switch that would have no effect
    seed = {"stage": 2, "overlap_comm": False, "reduce_scatter": False, "contiguous_gradients": False}
    assert zero("cpu", seed) == seed
    # an explicit strategy argument counts as the user's value too
    assert zero("cpu", {"stage": 2}, strategy_args={"overlap_comm": True})["overlap_comm"] is True


def test_auto_takes_the_device_default_or_deepspeed_s() -> None:
    out = resolve_config({Z: {"stage": 3, "overlap_comm": "auto", "reduce_scatter": "auto"}}, ctx("cpu"))
    assert out.config[Z] == {"stage": 3, "overlap_comm": False, "contiguous_gradients": True}
    assert f"{Z}.reduce_scatter = DeepSpeed's default (no cpu default for ZeRO-3)" in out.filled


def test_nothing_without_zero_or_device() -> None:
    assert Z not in resolve_config({}, ctx("cpu")).config
    assert zero("cpu", {"stage": 0}) == {"stage": 0}
    plain = AutoContext(world_size=2, micro_batch_size=8, hidden_size=64)  # no device known: config as written
    assert resolve_config({Z: {"stage": 2}}, plain).config[Z] == {"stage": 2}


def test_lightning_default_config_takes_the_device_defaults() -> None:
    """Lightning's default config carries its argument defaults (overlap_comm=True, ...): they are not the user's."""
    lightning_default = {Z: {"stage": 2, "overlap_comm": True, "reduce_scatter": True, "contiguous_gradients": True,
                             "allgather_partitions": True}}
    resolver = ConfigResolver({"stage": 2})
    out = resolver.resolve(resolver.start(lightning_default, hidden=None), ctx("cpu"))
    assert out[Z]["overlap_comm"] is False and out[Z]["use_multi_rank_bucket_allreduce"] is False
    assert out[Z]["allgather_partitions"] is True
    passed = ConfigResolver({"stage": 2, "overlap_comm": True})  # HPUDeepSpeedStrategy(overlap_comm=True)
    assert passed.resolve(passed.start(lightning_default, hidden=None), ctx("cpu"))[Z]["overlap_comm"] is True


def test_a_default_chosen_after_resolution_is_published_with_the_filled_keys() -> None:
    """The optimizer's CPU default is known once configure_optimizers ran, after resolution: it joins the log."""
    resolver = ConfigResolver({"stage": 2})
    resolver.add_filled("not yet resolved: nothing to join")  # no pending fit: nothing happens
    resolver.resolve(resolver.start({Z: {"stage": 2}}, hidden=None), ctx("cpu"))
    resolver.add_filled("optimizer: AdamW(fused=True) (cpu default)")
    pending = resolver.take_unpublished()
    assert pending is not None and pending[0].filled[-1] == "optimizer: AdamW(fused=True) (cpu default)"
    assert not any("not yet resolved" in line for line in pending[0].filled)
    assert resolver.take_unpublished() is None


def test_strategy_resolves_with_its_device() -> None:
    import lightning as L
    from torch import nn

    from lightning_gaudi_ds import HPUDeepSpeedStrategy

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)

    strategy = HPUDeepSpeedStrategy(stage=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    model = Model()
    model.trainer = trainer
    strategy.connect(model)
    strategy._format_config()
    assert strategy.config[Z]["overlap_comm"] is False
    assert strategy.config[Z]["use_multi_rank_bucket_allreduce"] is False
