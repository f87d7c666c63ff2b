"""What this machine's network looks like to the other nodes: names, addresses, interfaces.

Multi-node jobs fail first on the network, and silently: a host name that resolves to
127.0.1.1 (the classic /etc/hosts line), an interface named in GLOO_SOCKET_IFNAME that does not
exist, a rendezvous endpoint that is a loopback address. Each of these leaves the nodes waiting
for minutes with no word. The launchers (launch.py), the process-group start (agreement.py) and
the doctor read the facts here and refuse such a setting by name, before anything waits.

Only the standard library: the launchers use this module before torch is imported.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

#: The variables that name the interfaces gloo and NCCL use between nodes.
SOCKET_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
#: Where Linux describes each interface.
SYS_NET = Path("/sys/class/net")
_SIOCGIFADDR = 0x8915
_IFF_LOOPBACK = 0x8


@dataclass(frozen=True)
class Interface:
    """A network interface of this machine."""

    name: str
    #: Its IPv4 address; None when it has none.
    address: str | None
    is_loopback: bool
    is_up: bool
    #: Link speed in Mb/s as its NIC reports it; None where no NIC does: a link that is down,
    #: or a virtual interface (see `interfaces`).
    speed_mbps: int | None

    def describe(self) -> str:
        speed = f", {self.speed_mbps} Mb/s" if self.speed_mbps else ""
        state = "" if self.is_up else ", down"
        return f"{self.name} {self.address or 'no IPv4 address'}{speed}{state}"


def interfaces() -> dict[str, Interface]:
    """This machine's interfaces by name (Linux: from the kernel, no tool needed).

    The kernel's speed of a virtual interface is its driver's constant, not its link's: a veth
    pair (a container's eth0, a network namespace's link) says 10000 Mb/s whatever carries it
    or limits it (`tc`), a tun device 10. Only an interface on a device (a NIC), or stacked on
    one (a VLAN, a bond: `lower_*` in sysfs), has its speed taken.
    """
    found = {}
    for _, name in socket.if_nameindex():
        sys_dir = SYS_NET / name
        flags = _read_int(sys_dir / "flags")
        on_a_nic = (sys_dir / "device").exists() or any(sys_dir.glob("lower_*"))
        speed = _read_int(sys_dir / "speed") if on_a_nic else None
        found[name] = Interface(
            name=name,
            address=_ipv4_of(name),
            is_loopback=name == "lo" or bool(flags is not None and flags & _IFF_LOOPBACK),
            is_up=_read_text(sys_dir / "operstate") in ("up", "unknown", None),
            speed_mbps=speed if speed is not None and speed > 0 else None,
        )
    return found


def network_interfaces() -> list[Interface]:
    """The interfaces other machines could reach this one on: up, with an address, not loopback."""
    return [
        interface
        for interface in interfaces().values()
        if interface.address and interface.is_up and not interface.is_loopback
    ]


def describe_interfaces() -> str:
    """This machine's network interfaces, for a message that asks to choose one."""
    usable = network_interfaces()
    return ", ".join(interface.describe() for interface in usable) or "none with an address"


def resolve(host: str) -> list[str]:
    """The addresses `host` resolves to here, in resolver order; raises OSError when it does not."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def is_loopback(address: str) -> bool:
    """Whether `address` (an IP address) reaches only this machine."""
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def is_local(address: str) -> bool:
    """Whether `address` is one of this machine's own: a socket can bind to it."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT (or [IPv6]:PORT) as (host, port); ValueError with the form expected."""
    host, sep, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{endpoint!r} is not HOST:PORT (e.g. node01:29500)")
    return host, int(port)


def gloo_address(environ: dict[str, str] | None = None) -> str:
    """The address gloo advertises for this process, as torch chooses it.

    The first interface of GLOO_SOCKET_IFNAME; without it, the first address the host name
    resolves to that a socket can bind to (a host name that resolves to 127.0.1.1 gives that);
    else the loopback address.
    """
    environ = os.environ if environ is None else environ
    named = environ.get("GLOO_SOCKET_IFNAME", "")
    if named:
        interface = interfaces().get(named.split(",")[0])
        if interface is not None and interface.address:
            return interface.address
    try:
        for address in resolve(socket.gethostname()):
            if is_local(address):
                return address
    except OSError:
        pass
    return "127.0.0.1"


def interface_problems(environ: dict[str, str] | None = None) -> list[str]:
    """What is wrong with the interfaces that GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME name.

    GLOO_SOCKET_IFNAME is a comma-separated list of interface names. NCCL_SOCKET_IFNAME is a
    list of prefixes (`eth` matches eth0), exact names after `=`, or names to avoid after `^`
    (not checked: avoiding a missing interface is harmless).
    """
    environ = os.environ if environ is None else environ
    present = interfaces()
    problems = []
    for variable in SOCKET_INTERFACE_VARIABLES:
        value = environ.get(variable, "").strip()
        if not value or value.startswith("^"):
            continue
        exact = variable == "GLOO_SOCKET_IFNAME" or value.startswith("=")
        for wanted in filter(None, value.lstrip("=").split(",")):
            matches = [
                interface
                for name, interface in present.items()
                if name == wanted or (not exact and name.startswith(wanted))
            ]
            if not matches:
                problems.append(
                    f"{variable}={value}: this machine ({socket.gethostname()}) has no "
                    f"interface {'named' if exact else 'starting with'} {wanted!r}; its "
                    f"interfaces: {describe_interfaces()}"
                )
            elif variable == "GLOO_SOCKET_IFNAME" and not matches[0].address:
                problems.append(
                    f"{variable}={value}: interface {wanted} has no IPv4 address on "
                    f"{socket.gethostname()}; its interfaces: {describe_interfaces()}"
                )
    return problems


def _ipv4_of(name: str) -> str | None:
    """The IPv4 address of interface `name` (the SIOCGIFADDR ioctl); None when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            request = struct.pack("256s", name[:15].encode())
            packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    try:
        return int(text, 0) if text is not None else None
    except ValueError:
        return None
