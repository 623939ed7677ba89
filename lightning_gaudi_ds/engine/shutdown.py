"""The process groups the strategy started end at interpreter exit, while the interpreter is still whole.

A gloo process group runs C++ threads (two ``pt_gloo_runloop`` workers and a ``gloo_tcp_loop`` per group, and rank
0's ``pt_tcpstore_uv`` store server), joined only when the last reference to the group goes. After a fit those
references live on in DeepSpeed's engine, its optimizer, the parameters it touched and its group registry (and the
engine lives on through the hooks it put on the parameters), so the groups used to die during interpreter
finalization. A worker that drops the last reference to a tensor whose Python object lives on (a parameter with
DeepSpeed's attributes) must take the GIL; a finalizing interpreter ends such a thread instead, inside C++ that may
not unwind, and the rank aborts ("terminate called without an active exception") although it finished its job
(pytorch/pytorch#179291; Lightning destroys the group at exit only for NCCL).

So at exit (``atexit``, before finalization; registered when the strategy starts the process group, so it runs
before the handlers of earlier imports) this drops DeepSpeed's handles on the groups, destroys every group and
collects them: the threads are joined while the interpreter still runs (tests/test_exit.py). It walks the garbage
collector's objects once, and asks each type once whether its objects may hold a group. A process group the user
started is theirs to end.
"""

from __future__ import annotations

import atexit
import gc

from lightning_gaudi_ds import _compat

_registered = False


def end_at_exit(started: bool) -> None:
    """Called once the strategy has its process group: if it ``started`` it, the groups and their threads end at
    interpreter exit (a group the user started is theirs to end)."""
    global _registered
    if started and not _registered:
        atexit.register(end_process_groups)
        _registered = True


def end_process_groups() -> None:
    """Release what DeepSpeed holds of the process groups, destroy the groups and collect them (at exit)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    _compat.forget_deepspeed_groups()
    _drop_deepspeed_group_references()
    dist.destroy_process_group()
    gc.collect()


def _drop_deepspeed_group_references() -> None:
    # The engine, its optimizer and the parameters it touched keep handles on the groups (data_parallel_group,
    # dp_process_group, ds_process_group, _dp_group, lists of them, ...), and the engine itself lives on through the
    # hooks it registered on the parameters. Only DeepSpeed's objects and parameters are touched, and only at exit.
    import torch
    from torch.distributed import ProcessGroup

    def holds_group(value: object) -> bool:
        return isinstance(value, ProcessGroup) or (
            isinstance(value, (list, tuple)) and any(isinstance(item, ProcessGroup) for item in value))

    parameter = torch.nn.Parameter
    watched: dict[int, bool] = {}  # by the id of a type (alive while its objects are): whether its objects are walked
    for obj in gc.get_objects():
        kind = type(obj)
        watch = watched.get(id(kind))
        if watch is None:
            # By type only: isinstance(obj, Parameter) reads attributes of every object, and torch's deprecated
            # `torch.distributed.reduce_op` warns when read (a FutureWarning per rank at exit). Asked once per type:
            # a process holds a few hundred thousand objects of a few thousand types.
            owner = vars(kind).get("__module__")  # a metaclass's instances (classes) have a descriptor here
            watch = watched[id(kind)] = ((isinstance(owner, str) and owner.startswith("deepspeed."))
                                         or issubclass(kind, parameter))
        if not watch:
            continue
        attributes = getattr(obj, "__dict__", None)
        if not isinstance(attributes, dict):
            continue
        for name in [name for name, value in attributes.items() if holds_group(value)]:
            attributes[name] = None
