"""Guards around the py-libp2p paths where one peer's bytes could stop or wedge the whole host.

Written against py-libp2p 0.8.1 (`PY_LIBP2P`); `install()` (`Node.start` calls it) applies each
guard once. Why each is needed, with the 0.8.1 source it wraps (paths under site-packages/libp2p/):

Every inbound stream runs in `SwarmConn._handle_new_streams`' nursery
(network/connection/swarm_connection.py:226,271,309); an exception out of a stream's handler ends
that nursery, so the connection's `swarm_conn.start` task fails in the Swarm's service manager
(network/swarm.py:2640), and `TrioManager._run_and_manage_task` (tools/anyio_service/trio_manager.py:
359-385) cancels the whole Swarm service for any error that is not a connection shutdown: `host.run`
raises and the node stops. Paths that raise on peer input, found by reading the handlers and
reproduced by tests/test_fuzz.py:

1. pubsub RPC parse: `Pubsub.continuously_read_stream` parses each RPC with `ParseFromString`
   (pubsub/pubsub.py:562) and runs `handle_subscription` and `GossipSub.handle_rpc` inline;
   `Pubsub.stream_handler` (pubsub/pubsub.py:759-776) catches only StreamError, ParseError and
   IncompleteReadError, so junk on /meshsub/1.0.0 raises `google.protobuf.message.DecodeError`
   through the Swarm: the node stops.
2. multistream-select: `MultiselectCommunicator.read` returns `data.decode()` outside its try
   (protocol_muxer/multiselect_communicator.py:58); non-UTF-8 bytes in a protocol name raise
   UnicodeDecodeError, which `Multiselect.negotiate` (protocol_muxer/multiselect.py:77-117) and
   `BasicHost._swarm_stream_handler` (host/basic_host.py:1530, catches MultiselectError only)
   let through: any connected peer stops the node with one stream, before any protocol is chosen.
Guard A wraps `BasicHost._swarm_stream_handler` (host/basic_host.py:1480-1554), the one place every
inbound stream's negotiation and handler run (ours, pubsub, identify and push, ping, relay hop and
stop): an exception resets that stream, is logged once, and strikes the peer.

3. pubsub signatures: each received message is validated in its own task in the Pubsub service
   (`manager.run_task(self.push_msg, ...)`, pubsub/pubsub.py:586); `signature_validator` re-raises a
   `msg.key` that does not deserialize (pubsub/validators.py:59-63) when the author id is not an
   identity multihash, and a failed task cancels the Pubsub service (trio_manager.py:359-385), which
   ends `background_trio_service(pubsub)` in the node: one published message stops the node.
Guard B wraps `Pubsub.push_msg` (pubsub/pubsub.py:1704) for messages from peers: a failure drops
that message and strikes the peer that forwarded it (our own publish still raises to the caller).

Backstops for what reading did not find: guard C makes a failed non-daemon task of any py-libp2p
service (Swarm, Pubsub, GossipSub, relay: `TrioManager.run_task`, trio_manager.py:405) end alone,
logged once, instead of cancelling its service; guard D keeps the outbound identify, a trio *system*
task (host/basic_host.py:1203-1216), from crashing the whole trio run if it ever raises.

4. inbound slots: every inbound connection takes a slot of `Swarm._inbound_limiter`, a trio
   CapacityLimiter of max_connections - min_connections = 250 slots by default (network/swarm.py:348,
   1981-1999), held while `_do_handle_inbound_connection` runs; after a successful upgrade that
   handler waits for the *swarm* to stop (`await self.manager.wait_finished()`, network/swarm.py:2063),
   not for its connection to close (trio's serve_listeners closes the socket when a handler returns,
   so it must wait for something). A slot is thus never given back: after 250 peers have ever
   connected, whether they left politely or vanished, every newcomer's socket is closed before the
   handshake ("failed to negotiate the secure protocol", "Connection reset by peer") until the process
   restarts. Anyone can shut a public bootstrap so, and ordinary churn does it in weeks.
Guard E ends that wait when the handler's own connection closes (its muxer's `event_closed`): the slot
is given back with the connection, and the parked task with it.

5. relay circuits: the hop side keeps its circuits in `CircuitV2Protocol._active_relays`, keyed by the
   peer id of one end (relay/circuit_v2/protocol.py:672,722), and each circuit's relay task, ending,
   closes whatever is stored under that peer id (protocol.py:926-932): with two circuits to one private
   node (the stage before it and the entry), the end of either closed the other.
Guard F keys `_active_relays` by (peer id, circuit): a context variable set per CONNECT request
(`_handle_connect`, protocol.py:625), which the circuit's relay tasks inherit.

6. stream writes: `YamuxStream.write` (stream_muxer/yamux/yamux.py:229-293) cuts a message into frames of
   at most 64 KiB, and fewer bytes when the peer's receive window is short, taking the stream's write lock
   per frame only: two tasks writing to one stream at once (pubsub writes a peer's stream from publish,
   forwarding and gossip tasks alike, pubsub.py:1858) had their frames interleaved, and the peer read
   garbage: "invalid-signed-record" (a mangled envelope) in an honest swarm, a reset stream, a strike.
Guard G holds a lock of the stream's own over each whole write.

Upstream: no py-libp2p issue for 1-3 turned up in a search of its tracker; the same failure class (one
failed task cancels the whole Pubsub service) is libp2p/py-libp2p#1120 (push_msg raising StreamReset).
Check each guard against the source again when upgrading py-libp2p (`install()` warns on another version).

Read and found contained (no guard of their own; A covers them anyway): identify (identify.py:191,
catches Exception), identify/push (identify_push.py:71, catches Exception), ping (host/ping.py:173,
resets on Exception), relay hop and stop (relay/circuit_v2/protocol.py:306,397, catch Exception),
gossipsub control (gossipsub.py:922, inline in 1.), yamux frames (stream_muxer/yamux/yamux.py:1640,
closes the connection), outbound identify parse (basic_host.py:1361, catches Exception).
"""
from __future__ import annotations

import functools
import importlib.metadata
import logging
import threading
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import trio
from libp2p.host.basic_host import BasicHost
from libp2p.network.swarm import Swarm
from libp2p.pubsub.pubsub import Pubsub
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.stream_muxer.yamux.yamux import YamuxStream
from libp2p.tools.anyio_service.trio_manager import TrioManager
from libp2p.tools.anyio_service.utils import get_task_name
from libp2p.utils.connection_shutdown import is_expected_connection_shutdown

log = logging.getLogger(__name__)

PY_LIBP2P = "0.8.1"  # the version these guards were written and tested against

Striker = Callable[[str, str], None]  # (peer id, reason)
_strikers: weakref.WeakKeyDictionary[Any, Striker] = weakref.WeakKeyDictionary()
_installed = False
_lock = threading.Lock()
_seen: set[tuple[str, str]] = set()  # (where, exception type) already logged at INFO


def watch(host: Any, strike: Striker) -> None:
    """Send the faults found on `host`'s streams and pubsub messages to `strike(peer id, reason)`."""
    _strikers[host] = strike


def _strike(host: Any, peer: str | None, reason: str) -> None:
    strike = _strikers.get(host)
    if strike is None or not peer:
        return
    try:
        strike(peer, reason)
    except Exception:  # noqa: BLE001 - a striker's own bug must not undo the guard
        log.exception("striking %s failed", peer)


def _report(where: str, error: BaseException, peer: str | None, first: int = logging.INFO) -> None:
    """One line at level `first` the first time `where` fails with this exception type, DEBUG after that."""
    key = (where, type(error).__name__)
    with _lock:
        level = logging.DEBUG if key in _seen else first
        _seen.add(key)
    log.log(level, "%s%s failed and was contained: %s: %s", where, f" from {peer}" if peer else "",
            type(error).__name__, str(error)[:200])


def _peer_of(stream: Any) -> str | None:
    try:
        return str(stream.muxed_conn.peer_id)
    except Exception:  # noqa: BLE001
        return None


async def _quiet_reset(stream: Any) -> None:
    try:
        await stream.reset()
    except Exception:  # noqa: BLE001 - already gone
        pass


# Guard A: every inbound stream (multistream-select and the chosen protocol's handler) ---------------
_swarm_stream_handler = BasicHost._swarm_stream_handler


async def _guarded_swarm_stream_handler(self: Any, net_stream: Any) -> None:
    try:
        await _swarm_stream_handler(self, net_stream)
    except Exception as e:  # noqa: BLE001 - never trio.Cancelled (a BaseException): that propagates
        peer = _peer_of(net_stream)
        await _quiet_reset(net_stream)
        if is_expected_connection_shutdown(e):  # the peer hung up: py-libp2p absorbs these itself
            log.debug("stream from %s ended: %s: %s", peer, type(e).__name__, e)
            return
        try:
            protocol = str(net_stream.get_protocol() or "multistream-select")
        except Exception:  # noqa: BLE001
            protocol = "multistream-select"
        _report(f"stream {protocol}", e, peer)
        _strike(self, peer, f"{protocol}: {type(e).__name__}")


# Guard B: a pubsub message received from a peer ---------------------------------------------------
_push_msg = Pubsub.push_msg


async def _guarded_push_msg(self: Any, msg_forwarder: Any, msg: Any) -> None:
    try:
        await _push_msg(self, msg_forwarder, msg)
    except Exception as e:  # noqa: BLE001
        if msg_forwarder == self.my_id:
            raise  # our own publish: the caller hears of it
        peer = str(msg_forwarder)
        _report("pubsub message", e, peer)
        _strike(self.host, peer, f"pubsub message: {type(e).__name__}")


# Guard C: any py-libp2p service's one-shot tasks ---------------------------------------------------
_run_task = TrioManager.run_task


async def _contained_task(manager: Any, name: str, async_fn: Callable[..., Any], *args: Any) -> None:
    try:
        await async_fn(*args)
    except Exception as e:  # noqa: BLE001
        if is_expected_connection_shutdown(e):
            raise  # the manager logs these at DEBUG and carries on
        _report(f"py-libp2p {type(manager._service).__name__} task {name}", e, None, first=logging.WARNING)


def _guarded_run_task(self: Any, async_fn: Callable[..., Any], *args: Any, daemon: bool = False,
                      name: str | None = None, _internal: bool = False) -> None:
    if not daemon:  # a daemon task that ends is an error by design: left as it is
        name = get_task_name(async_fn, name)
        args = (self, name, async_fn, *args)
        async_fn = _contained_task
    _run_task(self, async_fn, *args, daemon=daemon, name=name, _internal=_internal)


# Guard D: the outbound identify, a trio system task ----------------------------------------------
_identify_task_entry = BasicHost._identify_task_entry


async def _guarded_identify_task_entry(self: Any, peer_id: Any, reason: str) -> None:
    try:
        await _identify_task_entry(self, peer_id, reason)
    except Exception as e:  # noqa: BLE001 - a system task's exception would crash trio.run itself
        _report("identify", e, str(peer_id))


# Guard E: an inbound connection's handler ends with its connection, not with the swarm ---------------
_do_handle_inbound_connection = Swarm._do_handle_inbound_connection
_upgrade_inbound_raw_conn = Swarm.upgrade_inbound_raw_conn
# The cancel scope of the inbound handler running in this task (set by E's first half, read by its second)
_inbound_handler: ContextVar[trio.CancelScope | None] = ContextVar("inbound_handler", default=None)


async def _inbound_until_closed(self: Any, read_write_closer: Any, maddr: Any, failure_event: Any) -> None:
    with trio.CancelScope() as scope:
        token = _inbound_handler.set(scope)
        try:
            await _do_handle_inbound_connection(self, read_write_closer, maddr, failure_event)
        finally:
            _inbound_handler.reset(token)


async def _upgrade_then_end_with_connection(self: Any, raw_conn: Any, maddr: Any) -> Any:
    muxed = await _upgrade_inbound_raw_conn(self, raw_conn, maddr)
    scope, closed = _inbound_handler.get(), getattr(muxed, "event_closed", None)
    if scope is not None and closed is not None and self.background_nursery is not None:
        # the handler's next await is its wait for the swarm to stop: cut it short when this connection closes
        self.background_nursery.start_soon(_cancel_when_set, closed, scope)
    return muxed


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


# Guard F: a relay's circuits to one peer are told apart -------------------------------------------------
_handle_connect = CircuitV2Protocol._handle_connect
_circuit: ContextVar[object | None] = ContextVar("relay_circuit", default=None)


class _PerCircuit(dict):
    """`_active_relays` with every key qualified by the circuit (the CONNECT request) being handled."""

    def __setitem__(self, peer: Any, streams: Any) -> None:
        super().__setitem__((peer, _circuit.get()), streams)

    def __getitem__(self, peer: Any) -> Any:
        return super().__getitem__((peer, _circuit.get()))

    def __delitem__(self, peer: Any) -> None:
        super().__delitem__((peer, _circuit.get()))

    def __contains__(self, peer: object) -> bool:
        return super().__contains__((peer, _circuit.get()))


async def _handle_connect_per_circuit(self: Any, stream: Any, msg: Any) -> None:
    if not isinstance(self._active_relays, _PerCircuit):
        self._active_relays = _PerCircuit()
    _circuit.set(object())  # this stream's task (and the relay tasks it starts) only
    await _handle_connect(self, stream, msg)


_yamux_write = YamuxStream.write
_whole_writes: weakref.WeakKeyDictionary[Any, trio.Lock] = weakref.WeakKeyDictionary()


async def _write_whole(self: Any, data: bytes) -> None:
    lock = _whole_writes.get(self)
    if lock is None:
        lock = _whole_writes[self] = trio.Lock()
    async with lock:
        await _yamux_write(self, data)


def install() -> None:
    """Apply the guards (once; later calls do nothing)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    version = importlib.metadata.version("libp2p")
    if version != PY_LIBP2P:
        log.warning("py-libp2p %s is installed; beeswarm's guards (p2p/libp2p_hardening.py) were checked against %s",
                    version, PY_LIBP2P)
    guards: list[tuple[type, str, Callable[..., Any]]] = [
        (BasicHost, "_swarm_stream_handler", _guarded_swarm_stream_handler),  # A
        (Pubsub, "push_msg", _guarded_push_msg),  # B
        (TrioManager, "run_task", _guarded_run_task),  # C
        (BasicHost, "_identify_task_entry", _guarded_identify_task_entry),  # D
        (Swarm, "_do_handle_inbound_connection", _inbound_until_closed),  # E
        (Swarm, "upgrade_inbound_raw_conn", _upgrade_then_end_with_connection),  # E
        (CircuitV2Protocol, "_handle_connect", _handle_connect_per_circuit),  # F
        (YamuxStream, "write", _write_whole),  # G
    ]
    for owner, name, guard in guards:
        setattr(owner, name, functools.wraps(getattr(owner, name))(guard))
