"""Which addresses a node announces and dials: never the unspecified 0.0.0.0 or ::.

Listening on /ip4/0.0.0.0 binds every interface, but 0.0.0.0 is not an address anyone can dial
(another machine reaches nothing there). The node announces each interface's own address in its
place, public ones first, then private, then loopback (the first is the one people are shown).
"""
from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Sequence

import multiaddr
import psutil

log = logging.getLogger(__name__)

UNSPECIFIED = ("/ip4/0.0.0.0/", "/ip6/::/")


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
