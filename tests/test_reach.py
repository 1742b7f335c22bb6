"""Addresses and plain faults: nobody announces or dials 0.0.0.0; a bootstrap that cannot be dialled is named
within seconds, with why, instead of a minute's wait for a route."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import multiaddr
import pytest

from beeswarm.p2p import addresses, identity
from beeswarm.p2p.errors import NodeError
from beeswarm.p2p.membership import Membership
from beeswarm.p2p.node import Node, NodeConfig
from beeswarm.protocol.membership import NodeInfo
from helpers import INTERVAL, LOCAL, wait_for


def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wildcards_become_this_hosts_interface_addresses():
    out = [str(a) for a in addresses.concrete([multiaddr.Multiaddr("/ip4/0.0.0.0/tcp/4001"),
                                                multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/4001"),
                                                multiaddr.Multiaddr("/ip4/10.1.2.3/tcp/5")])]
    assert "/ip4/127.0.0.1/tcp/4001" in out and out.count("/ip4/127.0.0.1/tcp/4001") == 1
    assert out[-1] == "/ip4/10.1.2.3/tcp/5" and not any(addresses.unspecified(a) for a in out)
    assert addresses.unspecified("/ip4/0.0.0.0/tcp/1/p2p/x") and addresses.unspecified("/ip6/::/tcp/1")
    assert not addresses.unspecified("/ip4/0.0.0.1/tcp/1") and not addresses.unspecified("/ip6/::1/tcp/1")
    assert addresses.interface_ips(4)[-1] == "127.0.0.1"  # loopback last: the first is what people are shown


def test_a_node_listening_on_every_interface_never_announces_0_0_0_0():
    me, other = identity.ephemeral(), identity.ephemeral()
    wide = Node(me, NodeConfig(listen=["/ip4/0.0.0.0/tcp/0"]))
    wide_members = Membership(wide, NodeInfo(peer=me.peer_id), interval=INTERVAL)
    wide_members.start()
    wide.start()
    try:
        assert wide.addrs and not any("/0.0.0.0/" in a for a in wide.addrs), wide.addrs
        loopback = next(a for a in wide.addrs if a.startswith("/ip4/127.0.0.1/"))
        peer = Node(other, NodeConfig(listen=LOCAL, bootstrap=[loopback]))
        members = Membership(peer, NodeInfo(peer=other.peer_id), interval=INTERVAL)
        members.start()
        peer.start()
        try:
            heard = wait_for(lambda: members.view().get(me.peer_id), 10, "the wide node's heartbeat")
            assert heard.addrs and not any(addresses.unspecified(a) for a in heard.addrs), heard.addrs
            with pytest.raises(NodeError, match="not an address to dial"):
                peer.connect(f"/ip4/0.0.0.0/tcp/1/p2p/{me.peer_id}")
            assert peer.bootstrap_errors() == {} and peer.unreachable() is None
        finally:
            peer.stop()
    finally:
        wide.stop()


def test_a_bootstrap_that_refuses_is_named_with_its_error():
    addr = f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{identity.ephemeral().peer_id}"
    node = Node(identity.ephemeral(), NodeConfig(listen=LOCAL, bootstrap=[addr])).start()
    try:
        why = wait_for(node.unreachable, 10, "the bootstrap's dial to fail")
        assert why.startswith(f"{addr}: ") and "refused" in why.lower(), why
        assert "refused" in node.bootstrap_errors()[addr].lower()
        time.sleep(2.5)  # dialled again (py-libp2p's 60 s negative cache does not hide the real error)
        assert "refused" in node.bootstrap_errors()[addr].lower(), node.bootstrap_errors()
    finally:
        node.stop()


@pytest.fixture
def env(tmp_path):
    e = {**os.environ, "BEESWARM_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    e.pop("BEESWARM_IDENTITY", None)
    return e


@pytest.mark.slow
@pytest.mark.parametrize("command", [["chat", "--prompt", "def f(x):", "--max-new-tokens", "4"], ["status"]])
def test_joining_a_bootstrap_that_refuses_fails_within_seconds_naming_it(command, env, tiny_llama):
    addr = f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{identity.ephemeral().peer_id}"
    extra = ["--model", str(tiny_llama), "--no-spec"] if command[0] == "chat" else []
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "beeswarm", *command[:1], "--join", addr, *command[1:], *extra],
                         capture_output=True, text=True, timeout=60, env=env)
    took = time.monotonic() - t0
    assert out.returncode == 2, out.stderr
    error = [line for line in out.stderr.splitlines() if line.startswith("beeswarm: error:")]
    assert len(error) == 1 and addr in error[0] and "refused" in error[0].lower(), out.stderr
    assert "Traceback" not in out.stderr
    # it used to wait out a 60 s route timeout; a process start (torch, the model) takes 5-16 s on 2 busy cores
    assert took < 30, f"{took:.1f} s to say the bootstrap is unreachable"
