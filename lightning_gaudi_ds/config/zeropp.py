"""ZeRO++ in the strategy's config.

hpZ (hierarchical partitioning, ``zero_optimization.zero_hpz_partition_size``): besides its ZeRO-3 partition over
all ranks, each rank keeps a secondary partition of the parameters over the ranks of its own host, and the backward
all-gather reads that one, so that it never crosses hosts. ``HPUDeepSpeedStrategy(stage=3, hpz=True)`` sets the key
to ``"auto"``, which resolves to the devices per node of the launch (every launcher places ranks host by host, and
DeepSpeed groups ranks ``0..r-1``, ``r..2r-1``, ...). Refused below ZeRO-3, on one host, with one device per host,
and where the DeepSpeed in use has no such key.

qwZ and qgZ (``zero_quantized_weights``, ``zero_quantized_gradients``) are accepted only on a device whose DeepSpeed
accelerator has the quantizer op (:func:`lightning_gaudi_ds._compat.runs_quantized_collectives`: CUDA; not CPU, not
Habana's HPU, whose guide lists them for future releases).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from lightning_gaudi_ds._compat import deepspeed_version, runs_quantized_collectives, zero_param_intra_group
from lightning_gaudi_ds.config.keys import AUTO, HPZ_KEY, MISSING, ZERO, get, set_key
from lightning_gaudi_ds.errors import ConfigError

HPZ_NAME = HPZ_KEY.rsplit(".", 1)[-1]
#: ZeRO++'s quantized collectives: config key -> what it quantizes.
QUANTIZED_KEYS = {
    f"{ZERO}.zero_quantized_weights": "qwZ, quantized weights in the all-gather",
    f"{ZERO}.zero_quantized_nontrainable_weights": "quantized non-trainable weights",
    f"{ZERO}.zero_quantized_gradients": "qgZ, quantized gradients in the reduce-scatter",
}


def deepspeed_has_hpz() -> bool:
    """Whether the installed DeepSpeed's ZeRO config knows ``zero_hpz_partition_size`` (ZeRO++, DeepSpeed 0.9.2+)."""
    from lightning_gaudi_ds.config.load import known_keys

    return HPZ_NAME in known_keys()[1]


def check_argument(hpz: Any, stage: Any, config: Any) -> None:
    """``HPUDeepSpeedStrategy(hpz=...)`` in ``__init__``: a boolean, with ``stage=3`` (unless a config says the
    stage), on a DeepSpeed that has hpZ."""
    if not isinstance(hpz, bool):
        raise ConfigError(f"`HPUDeepSpeedStrategy(hpz={hpz!r})` is not a boolean; pass True (ZeRO++ hierarchical"
                          " partitioning for ZeRO-3 across nodes) or False.")
    if not hpz:
        return
    if config is None and stage != 3:
        raise ConfigError(
            f"`HPUDeepSpeedStrategy(stage={stage!r}, hpz=True)`: hpZ partitions ZeRO-3's parameters a second time"
            " inside each node; it needs stage=3 (below ZeRO-3 the parameters are not partitioned). Use stage=3, or"
            " drop hpz."
        )
    if not deepspeed_has_hpz():
        raise ConfigError(
            f"`HPUDeepSpeedStrategy(hpz=True)`: DeepSpeed {deepspeed_version()} has no ZeRO++ hierarchical"
            f" partitioning ({HPZ_KEY}). Install DeepSpeed 0.9.2 or later (Habana's fork 1.21: 0.16.1), or drop hpz."
        )


def adopt(config: dict[str, Any], hpz: bool, source: str | None) -> None:
    """After the config is loaded or built (in ``__init__``): ``hpz=True`` sets the key to ``"auto"``; the key set
    below ZeRO-3 is refused. ``source``: where the config came from (None: the strategy's arguments)."""
    where = f"the DeepSpeed config ({source})" if source else "HPUDeepSpeedStrategy's arguments"
    current = get(config, HPZ_KEY)
    if hpz:
        if current is not MISSING and current not in (AUTO, 1):
            raise ConfigError(
                f"`HPUDeepSpeedStrategy(hpz=True)` and {HPZ_KEY}={current!r} in {where}: hpz=True sets the"
                " secondary partition to the devices of one node. Set the key to \"auto\" or remove it, or drop hpz"
                " to keep the config's size."
            )
        set_key(config, HPZ_KEY, AUTO)
    if not requested(config):
        return
    stage = get(config, f"{ZERO}.stage")
    if stage != AUTO and stage is not MISSING and stage != 3:
        raise ConfigError(
            f"{HPZ_KEY}={get(config, HPZ_KEY)!r} ({'hpz=True' if hpz else where}) at ZeRO stage {stage!r}: hpZ"
            " partitions ZeRO-3's parameters a second time inside each node, and needs stage 3. Set"
            f" zero_optimization.stage to 3, or remove {HPZ_KEY}."
        )
    if stage == AUTO:
        raise ConfigError(f"{HPZ_KEY} with stage='auto': hpZ needs ZeRO-3, which stage='auto' may not choose. Pass"
                          " stage=3 with hpz=True.")


def requested(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` asks for hpZ: the key ``"auto"`` or a size above 1."""
    value = get(config, HPZ_KEY)
    return value == AUTO or (isinstance(value, int) and not isinstance(value, bool) and value > 1)


def check_before_launch(config: Mapping[str, Any], *, devices_per_node: int, num_nodes: int, device_type: str,
                        source: str | None) -> None:
    """Once the launch is known (the Trainer's or Fabric's constructor), before any process starts: hpZ needs 2 or
    more nodes of 2 or more devices, and a size that divides the devices of a node; qwZ/qgZ need a device DeepSpeed
    runs them on."""
    where = f" (the DeepSpeed config, {source})" if source else ""
    if requested(config):
        value = get(config, HPZ_KEY)
        shown = "`HPUDeepSpeedStrategy(hpz=True)`" if value == AUTO and not source else f"{HPZ_KEY}={value!r}{where}"
        if num_nodes < 2:
            raise ConfigError(
                f"{shown} on one node: hpZ keeps a secondary copy of ZeRO-3's partition per node so that the"
                " backward all-gather does not cross nodes; on one node it only costs memory. Drop hpz (or the key),"
                " or launch on 2 or more nodes (Trainer(num_nodes=...))."
            )
        if devices_per_node < 2:
            raise ConfigError(
                f"{shown} with 1 device per node: the secondary partition would be one rank's, as plain ZeRO-3's."
                " Drop hpz, or run 2 or more devices per node."
            )
        if value != AUTO and (value > devices_per_node or devices_per_node % value):
            raise ConfigError(
                f"{shown} with {devices_per_node} devices per node: the secondary partition must lie inside one"
                f" node, so its size must divide {devices_per_node}. Set it to \"auto\" (the devices of one node) or"
                " to a divisor."
            )
    quantized = [key for key in QUANTIZED_KEYS if get(config, key) is True]
    if quantized and not runs_quantized_collectives(device_type):
        names = ", ".join(f"{key}=true ({QUANTIZED_KEYS[key]})" for key in quantized)
        raise ConfigError(
            f"{names}{where}: DeepSpeed {deepspeed_version()} does not run ZeRO++'s quantized collectives on"
            f" {device_type!r} (its {device_type} accelerator has no quantizer op; they run on CUDA). Remove the"
            " key(s); hpZ (hpz=True) works on every device."
        )


def partition_size(config: Mapping[str, Any] | None) -> int:
    """The secondary partition's size a resolved config asks for (1: no hpZ)."""
    value = get(config, HPZ_KEY) if isinstance(config, Mapping) else MISSING
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1


@contextmanager
def engine_group(config: Mapping[str, Any] | None, zero_init: bool = False) -> Iterator[None]:
    """Around ``zero.Init`` (``zero_init``) and ``deepspeed.initialize``: DeepSpeed's process-wide hpZ group made this
    config's (:func:`lightning_gaudi_ds._compat.zero_param_intra_group`), so that several engines in one process (fit
    then test, a resume in the same process, each building its model in ``configure_model``) each get theirs."""
    stage = get(config, f"{ZERO}.stage") if isinstance(config, Mapping) else MISSING
    if stage != 3:
        yield
        return
    with zero_param_intra_group(partition_size(config), zero_init):
        yield
