"""The error family's members that need nothing but the standard library (:mod:`lightning_gaudi_ds.errors` is
where they are imported from, with the rest of the family)."""

from __future__ import annotations


class LightningGaudiDSError(Exception):
    """The base of every error this package raises."""


# ------------------------------------------------------------- arguments outside the Trainer and Fabric
class InvalidArgumentError(LightningGaudiDSError, ValueError):
    """An argument that cannot be used as given (a ``ValueError``, as Python raises for a bad value)."""


class ArgumentTypeError(LightningGaudiDSError, TypeError):
    """An argument of the wrong type (a ``TypeError``, as Python raises for one)."""


class LaunchError(InvalidArgumentError):
    """An argument of ``lightning-gaudi-ds spawn`` or :class:`~lightning_gaudi_ds.DistributedRunner` that cannot be
    used."""


class HostfileError(LaunchError):
    """A hostfile line that DeepSpeed's and Open MPI's runners would refuse or misread."""


class AllocationError(HostfileError):
    """The SLURM allocation's variables cannot be read as the hosts of a launch, or disagree with each other or with
    the launch's arguments. A ``HostfileError``: the allocation stands in for the hostfile."""


class EnvVarError(InvalidArgumentError):
    """A package environment variable holds a value that cannot be used; the message names the variable, the value
    and what is allowed."""


class PlanError(InvalidArgumentError):
    """An input of the memory planner (``lightning-gaudi-ds plan``, :func:`~lightning_gaudi_ds.plan_memory`) that
    cannot be used."""


class ModelLoadError(LightningGaudiDSError, OSError):
    """A Hugging Face model that ``from_pretrained`` cannot load as named (an ``OSError``, as transformers raises);
    the message names the model id or the file, and what to do."""


# ----------------------------------------------------------------------------------- the machine
class SetupError(LightningGaudiDSError, RuntimeError):
    """This process or machine lacks what the request needs (the Gaudi software stack, ``mpirun``, the devices, a
    rank that never joined): a ``RuntimeError``, as torch and Lightning raise in these situations."""


class BuildLockError(SetupError):
    """A torch extension build lock that cannot be judged safe to wait on or to clear."""
