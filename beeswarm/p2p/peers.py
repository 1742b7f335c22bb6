"""The host's connection table and peerstore: who is connected, what is kept of peers gone, and the counts.

py-libp2p 0.8.1 keeps more than it should here (see ARCHITECTURE.md, "What a node keeps per peer"): its
shutdown leaves connections open and nothing ever cleans its peerstore. These functions run in the
node's loop, over the node's py-libp2p host.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.abc import INotifee
from libp2p.connection_types import ConnectionType

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeStats:
    """What a node holds that grows with the peers it has met: each must stay flat under churn."""
    connected_peers: int  # peers with an open connection
    connections: int  # connections in py-libp2p's table (open or closing)
    known_peers: int  # peers in the peerstore (keys, addresses, protocols)
    inbound_slots: int  # inbound connections py-libp2p counts against its cap (max_connections - min_connections)
    tasks: int  # trio tasks in the node's loop
    disconnects_remembered: int  # peers py-libp2p's auto-connector remembers dropping (one per vanished peer)


class ConnectionWatcher(INotifee):
    """Tells the node when a peer's connection opens or closes (py-libp2p's notifee interface)."""

    def __init__(self, connected: Callable[[str], None], disconnected: Callable[[str], None]):
        self._connected, self._disconnected = connected, disconnected

    async def opened_stream(self, network: Any, stream: Any) -> None:
        pass

    async def closed_stream(self, network: Any, stream: Any) -> None:
        pass

    async def connected(self, network: Any, conn: Any) -> None:
        peer = conn.muxed_conn.peer_id
        if not _relayed(conn) and any(_relayed(c) for c in network.connections.get(peer, []) if c is not conn):
            log.info("direct connection to %s, which was reached through a relay: a hole punched through the NATs",
                     peer)
        self._connected(str(peer))

    async def disconnected(self, network: Any, conn: Any) -> None:
        self._disconnected(str(conn.muxed_conn.peer_id))

    async def listen(self, network: Any, multiaddr: Any) -> None:
        pass

    async def listen_close(self, network: Any, multiaddr: Any) -> None:
        pass


def live_peers(host: Any) -> set[Any]:
    """Peers with an open connection. (py-libp2p 0.8.1 keeps a peer's key in its connection table, with an
    empty list, after the last connection closed: `get_connected_peers` still lists it.)"""
    return {peer for peer, conns in host.get_network().connections.items()
            if any(not getattr(c, "is_closed", False) for c in conns)}


def _relayed(conn: Any) -> bool:
    try:
        return getattr(conn, "muxed_conn", conn).get_connection_type() is ConnectionType.RELAYED
    except Exception:  # noqa: BLE001
        return False


def direct_endpoint(host: Any, peer: Any) -> tuple[str, int] | None:
    """Where `peer`'s open direct connection comes from, (ip, port) as this host sees it; None when there is
    none, or only through a relay."""
    for conn in host.get_network().connections.get(peer, []):
        if getattr(conn, "is_closed", False) or _relayed(conn):
            continue
        try:
            endpoint = getattr(conn, "muxed_conn", conn).get_remote_address()
        except Exception:  # noqa: BLE001 - a connection type without these: not one we can tell about
            continue
        if endpoint:
            return str(endpoint[0]), int(endpoint[1])
    return None


def direct_peers(host: Any) -> list[str]:
    """Peers this host has a direct (not relayed) connection to."""
    return [str(peer) for peer in live_peers(host) if direct_endpoint(host, peer)] if host is not None else []


async def close_all(host: Any, timeout: float) -> None:
    """Close every connection, all at once (py-libp2p's own shutdown left them open: their peers saw the node
    connected until its process exited, and a process that stops nodes kept their sockets)."""
    with trio.move_on_after(timeout):
        async with trio.open_nursery() as closing:
            for conn in host.get_network().get_connections():
                closing.start_soon(_close_quietly, conn)


async def forget_gone(host: Any, keep: Callable[[], Iterable[str]], every_s: float) -> None:
    """Every `every_s`, drop from the peerstore each peer neither connected nor in `keep()` (the node itself,
    its bootstraps, the members). py-libp2p 0.8.1 never starts its own clean-up and identify keeps a peer's
    addresses for 2 h: every peer ever met stayed, its key, protocols and signed record too."""
    store = host.get_peerstore()
    while True:
        await trio.sleep(every_s)
        kept, live = set(keep()), live_peers(host)
        for peer in store.peer_ids():
            if peer not in live and str(peer) not in kept:
                try:
                    store.clear_peerdata(peer)
                except Exception:  # noqa: BLE001 - gone meanwhile
                    pass


async def stats(host: Any) -> NodeStats:
    network = host.get_network()
    limiter = getattr(network, "_inbound_limiter", None)
    remembered = getattr(getattr(network, "auto_connector", None), "_recent_disconnects", ())
    return NodeStats(connected_peers=len(live_peers(host)), connections=len(network.get_connections()),
                     known_peers=len(host.get_peerstore().peer_ids()),
                     inbound_slots=int(limiter.borrowed_tokens) if limiter is not None else 0,
                     tasks=_count_tasks(trio.lowlevel.current_root_task()),
                     disconnects_remembered=len(remembered))


async def _close_quietly(conn: Any) -> None:
    try:
        await conn.close()
    except Exception as e:  # noqa: BLE001 - already closing
        log.debug("closing a connection: %s", e)


def _count_tasks(task: Any) -> int:
    return 1 + sum(_count_tasks(child) for nursery in task.child_nurseries for child in nursery.child_tasks)
