"""Bytes on the links of the multi-node tier's hosts (tests/multinode/cluster.py) around a window of training steps.

Each host is a network namespace: its veth carries what crosses to the other host, its loopback what one rank sends
another on the same host (gloo connects ranks by the host's address, which the kernel routes over ``lo``). The
counters are the kernel's (``/sys/class/net/<dev>/statistics``, read inside the namespace with ``ip netns exec``).

The job marks its window with ``WireWindow`` (tests/jobs/common.py): before the window's first step and after its
last, every rank waits in a barrier while rank 0 writes ``<folder>/<name>.<phase>.ready`` and waits for
``<name>.<phase>.go``; :class:`WindowServer` answers each mark by reading every host's counters, then writes the
``.go``. Warm-up steps lie before the window; the barriers' few bytes lie inside it. Used by
tests/multinode/test_hpz.py and benchmarks/wire.py.
"""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from tests.multinode.cluster import Cluster, Host

STATS = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")
LOOPBACK = "lo"
# Ethernet (14) + IPv4 (20) + TCP with the timestamp option (32): the framing of one TCP segment on the veth; with
# segmentation offload a counted packet is a super-segment of up to 64 KiB with one set of headers.
TCP_FRAME_OVERHEAD = 66


def counters(host: Host) -> dict[str, dict[str, int]]:
    """``{device: {stat: value}}`` for the host's veth and its loopback."""
    devices = (host.veth, LOOPBACK)
    paths = [f"/sys/class/net/{dev}/statistics/{stat}" for dev in devices for stat in STATS]
    out = subprocess.run(["ip", "netns", "exec", host.netns, "cat", *paths], capture_output=True, text=True,
                         timeout=30, check=True).stdout.split()
    values = iter(int(v) for v in out)
    return {dev: {stat: next(values) for stat in STATS} for dev in devices}


def delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {dev: {stat: after[dev][stat] - before[dev][stat] for stat in STATS} for dev in before}


class WindowServer(threading.Thread):
    """Answers the job's window marks in ``folder`` with the hosts' counters (see the module docstring)."""

    def __init__(self, cluster: Cluster, folder: Path) -> None:
        super().__init__(daemon=True)
        self.cluster, self.folder = cluster, folder
        self.snapshots: dict[tuple[str, str], dict[str, dict[str, dict[str, int]]]] = {}
        self.error: BaseException | None = None
        self._halt = threading.Event()
        folder.mkdir(parents=True, exist_ok=True)

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                for ready in sorted(self.folder.glob("*.ready")):
                    name, phase = ready.name[: -len(".ready")].rsplit(".", 1)
                    if (name, phase) in self.snapshots:
                        continue
                    self.snapshots[(name, phase)] = {h.name: counters(h) for h in self.cluster.hosts}
                    (self.folder / f"{name}.{phase}.go").write_text(str(time.time()))
                time.sleep(0.02)
        except BaseException as err:  # noqa: BLE001  (reported by window())
            self.error = err

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)

    def window(self, name: str) -> dict[str, dict[str, dict[str, int]]]:
        """``{host: {device: {stat: difference}}}`` over the window ``name``."""
        if self.error is not None:
            raise RuntimeError(f"reading the link counters failed: {self.error!r}") from self.error
        missing = [phase for phase in ("start", "end") if (name, phase) not in self.snapshots]
        if missing:
            raise KeyError(f"window {name!r}: no {' and no '.join(missing)} mark was answered")
        start, end = self.snapshots[(name, "start")], self.snapshots[(name, "end")]
        return {host: delta(start[host], end[host]) for host in start}


def summary(window: dict[str, dict[str, dict[str, int]]], veth: dict[str, str], steps: int) -> dict[str, Any]:
    """Per step: bytes the hosts sent each other (the veths' tx, summed over hosts), the same less one TCP/IP frame
    header per counted packet (the payload), and the bytes inside hosts (loopback tx, summed; its headers are
    negligible at loopback's 64 KiB MTU). ``veth``: host name -> its veth device."""
    tx = sum(window[h][dev]["tx_bytes"] for h, dev in veth.items())
    packets = sum(window[h][dev]["tx_packets"] for h, dev in veth.items())
    lo_tx = sum(window[h][LOOPBACK]["tx_bytes"] for h in veth)
    lo_packets = sum(window[h][LOOPBACK]["tx_packets"] for h in veth)
    return {
        "inter_host_bytes": tx / steps, "inter_host_packets": packets / steps,
        "inter_host_payload_bytes": (tx - packets * TCP_FRAME_OVERHEAD) / steps,
        "intra_host_bytes": lo_tx / steps, "intra_host_packets": lo_packets / steps,
        "intra_host_payload_bytes": (lo_tx - lo_packets * TCP_FRAME_OVERHEAD) / steps,
        "per_host_tx_bytes": {h: window[h][dev]["tx_bytes"] / steps for h, dev in veth.items()},
    }
