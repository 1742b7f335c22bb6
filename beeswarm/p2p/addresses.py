"""Which addresses a node announces and dials: never the unspecified 0.0.0.0 or ::, loopback only from its
own host, a private address only from its own network.

Listening on /ip4/0.0.0.0 binds every interface, but 0.0.0.0 is not an address anyone can dial
(another machine reaches nothing there). The node announces each interface's own address in its
place, public ones first, then private; loopback only when it has nothing else (a node listening on
127.0.0.1 alone), since another host dialling 127.0.0.1 reaches itself. A private address (10/8,
192.168/16, ...) is dialled only by a host on that network: from elsewhere it reaches nothing, or
someone else's machine.
"""
from __future__ import annotations

import functools
import ipaddress
import logging
import socket
import time
from collections.abc import Iterable, Sequence
from typing import TypeVar

import multiaddr
import psutil

log = logging.getLogger(__name__)

UNSPECIFIED = ("/ip4/0.0.0.0/", "/ip6/::/")
T = TypeVar("T", str, multiaddr.Multiaddr)


def unspecified(addr: str) -> bool:
    """Whether a multiaddr's host is 0.0.0.0 or :: (listen-only addresses nobody can dial)."""
    return (addr if addr.endswith("/") else addr + "/").startswith(UNSPECIFIED)


def _rank(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> int:
    return 2 if ip.is_loopback else 0 if ip.is_global else 1


def interface_ips(version: int) -> list[str]:
    """This host's IPv4 (`version` 4) or IPv6 addresses a peer could dial, best first: public, private,
    loopback. Link-local and unspecified addresses are left out (they need a zone or reach nothing)."""
    family = socket.AF_INET if version == 4 else socket.AF_INET6
    found: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    try:
        interfaces = psutil.net_if_addrs()
    except Exception as e:  # noqa: BLE001 - no permission to list interfaces, and the like
        log.debug("cannot list network interfaces: %s", e)
        interfaces = {}
    for entries in interfaces.values():
        for entry in entries:
            if entry.family != family:
                continue
            try:
                ip = ipaddress.ip_address(entry.address.split("%")[0])
            except ValueError:
                continue
            if ip.is_link_local or ip.is_unspecified or ip.is_multicast or ip in found:
                continue
            found.append(ip)
    loopback = ipaddress.ip_address("127.0.0.1" if version == 4 else "::1")
    if loopback not in found:  # every host can be dialled on loopback by its own processes
        found.append(loopback)
    return [str(ip) for ip in sorted(found, key=_rank)]  # stable: interface order within a rank


def concrete(addrs: Sequence[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
    """`addrs` with each 0.0.0.0 / :: replaced by this host's interface addresses (same port), no repeats.

    Fits py-libp2p's `addrs_factory`: the host announces what this returns."""
    out: list[multiaddr.Multiaddr] = []
    seen: set[str] = set()
    for addr in addrs:
        text = str(addr)
        if unspecified(text):
            version = 4 if text.startswith("/ip4/") else 6
            rest = text.split("/", 3)[3]  # what follows /ip4/0.0.0.0/
            expanded = [f"/ip{version}/{ip}/{rest}" for ip in interface_ips(version)]
        else:
            expanded = [text]
        for one in expanded:
            if one not in seen:
                seen.add(one)
                out.append(addr if one == text else multiaddr.Multiaddr(one))
    return out


def tcp_ports(addrs: Iterable[str]) -> tuple[int, ...]:
    """The TCP ports of direct addresses (a relayed one's port is its relay's)."""
    ports = []
    for addr in addrs:
        parts = addr.split("/")
        if "/p2p-circuit" not in addr and len(parts) > 4 and parts[3] == "tcp":
            ports.append(int(parts[4]))
    return tuple(dict.fromkeys(ports))


def announced(addrs: Sequence[T]) -> list[T]:
    """What a node tells other hosts of `addrs` (its concrete addresses, multiaddrs or their text): loopback ones
    only if it has no other."""
    others = [a for a in addrs if not _loopback(str(a))]
    return others if others else list(addrs)


def _host_ip(addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    parts = addr.split("/")
    if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
        try:
            return ipaddress.ip_address(parts[2])
        except ValueError:
            return None
    return None


def _loopback(addr: str) -> bool:
    ip = _host_ip(addr)
    return ip is not None and ip.is_loopback


@functools.lru_cache(maxsize=1)
def _local_networks(epoch: int) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """The networks this host's interfaces are on (`epoch`: the cache's minute)."""
    found = []
    try:
        interfaces = psutil.net_if_addrs()
    except Exception:  # noqa: BLE001
        return ()
    for entries in interfaces.values():
        for entry in entries:
            if entry.family not in (socket.AF_INET, socket.AF_INET6) or not entry.netmask:
                continue
            try:
                found.append(ipaddress.ip_network(f"{entry.address.split('%')[0]}/{entry.netmask}", strict=False))
            except ValueError:
                continue
    return tuple(found)


PRIVATE_NETS = tuple(ipaddress.ip_network(n) for n in (  # reachable only from their own network
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7"))


def is_public(ip: str) -> bool:
    """Whether other networks can route to `ip`: not private, shared (CGNAT), loopback or link-local. The
    documentation ranges count as public (Python calls them private; the test bed's internet uses them)."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return False
    return not (address.is_loopback or address.is_link_local or address.is_unspecified or address.is_multicast
                or any(address in net for net in PRIVATE_NETS))


def worth_dialling(addr: str) -> bool:
    """Whether this host can hope to reach `addr`: a relayed address if its relay's is; a private address only
    on a network this host is on; a public or loopback one (only a loopback-only node announces it, and that
    node is on this host) or a name, yes."""
    if "/p2p-circuit" in addr:
        return worth_dialling(addr.split("/p2p-circuit")[0])
    ip = _host_ip(addr)
    if ip is None or ip.is_loopback or is_public(str(ip)):
        return True
    if ip.is_link_local or ip.is_unspecified or ip.is_multicast:
        return False
    return any(ip in net for net in _local_networks(int(time.monotonic() // 60)) if net.version == ip.version)
