"""One fit of a small, deterministic regression model, launched as a real script by the multi-process tests.

Run with plain python and Lightning's own launcher starts the other ranks; under a launcher (torchrun,
DeepSpeed's, mpirun) each rank runs it. The data comes from a LightningDataModule, so the train loader's batch
size is only known once the fit loop has run ``setup``. ``--config`` drives the strategy from a DeepSpeed JSON
config (tests/test_config_training.py); the other tests compare strategies and launchers.

Each rank writes ``<out>/rank<N>.json``: its per-step training losses and learning rates, the metrics of
validate/test and the number of predictions after fit (unless ``--no-eval``), what the engine holds (partition
sizes), the resolved ``strategy.config``, and the optimizer the engine trains with.
"""

from __future__ import annotations

import atexit
import collections
import os
import signal
import time
from typing import Any

import lightning as L
import torch
from common import (
    INPUTS,
    OUTPUTS,
    EngineProbe,
    RegressionData,
    RegressionModel,
    basic_optimizer,
    job_parser,
    say,
    start_process,
    write_result,
)
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_gaudi_ds import HPUDeepSpeedStrategy  # importing the package registers its strategy names


class Fault(L.Callback):
    """Launcher tests: rank ``rank`` (-1: every rank) raises, exits 3, kills itself or hangs at step ``step``."""

    def __init__(self, rank: int, step: int, mode: str) -> None:
        self.rank, self.step, self.mode = rank, step, mode

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.rank not in (-1, trainer.global_rank) or trainer.global_step != self.step:
            return
        say(f"rank {trainer.global_rank}: injecting fault {self.mode!r} at step {self.step}")
        if self.mode == "raise":
            raise RuntimeError(f"injected fault on rank {trainer.global_rank}")
        if self.mode == "exit":
            os._exit(3)
        if self.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)  # "hang": ignores the SIGTERM Lightning only notes; needs SIGKILL


class LateRegressionModel(RegressionModel):
    """The same model with its layers created in ``configure_model`` (under ZeRO-3 inside ``zero.Init``), and one
    micro batch as ``example_input_array``; ``hidden_layers`` width x width layers between input and output."""

    def __init__(self, hidden_layers: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hidden_layers = hidden_layers
        self.net = None  # type: ignore[assignment]
        self.example_input_array = torch.randn(16, INPUTS)

    def configure_model(self) -> None:
        if self.net is None:
            width = self.hparams.width
            hidden = [m for _ in range(self.hidden_layers) for m in (nn.Linear(width, width), nn.Tanh())]
            self.net = nn.Sequential(nn.Linear(INPUTS, width), nn.Tanh(), *hidden, nn.Linear(width, OUTPUTS))


def _print_exit_threads() -> None:
    tasks = sorted(os.listdir("/proc/self/task"))
    names = collections.Counter(open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks)
    say(f"exit-threads rank={os.environ.get('LOCAL_RANK', '0')} {dict(sorted(names.items()))}")


def main(argv: list[str] | None = None) -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--strategy", default="deepspeed", help="deepspeed | ddp | a registered name")
    parser.add_argument("--config", default=None, help="DeepSpeed JSON path; omit for PL_DEEPSPEED_CONFIG_PATH or none")
    parser.add_argument("--stage", default=None, help="pass stage= to the strategy: 0-3 or auto (its default: 2)")
    parser.add_argument("--device-memory", default=None, help="stage auto: the memory of one device to plan for")
    parser.add_argument("--measure-activations", action="store_true", help="stage auto: measure one micro batch")
    parser.add_argument("--build-in-configure-model", action="store_true",
                        help="the model's layers are created in configure_model (ZeRO-3 builds them partitioned)")
    parser.add_argument("--offload-optimizer", action="store_true")
    parser.add_argument("--offload-parameters", action="store_true")
    parser.add_argument("--torch-compile", action="store_true", help="compile the engine (engine.compile)")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--width", type=int, default=512, help="the model's hidden width")
    parser.add_argument("--hidden-layers", type=int, default=1,
                        help="with --build-in-configure-model: width x width layers (default 1, as RegressionModel)")
    parser.add_argument("--optimizer", default="sgd", help="sgd | adamw | none | adam_sched | adamw_exp")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--betas", type=float, nargs=2, default=None)
    parser.add_argument("--eps", type=float, default=None)
    parser.add_argument("--weight-decay", type=float, default=None)
    parser.add_argument("--warmup-steps", type=int, default=None, help="a hyperparameter for the config's \"auto\"")
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--no-eval", action="store_true", help="no validate/test/predict after fit")
    parser.add_argument("--csv-logger", action="store_true", help="log with CSVLogger under --out")
    parser.add_argument("--fault", default=None, help="launcher tests: RANK:STEP:raise|exit|kill|hang")
    parser.add_argument("--exit-probe", action="store_true",
                        help="print the C++ threads left when the last atexit handler runs (before finalization)")
    args = parser.parse_args(argv)
    if args.exit_probe:  # registered first, so it runs after every handler registered later (atexit is LIFO)
        atexit.register(_print_exit_threads)

    start_process()
    if args.strategy == "deepspeed":
        kwargs: dict[str, Any] = {"config": args.config}
        if args.stage is not None:
            kwargs["stage"] = args.stage if args.stage == "auto" else int(args.stage)
        if args.device_memory is not None:
            kwargs["device_memory"] = args.device_memory
        if args.measure_activations:
            kwargs["measure_activations"] = True
        if args.offload_optimizer:
            kwargs["offload_optimizer"] = True
        if args.offload_parameters:
            kwargs["offload_parameters"] = True
        if args.torch_compile:
            kwargs["torch_compile"] = True
        strategy: Any = HPUDeepSpeedStrategy(**kwargs)
    elif args.strategy == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(process_group_backend="gloo")
    else:
        strategy = args.strategy
    late = {"hidden_layers": args.hidden_layers} if args.build_in_configure_model else {}
    model = (LateRegressionModel if args.build_in_configure_model else RegressionModel)(
        width=args.width, optimizer=args.optimizer, lr=args.lr, betas=tuple(args.betas) if args.betas else None,
        eps=args.eps, weight_decay=args.weight_decay, warmup_steps=args.warmup_steps, **late,
    )
    data = RegressionData(args.batch_size)
    probe = EngineProbe()
    faults = [Fault(int(r), int(s), m) for r, s, m in [args.fault.split(":")]] if args.fault else []
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=CSVLogger(args.out) if args.csv_logger else False,
        default_root_dir=args.out,
        callbacks=[probe, *faults],
    )
    trainer.fit(model, datamodule=data)
    log_dir = trainer.log_dir  # a broadcast: every rank asks
    engine = getattr(trainer.strategy, "deepspeed_engine", None)
    basic = basic_optimizer(trainer)
    result: dict[str, Any] = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "strategy": type(trainer.strategy).__name__,
        "cluster_environment": type(getattr(trainer.strategy, "cluster_environment", None)).__name__,
        "node_rank": trainer.node_rank,
        "local_rank": trainer.local_rank,
        "backend": getattr(trainer.strategy, "_process_group_backend", None),
        "precision": trainer.precision,
        "log_dir": log_dir,
        "global_step": trainer.global_step,
        "step_losses": model.step_losses,
        "step_lrs": probe.step_lrs,
        "zero3_trace": probe.zero3_trace,
        "probe": model.probe,
        "param_dtype": str(next(model.parameters()).dtype),
        "config": getattr(trainer.strategy, "config", None),
        "chosen_configuration": getattr(trainer.strategy, "chosen_configuration", None),
        "basic_optimizer": type(basic).__name__ if basic is not None else None,
        "adam_w_mode": getattr(basic, "adam_w_mode", None),
        "fused": [g.get("fused") for g in basic.param_groups] if basic is not None else None,
    }
    if engine is not None:
        result.update(
            zero_stage=int(engine.zero_optimization_stage()),
            gradient_clipping=engine.gradient_clipping(),
            gradient_accumulation_steps=engine.gradient_accumulation_steps(),
            engine_compiled=bool(getattr(engine, "is_compiled", False)),
        )
    if not args.no_eval:
        result["validate"] = trainer.validate(model, datamodule=data, verbose=False)[0]
        result["test"] = trainer.test(model, datamodule=data, verbose=False)[0]
        predictions = trainer.predict(model, datamodule=data)
        result["predict_rows"] = sum(p.shape[0] for p in predictions)
    write_result(args.out, trainer.global_rank, result)


if __name__ == "__main__":
    main()
