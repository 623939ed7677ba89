"""DeepSpeed activation checkpointing (``deepspeed.checkpointing``), configured from the ``activation_checkpointing``
section of the DeepSpeed config: the strategy passes its config dict, nothing here knows the strategy.

DeepSpeed is imported inside the functions that use it: importing it picks DeepSpeed's global accelerator, which
must wait until the strategy has chosen the Trainer's device.
"""

from __future__ import annotations

import copy
from typing import Any

from lightning_gaudi_ds.config import ConfigError


def set_number_checkpoints(config: dict[str, Any], count: int) -> None:
    """Put ``count`` into ``activation_checkpointing.number_checkpoints``, refusing a config that says otherwise."""
    section = config.setdefault("activation_checkpointing", {})
    if section.setdefault("number_checkpoints", count) != count:
        raise ConfigError(
            f"HPUDeepSpeedStrategy(number_checkpoints={count}) and the DeepSpeed config's"
            f" activation_checkpointing.number_checkpoints={section['number_checkpoints']!r} disagree; remove"
            " one of them."
        )


def configure(config: dict[str, Any]) -> None:
    """``deepspeed.checkpointing.configure`` from the config's section, when it has one.

    DeepSpeed reads the whole section itself (Lightning 2.6.6's version passes it key by key and drops the number of
    checkpoints, which ``contiguous_memory_optimization`` asserts without, and ``synchronize_checkpoint_boundary``).
    A copy: DeepSpeed 0.16 (Habana's fork) pops keys out of the dict it parses.
    """
    import deepspeed

    if config.get("activation_checkpointing"):
        deepspeed.checkpointing.configure(None, deepspeed_config=copy.deepcopy(config))


def contiguous(config: Any) -> bool:
    """Whether the config turns on ``contiguous_memory_optimization``."""
    section = config.get("activation_checkpointing") if isinstance(config, dict) else None
    return isinstance(section, dict) and bool(section.get("contiguous_memory_optimization"))


def reset_after_forward(config: Any) -> None:
    """After a forward without a backward (evaluation): contiguous checkpoint buffers are emptied by the backward
    pass, so a forward without one would overrun them after ``number_checkpoints`` calls. DeepSpeed's documented
    remedy is ``deepspeed.checkpointing.reset()``."""
    if contiguous(config):
        import deepspeed

        deepspeed.checkpointing.reset()
