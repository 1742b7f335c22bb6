"""Four py-libp2p 0.8.1 costs that grow with the swarm, cut (`install()`, called by `Node.start`).

Profiled with py-spy on 12 nodes in one process (benchmarks/mesh_bench.py --sizes 12), the interpreter
at its one-core limit; of all samples:

1. ~20%: yamux sends a WINDOW_UPDATE frame after nearly every read that returns data
   (`YamuxStream._auto_tune_and_send_window_update`, stream_muxer/yamux/yamux.py:415-470: its
   "partial slack" and "release on read" branches): one more Noise-encrypted write per frame received,
   gossip's small RPCs included. `_window_update` keeps that function's other two branches, which are
   go-yamux's rule: release the window once half of it has been consumed (auto-tuning included).
2. ~14%: every pubsub RPC carries its sender's signed peer record, and every receiver verifies the
   Ed25519 signature of every copy (`maybe_consume_signed_record`, pubsub/utils.py:21, called from
   pubsub/pubsub.py:565 and gossipsub.py:932). A sender re-sends the very same bytes until its
   addresses change (`env_to_send_in_RPC`, peer/peerstore.py:68 caches it), so a record already
   verified for that peer is accepted without verifying it again (and re-stored every RECORD_REFRESH_S,
   so its 2-hour TTL never lapses).
3. ~10% (once 1 and 2 were cut): every pubsub message received runs as a service task, and each task
   takes a `uuid.uuid4()` for its identity (tools/anyio_service/trio_tasks.py:121): an os.urandom
   system call per message. A process-wide counter is as unique for that.
4. ~6% (a worker of benchmarks/mesh_procs.py: 12 nodes of a 48-member mesh): `env_to_send_in_RPC`
   (peer/peerstore.py:68), called for every pubsub RPC sent, lists the host's addresses (a
   `getsockname` system call and a multiaddr per listener) to check that its cached record still
   matches, then serializes the record again. The record's bytes are reused for ADDRS_REFRESH_S.
"""
from __future__ import annotations

import functools
import itertools
import time
import types
import weakref
from typing import Any

import libp2p.identity.identify.identify as identify_module
import libp2p.peer.peerstore as peerstore_module
import libp2p.pubsub.gossipsub as gossipsub_module
import libp2p.pubsub.pubsub as pubsub_module
import libp2p.pubsub.utils as pubsub_utils
import libp2p.stream_muxer.yamux.yamux as yamux_module
import libp2p.tools.anyio_service.trio_tasks as trio_tasks_module

RECORD_REFRESH_S = 600.0
ADDRS_REFRESH_S = 5.0  # a new listen address is in this node's signed record within this long
MAX_VERIFIED = 4096  # peers whose last verified record is kept per host

_consume = pubsub_utils.maybe_consume_signed_record
_task_ids = types.SimpleNamespace(uuid4=itertools.count().__next__)  # one counter however often installed
_envelope = peerstore_module.env_to_send_in_RPC
_sent: weakref.WeakKeyDictionary[Any, tuple[bytes, float]] = weakref.WeakKeyDictionary()
_verified: weakref.WeakKeyDictionary[Any, dict[Any, tuple[bytes, float]]] = weakref.WeakKeyDictionary()


async def _window_update(self: Any, *, bytes_read: int = 0) -> None:
    """`YamuxStream._auto_tune_and_send_window_update` (yamux.py:410-470) without its per-read branches."""
    total = 0
    async with self.window_lock:
        if bytes_read > 0:
            self._pending_recv_release += bytes_read
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        delta = self.target_recv_window - (self.recv_window + buffered)
        threshold = self._grow_threshold()
        if delta >= threshold and delta > 0:
            total = self._grow_to_delta(buffered) + self._apply_autotune_epoch(buffered)
            self._pending_recv_release = 0
        elif self._pending_recv_release >= threshold:
            total, self._pending_recv_release = self._pending_recv_release, 0
            self.recv_window += total
            total += self._apply_autotune_epoch(buffered)
    if total > 0:
        await self.send_window_update(total, skip_lock=True)


@functools.wraps(_consume)
def _consume_once(msg: Any, host: Any, peer_id: Any) -> bool:
    record = msg.senderRecord if msg.HasField("senderRecord") else None
    if record is None:
        return True
    now = time.monotonic()
    seen = _verified.setdefault(host, {}).get(peer_id)
    if seen is not None and seen[0] == record and now - seen[1] < RECORD_REFRESH_S:
        return True
    ok: bool = _consume(msg, host, peer_id)
    if ok:
        verified = _verified[host]
        verified[peer_id] = (record, now)
        if len(verified) > MAX_VERIFIED:  # peers come and go: keep those heard from lately, half of them at most
            recent = sorted(verified.items(), key=lambda kv: kv[1][1])[-MAX_VERIFIED // 2:]
            _verified[host] = {peer: seen for peer, seen in recent if now - seen[1] < RECORD_REFRESH_S}
    return ok


@functools.wraps(_envelope)
def _envelope_cached(host: Any) -> tuple[bytes, bool]:
    now = time.monotonic()
    sent = _sent.get(host)
    if sent is not None and now - sent[1] < ADDRS_REFRESH_S:
        return sent[0], False
    envelope, fresh = _envelope(host)
    _sent[host] = (envelope, now)
    return envelope, fresh


def install() -> None:
    """Apply the four (each replaces a function outright, so applying them again changes nothing)."""
    yamux_module.YamuxStream._auto_tune_and_send_window_update = _window_update  # type: ignore[method-assign]
    trio_tasks_module.uuid = _task_ids  # type: ignore[assignment]
    for module in (pubsub_utils, pubsub_module, gossipsub_module):  # the latter two imported it by name
        module.maybe_consume_signed_record = _consume_once  # type: ignore[attr-defined]
    for module in (peerstore_module, pubsub_module, gossipsub_module, identify_module):
        module.env_to_send_in_RPC = _envelope_cached  # type: ignore[attr-defined]
