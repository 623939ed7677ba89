"""A class named by its import path, as strategy arguments given in YAML or JSON configs name module classes."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from torch.nn import Module

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


def module_classes(value: Sequence[type[Module] | str] | type[Module] | str | None, argument: str,
                   hint: str) -> tuple[type[Module], ...]:
    """A strategy argument naming module classes (``argument``, e.g. ``"zero3_leaf_modules"``) as the classes, import
    paths imported; anything else is a ConfigError ending with ``hint``."""
    if value is None:
        return ()
    items = [value] if isinstance(value, (str, type)) or not isinstance(value, Sequence) else list(value)
    classes = []
    for item in items:
        cls = import_class(item, f"{argument}=[{item!r}]") if isinstance(item, str) else item
        if not (isinstance(cls, type) and issubclass(cls, Module)):
            raise ConfigError(
                f"HPUDeepSpeedStrategy({argument}=...): {item!r} is not a torch.nn.Module subclass. {hint}")
        classes.append(cls)
    return tuple(classes)
