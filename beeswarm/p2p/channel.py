"""Streams between peers: errors, a framed duplex channel, and small helpers every protocol uses."""
from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import trio

from beeswarm.p2p import wire
from beeswarm.p2p.errors import ChannelClosed, NodeError, PeerUnavailable
from beeswarm.p2p.host import Host
from beeswarm.protocol import ProtocolError

log = logging.getLogger(__name__)

CHANNEL_BUFFER_LIMIT = 1024 * 1024 * 1024


class Channel:
    """A long-lived duplex stream of frames to one peer. `send`/`recv` may be called from any thread.

    Set `on_frame` (before frames arrive, e.g. in the channel handler) to take each frame in the
    node's loop instead of buffering it for `recv`: one thread hand-off less per message. It must
    return quickly; raising `ProtocolError` counts against the peer.
    """

    def __init__(self, node: Host, stream: Any, peer: str, protocol: str, limit: int):
        self.node, self.peer, self.protocol, self.limit = node, peer, protocol, limit
        self.on_frame: Callable[[Channel, bytes], None] | None = None
        self._stream = stream
        self._frames: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._cond = threading.Condition()
        self._closed: str | None = None
        self._send_lock = trio.Lock()
        # The reader's scope: closing the channel cancels it (py-libp2p 0.8.1 never wakes a read pending on a
        # stream reset locally, and drops the stream from the connection's table: the reader waited forever)
        self._reader = trio.CancelScope()

    # trio side --------------------------------------------------------------------------------
    async def run_reader(self) -> None:
        """In the node's loop, for the channel's lifetime: drain the stream into `on_frame` or the buffer."""
        frames = wire.FrameReader(self._stream, self.limit)
        try:
            with self._reader:
                await self._read(frames)
        finally:
            self.mark_closed("the node stopped")  # a cancelled reader (the node stopping) must wake `recv` too
            with trio.CancelScope(shield=True):
                await quiet_reset(self._stream)

    async def _read(self, frames: wire.FrameReader) -> None:
        if self._closed is not None:
            return  # closed before its reader started
        try:
            while True:
                body = await frames.next()
                if body is None:
                    raise ProtocolError("stream ended")
                if self.on_frame is not None:
                    try:
                        self.on_frame(self, body)
                    except ProtocolError as e:
                        self.node.strike(self.peer, f"{self.protocol}: {e}")
                    continue
                with self._cond:
                    if self._buffered + len(body) > CHANNEL_BUFFER_LIMIT:
                        raise ProtocolError("peer outran the channel buffer")
                    self._frames.append(body)
                    self._buffered += len(body)
                    self._cond.notify_all()
        except ProtocolError as e:
            if "stream ended" not in str(e):
                self.node.strike(self.peer, f"{self.protocol}: {e}")
            self.mark_closed(str(e))
        except Exception as e:  # noqa: BLE001 - resets, EOF, connection loss
            self.mark_closed(f"{type(e).__name__}: {e}")

    async def _send(self, body: bytes) -> None:
        async with self._send_lock:
            await wire.write_frame(self._stream, body)

    def mark_closed(self, why: str) -> None:
        with self._cond:
            if self._closed is None:
                self._closed = why or "closed"
            self._cond.notify_all()

    # any thread -------------------------------------------------------------------------------
    def send(self, body: bytes, timeout: float = 60.0) -> None:
        if self._closed is not None:
            raise ChannelClosed(f"channel to {self.peer} is closed: {self._closed}")
        if len(body) > self.limit:
            raise NodeError(f"frame of {len(body)} bytes exceeds the channel's {self.limit}-byte limit")
        try:
            self.node.call(self._send_with_timeout, body, timeout)
        except (ProtocolError, PeerUnavailable, TimeoutError) as e:
            self.mark_closed(str(e))
            raise ChannelClosed(f"channel to {self.peer} broke: {e}") from None

    async def _send_with_timeout(self, body: bytes, timeout: float) -> None:
        try:
            with trio.fail_after(timeout):
                await self._send(body)
        except trio.TooSlowError:
            raise TimeoutError(f"send to {self.peer} took over {timeout} s") from None
        except Exception as e:  # noqa: BLE001 - stream errors of many kinds
            raise PeerUnavailable(f"{type(e).__name__}: {e}") from None

    def recv(self, timeout: float | None = None) -> bytes:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._frames:
                if self._closed is not None:
                    raise ChannelClosed(f"channel to {self.peer} is closed: {self._closed}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no frame from {self.peer} within {timeout} s")
                self._cond.wait(left)
            body = self._frames.popleft()
            self._buffered -= len(body)
            return body

    @property
    def closed(self) -> bool:
        return self._closed is not None and not self._frames

    def close(self) -> None:
        self.mark_closed("closed locally")
        try:
            self.node.call(self._close)
        except NodeError:
            pass

    async def _close(self) -> None:
        self._reader.cancel()
        await quiet_reset(self._stream)


class ChannelPool:
    """One open channel per (peer, protocol), opened again when it closed (any thread)."""

    def __init__(self, open_channel: Callable[[str, str], Channel]):
        self.open_channel = open_channel  # (peer, protocol) -> a new channel: `Node.open_channel`
        self._open: dict[tuple[str, str], Channel] = {}
        self._lock = threading.Lock()

    def get(self, peer: str, protocol: str) -> Channel:
        with self._lock:
            channel = self._open.get((peer, protocol))
        if channel is None or channel.closed:
            channel = self.open_channel(peer, protocol)
            with self._lock:  # channels that closed meanwhile (peers gone) are forgotten
                self._open = {key: open_ for key, open_ in self._open.items() if not open_.closed}
                self._open[(peer, protocol)] = channel
        return channel

    def send(self, peer: str, protocol: str, body: bytes) -> None:
        """Send on the pooled channel; a channel that broke is forgotten (raises NodeError)."""
        try:
            self.get(peer, protocol).send(body)
        except NodeError:
            with self._lock:
                self._open.pop((peer, protocol), None)
            raise

    def close(self) -> None:
        with self._lock:
            channels, self._open = list(self._open.values()), {}
        for channel in channels:
            channel.close()


class Outbox:
    """Frames queued per (peer, protocol), each queue sent in order by a thread of its own (gone after IDLE_S
    idle): the caller never waits on a peer. A next hop that stops reading stalls only what goes to it, not the
    compute thread that serves every session; past `depth` frames waiting for one peer, more fail at once."""

    IDLE_S = 30.0

    def __init__(self, pool: ChannelPool, depth: int = 64):
        self.pool, self.depth = pool, depth
        self._queues: dict[tuple[str, str], queue.Queue[tuple[bytes, Callable[[NodeError], None]] | None]] = {}
        self._lock = threading.Lock()

    def send(self, peer: str, protocol: str, body: bytes, failed: Callable[[NodeError], None]) -> None:
        """Queue `body` for `peer`; `failed(error)` runs (in the sending thread, or here when the queue is full)
        if it cannot be sent."""
        key = (peer, protocol)
        with self._lock:
            waiting = self._queues.get(key)
            if waiting is None:
                waiting = self._queues[key] = queue.Queue(self.depth)
                threading.Thread(target=self._drain, args=(key, waiting), name=f"outbox-{peer[-8:]}",
                                 daemon=True).start()
            try:
                waiting.put_nowait((body, failed))
                return
            except queue.Full:
                pass
        failed(NodeError(f"{peer} takes nothing: {self.depth} frames already wait for it"))

    def _drain(self, key: tuple[str, str], waiting: queue.Queue) -> None:
        while True:
            try:
                item = waiting.get(timeout=self.IDLE_S)
            except queue.Empty:
                with self._lock:
                    if waiting.empty():
                        del self._queues[key]
                        return
                continue
            if item is None:
                return
            body, failed = item
            try:
                self.pool.send(*key, body)
            except NodeError as e:
                failed(e)

    def close(self) -> None:
        with self._lock:
            queues, self._queues = list(self._queues.values()), {}
        for waiting in queues:
            with contextlib.suppress(queue.Full):
                waiting.put_nowait(None)
        self.pool.close()


async def accept(host: Host, protocol: str, on_channel: Callable[[Channel], None], limit: int, stream: Any) -> None:
    """An inbound channel on `protocol` (a stream handler): admitted, handed to `on_channel` in a worker thread,
    then read."""
    peer = str(stream.muxed_conn.peer_id)
    if not await host.gate.admit(peer):
        await quiet_reset(stream)
        return
    channel = Channel(host, stream, peer, protocol, limit)
    try:
        await trio.to_thread.run_sync(on_channel, channel)
        host.spawn(channel.run_reader)  # after the handler, so it can set on_frame first
    except Exception:  # noqa: BLE001
        log.exception("channel handler for %s failed", protocol)
        channel.mark_closed("handler failed")
        await quiet_reset(stream)


async def open_channel(host: Host, peer: str, protocol: str, timeout: float, limit: int) -> Channel:
    """A channel to `peer` on `protocol`, its reader started (in the host's loop)."""
    try:
        with trio.fail_after(timeout):
            stream = await host.open_stream(peer, protocol)
    except trio.TooSlowError:
        raise TimeoutError(f"opening {protocol} to {peer} timed out") from None
    except (PeerUnavailable, NodeError):
        raise
    except Exception as e:  # noqa: BLE001
        raise PeerUnavailable(f"{protocol} to {peer}: {type(e).__name__}: {e}") from None
    channel = Channel(host, stream, peer, protocol, limit)
    host.spawn(channel.run_reader)
    return channel


async def quiet_reset(stream: Any) -> None:
    try:
        await stream.reset()
    except Exception:  # noqa: BLE001 - already gone
        pass


async def within(timeout: float, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Await fn(*args) within `timeout`; any failure becomes PeerUnavailable naming `what`."""
    try:
        with trio.fail_after(timeout):
            return await fn(*args)
    except trio.TooSlowError:
        raise PeerUnavailable(f"{what} timed out after {timeout} s") from None
    except Exception as e:  # noqa: BLE001 - refused, reset, unreachable
        raise PeerUnavailable(f"{what}: {reason(e)}") from None


def reason(e: BaseException) -> str:
    """The root causes of `e` on one line: py-libp2p wraps a refused dial in five layers ("unable to
    connect ..., no addresses established a successful connection") around "Connection refused"."""
    leaves: list[str] = []

    def walk(x: BaseException, depth: int) -> None:
        subs = [s for s in [*getattr(x, "exceptions", ()), *(getattr(x, "errors", None) or ())]
                if isinstance(s, BaseException)]  # ExceptionGroup, py-libp2p's MultiError
        below = x.__cause__ or (None if x.__suppress_context__ else x.__context__)
        if depth < 12 and subs:
            for sub in subs:
                walk(sub, depth + 1)
        elif depth < 12 and below is not None:
            walk(below, depth + 1)
        elif isinstance(x, OSError) and x.strerror:
            leaves.append(x.strerror)
        else:
            leaves.append(str(x) or type(x).__name__)

    walk(e, 0)
    return "; ".join(dict.fromkeys(" ".join(leaf.split()) for leaf in leaves)) or type(e).__name__


async def close_stream(stream: Any) -> None:
    try:
        await stream.close()
    except Exception:  # noqa: BLE001
        await quiet_reset(stream)
