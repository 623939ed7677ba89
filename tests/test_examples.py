"""examples/train_lm.py: its data, tokenizer and model pieces, every shipped YAML parsed, and every YAML trained
for real (2 processes on gloo, a few steps of a tiny model) through the LightningCLI entry point."""

from __future__ import annotations

import csv
import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.procs import REPO, run_job

sys.path.insert(0, str(REPO / "benchmarks"))
from recipes import summary_fields as recipe_summary_fields  # noqa: E402

EXAMPLES = REPO / "examples"
CONFIGS = EXAMPLES / "configs"
YAMLS = sorted(p.name for p in CONFIGS.glob("*.yaml"))
EXPECTED = {  # yaml -> (stage, offload_optimizer, offload_parameters, strategy given as a registered name)
    "zero1_bf16.yaml": (1, False, False, True),
    "zero2_bf16.yaml": (2, False, False, False),
    "zero2_offload_bf16.yaml": (2, True, False, True),
    "zero3_bf16.yaml": (3, False, False, False),
    "zero3_offload_bf16.yaml": (3, True, True, False),
}
# A tiny model and a few steps: the recipes' wiring is under test here, not the learning.
TINY = [
    "--trainer.max_steps", "6", "--trainer.val_check_interval", "3", "--throughput.window_size", "3", "--trainer.limit_val_batches", "2",
    "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
    "--model.n_layer", "1", "--model.n_embd", "64", "--model.n_head", "2", "--model.warmup_steps", "2",
    "--data.block_size", "32", "--data.batch_size", "4", "--report.sample_tokens", "24",
]


def _load_example():
    spec = importlib.util.spec_from_file_location("train_lm", EXAMPLES / "train_lm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_lm"] = module
    spec.loader.exec_module(module)
    return module


lm = _load_example()


# ------------------------------------------------------------------------------------------ unit tests
def test_byte_tokenizer_round_trip():
    tok = lm.ByteTokenizer()
    text = "It is a truth universally acknowledged — café\n"
    ids = tok.encode(text)
    assert ids.dtype == torch.long and int(ids.max()) < tok.vocab_size == 256
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode([0xFF]) == "\ufffd"  # invalid UTF-8 is replaced, never raises


def test_token_blocks_are_shifted_windows():
    tokens = torch.arange(100)
    ds = lm.TokenBlocks(tokens, block_size=8)
    assert len(ds) == (100 - 1) // 8
    x, y = ds[3]
    assert x.tolist() == list(range(24, 32)) and y.tolist() == list(range(25, 33))
    last_x, last_y = ds[len(ds) - 1]
    assert len(last_x) == len(last_y) == 8
    with pytest.raises(ValueError, match="cannot fill one block"):
        lm.TokenBlocks(torch.arange(8), block_size=8)


def test_bundled_text_and_split(tmp_path):
    text = lm.DEFAULT_TEXT.read_text(encoding="utf-8")
    assert text.startswith("PRIDE AND PREJUDICE") and 600_000 < len(text) < 1_000_000
    dm = lm.TextDataModule(block_size=64, batch_size=4, val_fraction=0.1)
    dm.setup("fit")
    n = len(text.encode("utf-8"))
    assert len(dm.train_set) == (int(n * 0.9) - 1) // 64 and len(dm.val_set) == (n - int(n * 0.9) - 1) // 64
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 64)
    # validation text is the end of the book, not seen in training
    assert lm.ByteTokenizer().decode(dm.val_set.tokens[-40:]).strip().endswith("the means of uniting them.")
    other = tmp_path / "t.txt"
    other.write_text("ab" * 200)
    dm = lm.TextDataModule(path=str(other), block_size=16, batch_size=2)
    dm.setup("fit")
    assert lm.ByteTokenizer().decode(dm.train_set[0][0]) == "ab" * 8
    with pytest.raises(ValueError, match="val_fraction"):
        lm.TextDataModule(val_fraction=1.0)


def _tiny_module(**kw):
    module = lm.LitGPT(n_layer=2, n_head=2, n_embd=32, block_size=16, **kw)
    module.configure_model()
    return module


def test_gpt_shapes_tied_weights_and_initial_loss():
    torch.manual_seed(0)
    module = _tiny_module()
    gpt = module.model
    assert gpt.lm_head.weight is gpt.wte.weight
    assert abs(float(gpt.wte.weight.detach().std()) - 0.02) < 0.005  # GPT-2 init, not nn.Embedding's N(0, 1)
    n_params = sum(p.numel() for p in module.parameters())  # the tied matrix counted once
    assert n_params == sum(p.numel() for n, p in gpt.named_parameters() if not n.startswith("lm_head"))
    x = torch.randint(0, 256, (3, 16))
    assert module(x).shape == (3, 16, 256)
    loss = module._loss((x, torch.randint(0, 256, (3, 16))))
    assert abs(float(loss.detach()) - math.log(256)) < 0.3  # starts at chance level
    with pytest.raises(ValueError, match="block_size=16"):
        module(torch.zeros(1, 17, dtype=torch.long))


def test_gpt_is_causal():
    torch.manual_seed(0)
    module = _tiny_module().eval()
    x = torch.randint(0, 256, (1, 16))
    changed = x.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    with torch.no_grad():
        a, b = module(x), module(changed)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-6)
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_generate_is_seeded_and_crops_context():
    torch.manual_seed(0)
    module = _tiny_module()
    prompt = lm.ByteTokenizer().encode("Elizabeth")
    out = module.generate(prompt, max_new_tokens=30, seed=3)  # 9 + 30 tokens > block_size 16: context is cropped
    assert out.shape == (39,) and out[:9].tolist() == prompt.tolist()
    assert torch.equal(out, module.generate(prompt, max_new_tokens=30, seed=3))  # identical on every rank
    assert module.training  # generate() restores the mode


def test_optimizer_groups_and_schedule():
    module = _tiny_module(lr=1e-3, warmup_steps=4)
    trainer = type("T", (), {"estimated_stepping_batches": 20})()
    module._trainer = trainer
    config = module.configure_optimizers()
    decay, no_decay = config["optimizer"].param_groups
    assert all(p.ndim == 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    lr_lambda = config["lr_scheduler"]["scheduler"].lr_lambdas[0]
    assert [round(lr_lambda(s), 3) for s in (0, 3)] == [0.25, 1.0]
    assert lr_lambda(19) == pytest.approx(0.1, abs=0.01) and lr_lambda(100) == pytest.approx(0.1)


@pytest.mark.filterwarnings("ignore:.*tensorboardX.*")
def test_loss_curve_is_drawn_next_to_the_csv_log(tmp_path):
    metrics = tmp_path / "metrics.csv"
    metrics.write_text("epoch,step,train_loss,val_loss\n0,9,3.1,\n0,19,2.7,\n0,19,,2.8\n")
    curve = lm.plot_losses(metrics)
    assert curve == tmp_path / "loss_curve.png" and curve.read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss_curve.png", "metrics.csv"]


@pytest.mark.parametrize("name", YAMLS)
def test_yaml_parses_to_the_recipe(name, tmp_path, monkeypatch):
    """Every shipped YAML builds its Trainer (no process is started): strategy class, stage, offload, bf16, 2 devices."""
    from lightning_gaudi_ds import HPUDeepSpeedStrategy

    assert name in EXPECTED, f"new YAML {name}: add its expected recipe to EXPECTED"
    stage, offload_opt, offload_params, by_name = EXPECTED[name]
    text = (CONFIGS / name).read_text()
    monkeypatch.setattr(sys, "argv", ["train_lm.py"])
    assert ("class_path: lightning_gaudi_ds.HPUDeepSpeedStrategy" not in text) == by_name
    cli = lm.LMCLI(lm.LitGPT, lm.TextDataModule, args=["--config", str(CONFIGS / name),
                                                       "--trainer.default_root_dir", str(tmp_path)], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, HPUDeepSpeedStrategy)
    assert strategy.zero_stage_3 == (stage == 3)
    zero = strategy.config["zero_optimization"]
    assert zero["stage"] == stage
    assert ("offload_optimizer" in zero) == offload_opt and ("offload_param" in zero) == offload_params
    assert cli.trainer.precision == "bf16-mixed" and cli.trainer.num_devices == 2
    assert cli.model.hparams.block_size == cli.datamodule.block_size  # linked by the CLI


# ------------------------------------------------------------------------------- real 2-process runs
def _train(tmp_path: Path, *args: str, timeout: float = 420, cold: bool = False):  # ~30-60 s; slack for load
    """The example on 2 processes: ``cold``, as a user starts it (its Trainer launches the second process, each one
    imports everything and prints what the imports print); else its 2 ranks forked warm (tests/warm.py)."""
    result = run_job([sys.executable, str(EXAMPLES / "train_lm.py"), "fit", *args, *TINY,
                      "--trainer.default_root_dir", str(tmp_path)], timeout=timeout,
                     ranks=None if cold else 2).check()
    out = result.output
    assert "train_lm summary" in out, out[-3000:]
    return out


def _summary_field(out: str, name: str) -> str:
    match = re.search(rf"^{name}:\s+(.*)$", out, re.M)
    assert match, f"no '{name}:' line in the summary:\n{out[-3000:]}"
    return match.group(1)


def _check_checkpoint_exports(out: str, tmp_path: Path) -> None:
    """The sharded checkpoint converts to one fp32 file that loads without DeepSpeed and scores like the run."""
    from lightning_gaudi_ds import convert_zero_checkpoint_to_fp32_state_dict

    checkpoint = Path(_summary_field(out, "checkpoint").split(" ")[0])
    convert_zero_checkpoint_to_fp32_state_dict(checkpoint, tmp_path / "model.pt")
    model = lm.LitGPT.load_from_checkpoint(tmp_path / "model.pt", map_location="cpu")
    assert model.model.lm_head.weight is model.model.wte.weight
    dm = lm.TextDataModule(block_size=model.hparams.block_size, batch_size=4)
    dm.setup("validate")
    batches = [b for _, b in zip(range(4), dm.val_dataloader())]  # the 2 x 2 batches validated in the run
    with torch.no_grad():
        loss = sum(float(model._loss(b)) for b in batches) / len(batches)
    reported = float(re.search(r"val ([\d.]+)", _summary_field(out, "loss")).group(1))
    assert abs(loss - reported) < 0.1, (loss, reported)  # fp32 weights vs the bf16 run


def _check_run(out: str, stage: int) -> None:
    assert f"(ZeRO stage {stage}), precision bf16-mixed" in _summary_field(out, "run")
    assert "💡 Tip" not in out  # Lightning's litlogger advertisement, filtered by the example
    # nothing the user cannot act on: Lightning's LeafSpec use (filtered by the example around its run), the example's
    # save without weights_only, the exit walk's read of torch's deprecated reduce_op (engine/shutdown.py)
    # DeepSpeed's accelerator notice at import, and Lightning's model-summary note on bf16 (both filtered by the example)
    for line in ("`isinstance(treespec, LeafSpec)` is deprecated", "`weights_only` was not set",
                 "`torch.distributed.reduce_op` is deprecated", "Setting accelerator to CPU",
                 "is not supported by the model summary",
                 "The `srun` command is available on your system but is not used",  # SLURM's client, no allocation
                 "`torch.distributed.reduce_scatter_tensor` is deprecated",  # DeepSpeed's ZeRO-3 calls, both silenced
                 "`torch.distributed.all_gather_into_tensor` is deprecated"):
        assert line not in out, out[-3000:]
    assert "6 steps on 2 x cpu" in _summary_field(out, "run")
    first, last = map(float, re.findall(r"train ([\d.]+) -> ([\d.]+)", _summary_field(out, "loss"))[0])
    assert 5.0 < first < 6.0 and last < first - 0.3, (first, last)  # from chance (ln 256 = 5.55) downwards
    assert re.search(r"[\d.]+ samples/s, [\d,]+ tokens/s", _summary_field(out, "throughput"))
    fields = recipe_summary_fields(out)  # benchmarks/recipes.py reads this very summary
    assert fields["samples_per_s"] > 0 and fields["val_loss"] is not None and fields["stage"] == stage, fields
    metrics = Path(_summary_field(out, "logs"))
    rows = list(csv.DictReader(metrics.open()))
    for column in ("train/samples_per_sec", "train/items_per_sec", "train_loss", "val_loss"):
        assert any(row.get(column) for row in rows), f"{column} never logged in {metrics}"
    curve = Path(_summary_field(out, "loss curve"))
    assert curve == metrics.with_name("loss_curve.png") and curve.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    checkpoint = Path(_summary_field(out, "checkpoint").split(" ")[0])
    shards = sorted(p.name for p in checkpoint.rglob("*optim_states.pt"))
    assert len(shards) == 2, f"expected one optimizer shard per process under {checkpoint}, found {shards}"
    sample = out.split("sample:", 1)[1].splitlines()
    assert sample[2].startswith("Elizabeth") and len(sample[2]) > len("Elizabeth")


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", YAMLS)
def test_yaml_trains_two_processes(name, tmp_path):
    # The default recipe starts cold, as a user's first run does: its console shows what the imports print (the
    # filters of DeepSpeed's accelerator notice are checked there); the other recipes differ only in the strategy.
    out = _train(tmp_path, "--config", str(CONFIGS / name), cold=name == "zero2_bf16.yaml")
    _check_run(out, EXPECTED[name][0])
    if name == "zero2_bf16.yaml":  # the default recipe's checkpoint is usable outside DeepSpeed
        _check_checkpoint_exports(out, tmp_path)
    if EXPECTED[name][0] == 3:  # the blocks really are partitioned: each process holds about half the parameters
        held = float(re.search(r"holds ([\d.]+)% of the parameters", _summary_field(out, "partition")).group(1))
        assert held < 75.0, out[-3000:]


@pytest.mark.multiprocess
def test_deepspeed_json_replaces_the_strategy_arguments(tmp_path):
    """`--trainer.strategy.init_args.config PATH` on a class_path YAML: the JSON (with "auto" values) drives DeepSpeed."""
    import json

    json_path = CONFIGS / "zero2_bf16.json"  # the seed's ZeRO-2 config: overlap_comm, reduce_scatter off
    out = _train(tmp_path, "--config", str(CONFIGS / "zero2_bf16.yaml"),
                 "--trainer.strategy.init_args.config", str(json_path))
    _check_run(out, 2)
    resolved = json.loads(Path(_summary_field(out, "ds config").split(" ")[0]).read_text())
    zero = resolved["zero_optimization"]
    assert zero["overlap_comm"] is False and zero["reduce_scatter"] is False  # Lightning's own default: True
    assert resolved["train_micro_batch_size_per_gpu"] == 4  # "auto" <- --data.batch_size
