"""What NCCL says it uses, read from its INFO log (NCCL_DEBUG=INFO): the network between nodes
and what carries each connection.

NCCL names its choices as a communicator starts (the doctor's tests hold recorded excerpts):

    NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:10.0.0.1<0>
    NCCL INFO NET/IB : Using [0]mlx5_10:1/RoCE [RO]; OOB enp220s0np0:11.1.128.136<0>
    NCCL INFO NET/IB : No device found.
    NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>
    NCCL INFO Using network Socket
    NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA
    NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
    NCCL INFO Channel 00/0 : 1[1] -> 0[0] via SHM/direct/direct

A line that merely mentions NET/IB says nothing about its use: `NET/IB : No device found.` is
NCCL looking for an InfiniBand or RoCE device, finding none, and going on to TCP sockets. The
network is the one of `Using network NAME` (else the device list that NCCL printed last), and
InfiniBand is told from RoCE by the link layer NCCL prints after each device (`/IB`, `/RoCE`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

INFINIBAND, ROCE, SOCKETS = "InfiniBand", "RoCE", "sockets (TCP)"
GPUDIRECT = "GPUDirect RDMA"
#: What each kind of channel says it goes through, by the first part of its `via`.
WITHIN_NODE = {"P2P": "NVLink/PCIe peer-to-peer (P2P)", "SHM": "shared memory (SHM)"}

_CHOSEN = re.compile(r"NCCL INFO Using network (.+?)\s*$", re.MULTILINE)
_IB_DEVICES = re.compile(r"NCCL INFO NET/IB : Using (.*)$", re.MULTILINE)
_SOCKET_DEVICES = re.compile(r"NCCL INFO NET/Socket : Using (.*)$", re.MULTILINE)
_NO_IB_DEVICE = "NET/IB : No device found"
_VIA = re.compile(r"NCCL INFO Channel .* via (.+?)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Transports:
    """NCCL's choices, as its log tells them; empty where it told nothing."""

    #: Between nodes: INFINIBAND, ROCE, SOCKETS or a plugin's own name; None when not logged.
    network: str | None = None
    #: NCCL looked for an InfiniBand or RoCE device and found none.
    no_ib_device: bool = False
    #: What the channels go through: WITHIN_NODE's names, the network's, GPUDIRECT.
    channels: tuple[str, ...] = ()

    def describe(self) -> str:
        """`network InfiniBand; channels via ...`, or what is missing."""
        parts = []
        if self.network:
            found = " after finding no InfiniBand/RoCE device" if self.no_ib_device else ""
            parts.append(f"network {self.network}{found}")
        if self.channels:
            parts.append(f"channels via {', '.join(self.channels)}")
        return "; ".join(parts) or "nothing on its transports"


def transports(log: str) -> Transports:
    """What NCCL's INFO log `log` (one process's or several concatenated) says it uses."""
    devices = " ".join(_IB_DEVICES.findall(log))
    # The link layer NCCL printed after each device it uses: RoCE only if none says IB.
    ib_kind = ROCE if "/RoCE" in devices and "/IB" not in devices else INFINIBAND
    chosen = _CHOSEN.findall(log)
    if chosen:
        network: str | None = _kind_of(chosen[-1], ib_kind)
    elif devices:
        network = ib_kind
    else:
        network = SOCKETS if _SOCKET_DEVICES.search(log) else None
    channels: dict[str, None] = {}  # in the order first seen
    for via in _VIA.findall(log):
        kind, _, rest = via.partition("/")
        if kind in WITHIN_NODE:
            channels[WITHIN_NODE[kind]] = None
        elif kind == "NET":
            channels[_kind_of(rest.split("/")[0], ib_kind)] = None
            if via.endswith("/GDRDMA"):
                channels[GPUDIRECT] = None
    return Transports(network, _NO_IB_DEVICE in log, tuple(channels))


def _kind_of(name: str, ib_kind: str) -> str:
    """A network as NCCL names it (`IB`, the HPC-X plugin's `IBext`, `Socket`, a plugin's)."""
    if name.startswith("IB"):
        return ib_kind
    if name == "Socket":
        return SOCKETS
    return name
