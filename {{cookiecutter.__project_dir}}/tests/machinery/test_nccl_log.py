"""NCCL's transports read from its INFO log (cluster/nccl_log.py), on excerpts of each case as
NCCL 2.19-2.27 writes them: InfiniBand, RoCE, sockets after no InfiniBand device was found,
sockets only, and one node's peer-to-peer and shared-memory channels."""

from __future__ import annotations

import pytest

from {{ cookiecutter.package_name }}.cluster import nccl_log
from {{ cookiecutter.package_name }}.cluster.nccl_log import Transports

pytestmark = pytest.mark.standalone

INFINIBAND = """\
n01:4128:4128 [0] NCCL INFO Bootstrap : Using ib0:10.10.0.1<0>
n01:4128:4128 [0] NCCL INFO NET/Plugin : No plugin found, using internal implementation
n01:4128:4128 [0] NCCL INFO cudaDriverVersion 12040
NCCL version 2.21.5+cuda12.4
n01:4128:4190 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB ib0:10.0.0.1<0>
n01:4128:4190 [0] NCCL INFO Using non-device net plugin version 0
n01:4128:4190 [0] NCCL INFO Using network IB
n01:4128:4190 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/IB/0/GDRDMA
n01:4128:4190 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0/GDRDMA
n01:4128:4190 [0] NCCL INFO Connected all rings
"""

ROCE = """\
g-a:22:22 [0] NCCL INFO Bootstrap : Using eth2:11.1.0.6<0>
g-a:22:27 [0] NCCL INFO NET/IB : Using [0]mlx5_2:1/RoCE [1]mlx5_3:1/RoCE [RO]; OOB eth2:11.1.0.6<0>
g-a:22:27 [0] NCCL INFO Using network IB
g-a:22:27 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0
g-a:22:27 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[0] [send] via NET/IB/1
"""

SOCKETS_AFTER_NO_IB_DEVICE = """\
ip-172-31-12-21:45361:45361 [0] NCCL INFO Bootstrap : Using ens3:172.31.12.21<0>
ip-172-31-12-21:45361:45361 [0] NCCL INFO NET/Plugin : No plugin found (libnccl-net.so).
ip-172-31-12-21:45361:45361 [0] NCCL INFO NET/IB : No device found.
ip-172-31-12-21:45361:45361 [0] NCCL INFO NET/Socket : Using [0]ens3:172.31.12.21<0>
ip-172-31-12-21:45361:45361 [0] NCCL INFO Using network Socket
ip-172-31-12-21:45361:45402 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0
ip-172-31-12-21:45361:45402 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0
"""

SOCKETS_ONLY = """\
gpu01:124172:124172 [0] NCCL INFO NCCL_IB_DISABLE set by environment to 1.
gpu01:124172:124172 [0] NCCL INFO NCCL_SOCKET_IFNAME set by environment to eth0
gpu01:124172:124172 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.2<0>
gpu01:124172:124172 [0] NCCL INFO Using network Socket
gpu01:124172:124452 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0
"""

ONE_NODE = """\
dgx:5663:5663 [0] NCCL INFO NET/IB : No device found.
dgx:5663:5663 [0] NCCL INFO NET/Socket : Using [0]eth0:10.1.0.5<0>
dgx:5663:5663 [0] NCCL INFO Using network Socket
dgx:5663:5809 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
dgx:5663:5809 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/direct pointer/read
dgx:5664:5811 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[2] via SHM/direct/direct
"""


@pytest.mark.parametrize(
    ("log", "expected"),
    [
        (INFINIBAND, Transports("InfiniBand", False, ("InfiniBand", "GPUDirect RDMA"))),
        (ROCE, Transports("RoCE", False, ("RoCE",))),
        (SOCKETS_AFTER_NO_IB_DEVICE, Transports("sockets (TCP)", True, ("sockets (TCP)",))),
        (SOCKETS_ONLY, Transports("sockets (TCP)", False, ("sockets (TCP)",))),
        (
            ONE_NODE,
            Transports(
                "sockets (TCP)",
                True,
                ("NVLink/PCIe peer-to-peer (P2P)", "shared memory (SHM)"),
            ),
        ),
    ],
    ids=["infiniband", "roce", "sockets-after-no-ib-device", "sockets-only", "p2p-and-shm"],
)
def test_the_transports_are_those_nccl_says_it_uses(log: str, expected: Transports) -> None:
    assert nccl_log.transports(log) == expected


def test_a_line_naming_net_ib_without_a_device_is_no_infiniband() -> None:
    """What the doctor once read as InfiniBand: any line with NET/IB in it."""
    found = nccl_log.transports("h:1:1 [0] NCCL INFO NET/IB : No device found.\n")
    assert found.network is None
    assert found.no_ib_device


def test_a_fallback_to_sockets_is_described_with_its_cause() -> None:
    assert nccl_log.transports(SOCKETS_AFTER_NO_IB_DEVICE).describe() == (
        "network sockets (TCP) after finding no InfiniBand/RoCE device; channels via sockets (TCP)"
    )
