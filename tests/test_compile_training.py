"""The HPU default path, eager mode + ``engine.compile``, run for real on CPU: 2 ranks on gloo, inductor as the
compile backend (DeepSpeed's CPU accelerator's), through Lightning's loop, then validate/test/predict.

A compiled engine must train and evaluate like the eager one: the same losses on the same data (fp32, within float
tolerance).
"""

from __future__ import annotations

import pytest

from tests.procs import run_train_job

pytestmark = pytest.mark.multiprocess


def test_compiled_engine_trains_like_the_eager_one(tmp_path):
    eager = run_train_job(tmp_path / "eager", "--stage", "2", "--precision", "32-true", "--max-steps", "4")
    compiled = run_train_job(tmp_path / "compiled", "--stage", "2", "--precision", "32-true", "--max-steps", "4",
                             "--torch-compile", timeout=900)
    for ours, ref in zip(compiled, eager):
        assert ours["engine_compiled"] is True and ref["engine_compiled"] is False
        assert ours["global_step"] == 4 and len(ours["step_losses"]) == len(ref["step_losses"]) == 4
        assert ours["step_losses"] == pytest.approx(ref["step_losses"], rel=1e-4)
        assert ours["validate"]["val_loss"] == pytest.approx(ref["validate"]["val_loss"], rel=1e-4)
        assert ours["test"]["test_loss"] == pytest.approx(ref["test"]["test_loss"], rel=1e-4)
        assert ours["predict_rows"] == ref["predict_rows"] == 128
