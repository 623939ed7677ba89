"""A class named by its import path, as strategy arguments given in YAML or JSON configs name module classes."""

from __future__ import annotations

import importlib
from typing import Any

from lightning_gaudi_ds.errors import ConfigError


def import_class(path: str, argument: str) -> Any:
    """The object ``package.module.Name`` names; ``argument`` (e.g. ``"injection_policy=..."``) for the error."""
    module_name, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(
            f"HPUDeepSpeedStrategy({argument}): cannot import {path!r} ({err}). Give the module class itself or its"
            " full import path (package.module.Class)."
        ) from err
