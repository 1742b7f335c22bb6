"""Request/response over reused streams: typed handlers on the serving side, a stream pool on the asking side.

Clients keep up to MAX_IDLE_STREAMS idle streams per (peer, protocol): opening one costs ~3 ms.
A request that fails to parse strikes its sender and gets an error reply; a handler that raises
answers "internal error" and the node keeps serving.
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from beeswarm.p2p import wire
from beeswarm.p2p.channel import close_stream, quiet_reset
from beeswarm.p2p.errors import NodeError, PeerUnavailable
from beeswarm.p2p.host import Host
from beeswarm.protocol import Decoder, ErrorReply, Message, ProtocolError, RemoteError, encode
from beeswarm.protocol.rpcs import Rep, Req, Rpc

log = logging.getLogger(__name__)

REQUEST_READ_TIMEOUT_S = 30.0
IDLE_STREAM_S = 60.0  # a reused request stream idle this long is closed by the server
MAX_IDLE_STREAMS = 4  # per (peer, protocol)

# (peer id, request) -> reply; a sync handler runs in a worker thread, an async one in the node's loop
Handler = Callable[[str, Any], Message] | Callable[[str, Any], Awaitable[Message]]


class Requests:
    def __init__(self, node: Host, tensor_limit: int):
        """`tensor_limit`: the largest message an RPC that carries tensors takes (the node's --max-tensor-bytes)."""
        self.node, self.tensor_limit = node, tensor_limit
        self._idle: dict[tuple[str, str], list[tuple[Any, wire.FrameReader]]] = {}

    def forget(self, peer: str) -> None:
        """Drop pooled streams to a peer (it disconnected, or a request over one timed out)."""
        for key in [k for k in self._idle if k[0] == peer]:
            del self._idle[key]

    # serving ----------------------------------------------------------------------------------
    async def serve_stream(self, protocol: str, handler: Handler, requests: Decoder[Any],
                           limiter: trio.CapacityLimiter | None, stream: Any) -> None:
        """Serve requests on one stream until the peer closes it; a sync handler runs in a thread of `limiter`
        (None: trio's shared pool)."""
        peer = str(stream.muxed_conn.peer_id)
        try:
            if not await self.node.gate.admit(peer):
                return
            first, frames = True, wire.FrameReader(stream, requests.limit)
            while True:
                try:
                    with trio.fail_after(REQUEST_READ_TIMEOUT_S if first else IDLE_STREAM_S):
                        body = await frames.next()
                        if body is None:
                            return  # the client closed its end: done
                        msg = requests.decode(body)
                except trio.TooSlowError:
                    if first:
                        self.node.strike(peer, f"{protocol}: request too slow")
                    return
                except ProtocolError as e:
                    self.node.strike(peer, f"{protocol}: {e}")
                    await wire.write_frame(stream, encode(ErrorReply(error=f"bad request: {e}")))
                    return
                first = False
                await wire.write_frame(stream, encode(await self._handle(protocol, handler, peer, msg, limiter)))
        except Exception as e:  # noqa: BLE001 - the peer went away mid-request
            log.debug("request stream %s from %s: %s", protocol, peer, e)
        finally:
            await close_stream(stream)

    async def _handle(self, protocol: str, handler: Handler, peer: str, msg: Message,
                      limiter: trio.CapacityLimiter | None) -> Message:
        try:
            if inspect.iscoroutinefunction(handler):
                return await handler(peer, msg)
            return await trio.to_thread.run_sync(handler, peer, msg, limiter=limiter)  # type: ignore[arg-type]
        except ProtocolError as e:
            self.node.strike(peer, f"{protocol}: {e}")
            return ErrorReply(error=str(e))
        except Exception:  # noqa: BLE001 - a handler bug must not take the node down
            log.exception("handler for %s failed on a request from %s", protocol, peer)
            return ErrorReply(error="internal error")

    # asking -----------------------------------------------------------------------------------
    def encoded(self, rpc: Rpc[Req, Any], msg: Req) -> bytes:
        """`msg` as `rpc` sends it (any thread: a message carrying tensors is encoded off the node's loop)."""
        body = encode(msg)
        largest = rpc.largest_request(self.tensor_limit)
        if len(body) > largest:
            raise NodeError(f"request of {len(body)} bytes exceeds the {largest}-byte limit of {rpc.id}")
        return body

    async def request(self, peer: str, rpc: Rpc[Req, Rep], msg: Req, timeout: float) -> Rep:
        """The decoded reply to `msg`; an ErrorReply raises RemoteError, a reply of another kind than `rpc`
        answers is the peer's protocol error."""
        return await self.send(peer, rpc, self.encoded(rpc, msg), timeout)

    async def send(self, peer: str, rpc: Rpc[Any, Rep], body: bytes, timeout: float) -> Rep:
        """`request` with the message already `encoded`."""
        protocol, replies = rpc.id, rpc.reply_decoder(self.tensor_limit)
        key = (peer, protocol)
        try:
            with trio.fail_after(timeout):
                while True:
                    pooled = self._idle.get(key)
                    from_pool = bool(pooled)
                    if pooled:
                        stream, frames = pooled.pop()
                        if getattr(stream.muxed_conn, "is_closed", False):
                            continue  # its connection went (a relay killed): a write there may never fail
                    else:
                        stream = await self.node.open_stream(peer, protocol)
                        frames = wire.FrameReader(stream, replies.limit)
                    try:
                        await wire.write_frame(stream, body)
                        reply = replies.decode(await frames.expect())
                    except Exception:  # noqa: BLE001
                        await quiet_reset(stream)
                        if from_pool:
                            continue  # the reused stream had gone stale (idle close, peer restart): a fresh one
                        raise
                    idle = self._idle.setdefault(key, [])
                    if len(idle) < MAX_IDLE_STREAMS:
                        idle.append((stream, frames))
                    else:
                        await close_stream(stream)
                    if isinstance(reply, ErrorReply):
                        raise RemoteError(reply.error, reply.busy, reply.room, reply.queued)
                    return reply  # decoded as one of the replies `rpc` names
        except trio.TooSlowError:
            self.forget(peer)  # its other pooled streams may sit on the same dead link: the next request opens anew
            raise TimeoutError(f"{protocol} request to {peer} timed out after {timeout} s") from None
        except ProtocolError as e:
            self.node.strike(peer, f"{protocol} reply: {e}")
            raise PeerUnavailable(f"bad reply from {peer}: {e}") from None
        except (PeerUnavailable, NodeError, RemoteError):
            raise
        except Exception as e:  # noqa: BLE001 - resets, refused protocol, closed connection
            raise PeerUnavailable(f"{protocol} to {peer}: {type(e).__name__}: {e}") from None
