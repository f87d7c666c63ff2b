"""The network facts the launchers, training and the doctor check: addresses, loopback,
interfaces, link speeds."""

from __future__ import annotations

from pathlib import Path

import pytest

from {{ cookiecutter.package_name }} import train
from {{ cookiecutter.package_name }}.cluster import network

from ..helpers import FAST

pytestmark = pytest.mark.standalone


def test_loopback_addresses_are_told_from_network_ones() -> None:
    assert network.is_loopback("127.0.0.1")
    assert network.is_loopback("127.0.1.1")  # the classic /etc/hosts line for the host name
    assert network.is_loopback("::1")
    assert not network.is_loopback("10.0.0.1")
    assert not network.is_loopback("node01")  # a name, not an address


def test_an_address_of_this_machine_is_local_and_another_is_not() -> None:
    assert network.is_local("127.0.0.1")
    assert not network.is_local("192.0.2.123")  # TEST-NET-1: never a local address


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [("node01:29500", ("node01", 29500)), ("[fe80::1]:29500", ("fe80::1", 29500))],
)
def test_endpoints_split_into_host_and_port(endpoint: str, expected: tuple[str, int]) -> None:
    assert network.split_endpoint(endpoint) == expected


@pytest.mark.parametrize("endpoint", ["node01", "node01:", ":29500", "node01:port", "node01:70000"])
def test_a_malformed_endpoint_is_refused_with_the_form_expected(endpoint: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        network.split_endpoint(endpoint)


def test_the_loopback_interface_is_found_with_its_address() -> None:
    loopback = network.interfaces()["lo"]
    assert loopback.address == "127.0.0.1"
    assert loopback.is_loopback
    assert "lo" not in {interface.name for interface in network.network_interfaces()}


def test_a_missing_gloo_interface_is_named_with_those_that_exist() -> None:
    [problem] = network.interface_problems({"GLOO_SOCKET_IFNAME": "eth-missing"})
    assert "GLOO_SOCKET_IFNAME=eth-missing" in problem
    assert "no interface named 'eth-missing'" in problem


def test_nccl_interfaces_are_prefixes_unless_exact_and_exclusions_are_not_checked() -> None:
    assert network.interface_problems({"NCCL_SOCKET_IFNAME": "l"}) == []  # matches lo
    assert network.interface_problems({"NCCL_SOCKET_IFNAME": "^docker,lo"}) == []
    [problem] = network.interface_problems({"NCCL_SOCKET_IFNAME": "=l"})
    assert "no interface named 'l'" in problem
    [problem] = network.interface_problems({"NCCL_SOCKET_IFNAME": "ib"})
    assert "no interface starting with 'ib'" in problem


def test_gloo_uses_the_address_of_the_interface_it_is_given() -> None:
    assert network.gloo_address({"GLOO_SOCKET_IFNAME": "lo"}) == "127.0.0.1"


def test_a_link_speed_is_taken_from_a_nic_and_not_from_a_virtual_interface(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A veth (a container's eth0, a namespace's link) says 10000 Mb/s whatever carries it; a
    NIC's speed, and that of a VLAN stacked on it, is the link's."""
    for name, speed in (("eth0", "25000"), ("eth0.7", "25000"), ("veth0", "10000")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "speed").write_text(f"{speed}\n")
    (tmp_path / "eth0" / "device").mkdir()
    (tmp_path / "eth0.7" / "lower_eth0").mkdir()
    monkeypatch.setattr(network, "SYS_NET", tmp_path)
    names = [(1, "eth0"), (2, "eth0.7"), (3, "veth0")]
    monkeypatch.setattr(network.socket, "if_nameindex", lambda: names)
    speeds = {name: found.speed_mbps for name, found in network.interfaces().items()}
    assert speeds == {"eth0": 25000, "eth0.7": 25000, "veth0": None}


def test_training_under_plain_torchrun_refuses_a_missing_interface_in_one_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Rank 1 of 2, as torchrun or srun start it, where no launcher checked the interfaces:
    exit 2 with the variable and the interfaces there, not gloo's `enforce fail`. (Without a
    rendezvous address it has no other rank to tell.)"""
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert train.main([*FAST, f"run.dir={tmp_path}"]) == 2
    [message] = capsys.readouterr().err.strip().splitlines()
    assert message.startswith("error: GLOO_SOCKET_IFNAME=nosuch0: this machine (")
    assert "has no interface named 'nosuch0'; its interfaces: " in message
