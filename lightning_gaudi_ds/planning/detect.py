"""Memory of the machine at hand: per device (HPU, CUDA) and per node (host RAM)."""

from __future__ import annotations


def detect_device_memory(device_type: str | None = None) -> int | None:
    """Bytes of memory of one accelerator (``device_type`` or the one detected); None on CPU-only machines."""
    from lightning_gaudi_ds.devices import detect_device_type

    kind = device_type or detect_device_type()
    if kind == "hpu":
        from lightning_gaudi_ds import hpu

        return hpu.total_memory()
    if kind == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory)
    return None


def detect_device_count(device_type: str | None = None) -> int:
    """Accelerators on this node (1 on a CPU-only machine)."""
    from lightning_gaudi_ds.devices import detect_device_type

    kind = device_type or detect_device_type()
    if kind == "hpu":
        from lightning_gaudi_ds import hpu

        return hpu.device_count()
    if kind == "cuda":
        import torch

        return torch.cuda.device_count()
    return 1


def detect_host_memory() -> int:
    """Bytes of RAM of this machine."""
    import psutil

    return int(psutil.virtual_memory().total)
