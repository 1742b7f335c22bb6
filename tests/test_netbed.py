"""The "across home routers" test bed itself (tests/netbed.py): NAT, firewall, isolation, cleanup.

Needs root and network namespaces; elsewhere the tests skip, naming the reason."""
from __future__ import annotations

import os
import random
import subprocess
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

import netbed
from netbed import EchoServer, NetBed, require_netns, sweep, tcp_probe

netns = pytest.mark.netns  # needs root and network namespaces: skips, naming why, elsewhere


@pytest.fixture(scope="module")
def net():
    """Two public hosts, a port-keeping home (alice, carol), a symmetric one (bob), and one with a
    20 Mbit uplink and a 1 s idle timeout (dave): built once (a quarter second), shared."""
    require_netns()
    with NetBed() as bed:
        home1, home2 = bed.home_router("home1"), bed.home_router("home2", symmetric=True)
        home3 = bed.home_router("home3", uplink_mbit=20, idle_timeout_s=1)
        yield SimpleNamespace(boot=bed.public_host("boot"), relay=bed.public_host("relay"),
                              home1=home1, home2=home2, home3=home3,
                              alice=bed.behind(home1, "alice"), carol=bed.behind(home1, "carol"),
                              bob=bed.behind(home2, "bob"), dave=bed.behind(home3, "dave"))


@pytest.fixture
def servers(net):
    """An echo server on each public host (per test: each test reads the clients it made)."""
    with EchoServer(net.boot) as boot, EchoServer(net.relay) as relay:
        yield boot, relay


def inner_port() -> int:
    """A local port for a client, outside the kernel's ephemeral range so nothing else holds it."""
    return random.randint(20000, 30000)


def ours() -> set[str]:
    return {ns for ns in netbed._netns_names() if ns.startswith(netbed.PREFIX)}


@netns
def test_behind_a_router_reaches_a_public_host_through_nat(net, servers):
    boot, _ = servers
    [probe] = tcp_probe(net.alice, [(net.boot.addr, boot.port)])
    assert probe.ok
    ip, port = boot.peer()
    assert ip == net.home1.addr == net.alice.public_addr  # the router's WAN address, not 10.0.1.x
    assert net.alice.addr.startswith("10.0.1.")


@netns
def test_unsolicited_inbound_is_dropped(net):
    with EchoServer(net.alice) as alice:
        # to the router's WAN address at alice's port: nothing is forwarded, the SYN is dropped
        [at_wan] = tcp_probe(net.boot, [(net.home1.addr, alice.port)], timeout=1.0)
        assert not at_wan.ok and at_wan.note == "TimeoutError"
        # to alice's private address: the internet has no route to private ranges
        [at_lan] = tcp_probe(net.boot, [(net.alice.addr, alice.port)], timeout=1.0)
        assert not at_lan.ok
        with pytest.raises(TimeoutError):
            alice.peer(timeout=0.2)
        # while her neighbour on the LAN gets through: the firewall is only on the WAN side
        [neighbour] = tcp_probe(net.carol, [(net.alice.addr, alice.port)])
        assert neighbour.ok and alice.peer() == (net.carol.addr, neighbour.local_port)


@netns
def test_ordinary_nat_keeps_the_source_port(net, servers):
    port = inner_port()
    probes = tcp_probe(net.alice, [(net.boot.addr, servers[0].port), (net.relay.addr, servers[1].port)],
                       local_port=port)
    assert [p.ok for p in probes] == [True, True]
    # the same mapping towards both hosts, and it is the inner port: what hole punching relies on
    assert servers[0].peer() == servers[1].peer() == (net.home1.addr, port)


@netns
def test_symmetric_nat_gives_each_destination_a_random_port(net, servers):
    port = inner_port()
    probes = tcp_probe(net.bob, [(net.boot.addr, servers[0].port), (net.relay.addr, servers[1].port)],
                       local_port=port)
    assert [p.ok for p in probes] == [True, True]
    (ip1, out1), (ip2, out2) = servers[0].peer(), servers[1].peer()
    assert ip1 == ip2 == net.home2.addr
    assert out1 != out2  # one inner port, two outer ones: a peer can't predict the mapping
    assert port not in (out1, out2)  # (each is random: 2 in ~64000 that one lands on it)


@netns
def test_homes_cannot_reach_each_other_by_private_address(net):
    with EchoServer(net.alice) as alice, EchoServer(net.bob) as bob:
        [to_bob] = tcp_probe(net.alice, [(net.bob.addr, bob.port)], timeout=1.0)
        [to_alice] = tcp_probe(net.bob, [(net.alice.addr, alice.port)], timeout=1.0)
        assert not to_bob.ok and not to_alice.ok
        # nor through the other's router: no port is forwarded
        [to_home1] = tcp_probe(net.bob, [(net.home1.addr, alice.port)], timeout=1.0)
        assert not to_home1.ok


@netns
def test_uplink_rate_limit_is_applied(net):
    shaped = net.home3.run(["tc", "qdisc", "show", "dev", "wan"], check=True).stdout
    assert "tbf" in shaped and "rate 20Mbit" in shaped
    assert "tbf" not in net.home1.run(["tc", "qdisc", "show", "dev", "wan"], check=True).stdout


def sysctl(host, key: str) -> str:
    argv = ["sysctl", "-n", key]
    return (host.run(argv, check=True) if host else subprocess.run(argv, capture_output=True, text=True,
                                                                    check=True)).stdout.strip()


@pytest.mark.slow  # 3 s or more: out of `make test-fast`
@netns
def test_idle_timeout_forgets_established_flows(net, servers):
    key = "net.netfilter.nf_conntrack_tcp_timeout_established"
    host_before = sysctl(None, key)
    assert sysctl(net.home3, key) == "1"
    assert sysctl(net.home1, key) == host_before  # per namespace: the other routers and the host keep theirs
    # each client asks the server to speak first after 2 s of silence: past home3's idle timeout the
    # mapping is gone and the push is dropped as unsolicited; home1 (no timeout) lets it through
    with ThreadPoolExecutor(2) as pool:
        kept = pool.submit(tcp_probe, net.alice, [(net.boot.addr, servers[0].port)], send="push 2", wait=3.0)
        idle = pool.submit(tcp_probe, net.dave, [(net.boot.addr, servers[0].port)], send="push 2", wait=3.0)
        [kept_probe], [idle_probe] = kept.result(), idle.result()
    assert kept_probe.ok and kept_probe.note == "pushed"
    assert idle_probe.ok and idle_probe.note == "silent"
    assert sysctl(None, key) == host_before


@netns
def test_the_bed_leaves_nothing_behind_even_when_the_body_raises():
    require_netns()
    before = ours()
    with pytest.raises(RuntimeError, match="the body failed"):
        with NetBed() as bed:
            home = bed.home_router("home", symmetric=True, uplink_mbit=10, downlink_mbit=50, idle_timeout_s=5)
            server = EchoServer(bed.behind(home, "eve"))
            prefix = bed.prefix
            assert {ns for ns in ours() if ns.startswith(prefix)} == {prefix + n for n in ("internet", "home", "eve")}
            raise RuntimeError("the body failed")
    assert ours() == before
    assert server.proc.poll() is not None  # what the bed started was stopped


@netns
def test_sweep_removes_what_a_dead_process_left():
    require_netns()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = f"{netbed.PREFIX}{dead.pid}-1-stale", f"{netbed.PREFIX}{os.getpid()}-99-live"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    subprocess.run(["ip", "netns", "add", live], check=True)
    try:
        assert stale in sweep()
        assert stale not in ours() and live in ours()  # a live process's bed is left alone
    finally:
        for ns in (stale, live):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_the_reason_to_skip_is_named(monkeypatch):
    """Runs anywhere: what require_netns() would skip with, without root or without the tools."""
    monkeypatch.setattr(netbed.sys, "platform", "linux")
    monkeypatch.setattr(netbed.os, "geteuid", lambda: 1000)
    assert netbed.netns_unavailable.__wrapped__() == "network namespaces need root"
    monkeypatch.setattr(netbed.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netbed.shutil, "which", lambda tool: None if tool == "nft" else f"/usr/sbin/{tool}")
    assert netbed.netns_unavailable.__wrapped__().startswith("nft missing")
