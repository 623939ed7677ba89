"""Lightning's ``LightningCLI`` with this package's checks of the Trainer's arguments.

Lightning checks ``strategy=`` names and ``precision=`` inside ``Trainer.__init__``, before any strategy hook
runs, and its messages name only Lightning's own strategies (``strategy='deepspeed'``). This subclass checks the
parsed ``--trainer.*`` values first, in ``before_instantiate_classes``, and says what this package accepts:

    from lightning_gaudi_ds import LightningCLI        # instead of lightning.pytorch.cli.LightningCLI

It raises the exception type the Trainer would (``ValueError``) and changes nothing else.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Mapping
from typing import Any

from lightning.pytorch.cli import LightningCLI as _LightningCLI
from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lightning_gaudi_ds._compat import _PRECISION_INPUT_STR_ALIAS_CONVERSION
from lightning_gaudi_ds.core.base import REGISTERED
from lightning_gaudi_ds.devices import DEVICES
from lightning_gaudi_ds.errors import InvalidArgumentError
from lightning_gaudi_ds.precisions import PRECISIONS
from lightning_gaudi_ds.strategy import HPUDeepSpeedStrategy

# Lightning's shorthands ("16" -> "16-mixed", ...), as its connector converts them
_PRECISION_ALIASES: Mapping[str, str] = _PRECISION_INPUT_STR_ALIAS_CONVERSION
OWN_NAMES = tuple(name for name, _, _ in REGISTERED)


def check_trainer_arguments(strategy: object, precision: object, accelerator: object = "auto") -> None:
    """Refuse a strategy name no registry knows, and a precision ``HPUDeepSpeedStrategy`` cannot train in.

    ``strategy`` may be a name, a strategy instance, or LightningCLI's not yet instantiated
    ``{"class_path": ..., "init_args": ...}``. Raises ``ValueError`` naming the value and what is accepted.
    """
    if isinstance(strategy, str) and strategy.lower() != "auto":
        _check_strategy_name(strategy.lower())
    if precision is None or not _is_own_strategy(strategy):
        return
    flag = _PRECISION_ALIASES.get(str(precision), str(precision))
    device = {"gpu": "cuda"}.get(str(accelerator).lower(), str(accelerator).lower()) if isinstance(accelerator, str) \
        else None
    spec = DEVICES.get(device) if device else None
    allowed = spec.precisions if spec is not None else PRECISIONS
    if flag not in allowed:
        where = f" on accelerator={device!r}" if spec is not None else ""
        raise InvalidArgumentError(
            f"precision={precision!r} is not supported by HPUDeepSpeedStrategy{where}: DeepSpeed trains in"
            f" {', '.join(repr(p) for p in allowed)}. Set --trainer.precision (Trainer(precision=...)) to one of"
            " them; 'bf16-mixed' is the usual choice on Gaudi, CPUs and recent GPUs."
        )


def _check_strategy_name(name: str) -> None:
    available = StrategyRegistry.available_strategies()
    if name in available:
        return
    close = difflib.get_close_matches(name, list(available), n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise InvalidArgumentError(
        f"strategy={name!r} is not a registered strategy name.{hint} This package registers"
        f" {', '.join(OWN_NAMES)}; any stage can also be set by class: --trainer.strategy"
        " lightning_gaudi_ds.HPUDeepSpeedStrategy --trainer.strategy.stage 3 (Trainer(strategy="
        "HPUDeepSpeedStrategy(stage=3))). Lightning's own names: StrategyRegistry.available_strategies()."
    )


def _is_own_strategy(strategy: object) -> bool:
    if isinstance(strategy, str):
        return strategy.lower() in OWN_NAMES
    if isinstance(strategy, Strategy):
        return isinstance(strategy, HPUDeepSpeedStrategy)
    class_path = strategy.get("class_path") if isinstance(strategy, Mapping) else getattr(strategy, "class_path", None)
    if not isinstance(class_path, str) or "." not in class_path:
        return False
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False  # jsonargparse reports a class path that does not resolve
    return isinstance(cls, type) and issubclass(cls, HPUDeepSpeedStrategy)


class LightningCLI(_LightningCLI):
    """``lightning.pytorch.cli.LightningCLI`` that checks ``--trainer.strategy`` and ``--trainer.precision``
    against this package before the Trainer is built (see :func:`check_trainer_arguments`)."""

    def before_instantiate_classes(self) -> None:
        super().before_instantiate_classes()
        config: Any = self.config.get(self.subcommand) if self.subcommand else self.config
        trainer = config.get("trainer") if config is not None else None
        if trainer is not None:
            check_trainer_arguments(trainer.get("strategy"), trainer.get("precision"), trainer.get("accelerator"))

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError:
            own = self._strategy_error()
            if own is None:
                raise
            raise own from None

    def _strategy_error(self) -> Exception | None:
        """jsonargparse reports a strategy that refused its arguments under the Union of ``Trainer(strategy=)``'s
        types, in some 50 lines that begin with "Expected a <class 'str'>": build the strategy again from the parsed
        ``init_args`` to raise its own error, the first line the user reads."""
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        config: Any = self.config.get(self.subcommand) if self.subcommand else self.config
        trainer = config.get("trainer") if config is not None else None
        strategy = trainer.get("strategy") if trainer is not None else None
        if isinstance(strategy, (str, Strategy)) or strategy is None or not _is_own_strategy(strategy):
            return None
        class_path = strategy.get("class_path")
        init_args = strategy.get("init_args")
        kwargs = dict(init_args.as_dict() if hasattr(init_args, "as_dict") else init_args or {})
        if any(isinstance(v, Mapping) and "class_path" in v for v in kwargs.values()):
            return None  # an accelerator/plugin given by class: not rebuilt here
        module, _, name = class_path.rpartition(".")
        try:
            getattr(importlib.import_module(module), name)(**kwargs)
        except MisconfigurationException as err:
            message = f"--trainer.strategy {class_path}: {err}"
            try:
                return type(err)(message)
            except Exception:  # noqa: BLE001  (an exception type that takes other arguments)
                return MisconfigurationException(message)
        except Exception:  # noqa: BLE001  (another failure: jsonargparse's report stands)
            return None
        return None
