"""The entry side of the data plane: sessions over a route of stages, steps through the push chain.

The entry keeps the embedding, head and sampler. A step goes entry -> s1 -> ... -> sN -> entry,
each stage pushing straight to the next (`mode="push"`), or back to the entry after every stage
(`mode="hops"`, the way Petals routes; kept for comparison). Every hop uses the adaptive codec.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import weakref
from dataclasses import dataclass

import torch

from beeswarm import codec
from beeswarm.contributor.stage import RESULT_PROTOCOL, SESSION_PROTOCOL, STEP_PROTOCOL, pack_mask
from beeswarm.p2p import wire
from beeswarm.p2p.node import Channel, Node, NodeError
from beeswarm.shard import tensors
from beeswarm.shard.entry import EntryModel

log = logging.getLogger(__name__)


class _Inbox:
    """Results for every pipeline of one node (stages keep one result channel per entry)."""

    # Weak keys: an id() could be reused by a later node, which must get its own inbox.
    _by_node: weakref.WeakKeyDictionary[Node, _Inbox] = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    @classmethod
    def of(cls, node: Node) -> _Inbox:
        with cls._lock:
            if node not in cls._by_node:
                cls._by_node[node] = cls(node)
            return cls._by_node[node]

    def __init__(self, node: Node):
        self.node = node
        self.results: dict[tuple[str, int], dict] = {}
        self.waiting: set[tuple[str, int]] = set()
        self.cond = threading.Condition()
        node.serve_channel(RESULT_PROTOCOL, self._on_channel)

    def _on_channel(self, channel: Channel) -> None:
        channel.on_frame = self._on_frame

    def _on_frame(self, channel: Channel, body: bytes) -> None:
        msg = wire.expect(wire.unpack(body, self.node.config.max_tensor_bytes), ("result", "step_error"),
                          session=str, step=int)
        if msg["t"] == "result":
            wire.expect(msg, "result", frame=bytes)
        key = (msg["session"], msg["step"])
        with self.cond:
            if key not in self.waiting:
                return  # late (after a timeout or failover) or never asked for: drop
            self.results[key] = {**msg, "from": channel.peer}
            self.cond.notify_all()

    def wait(self, key: tuple[str, int], timeout: float, give_up=lambda: False) -> dict | None:
        """The result for `key`, or None after `timeout` or as soon as `give_up()` holds."""
        with self.cond:
            try:
                self.cond.wait_for(lambda: key in self.results or give_up(), timeout=timeout)
                return self.results.pop(key, None)
            finally:
                self.waiting.discard(key)

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def expect(self, key: tuple[str, int]) -> None:
        with self.cond:
            self.waiting.add(key)


class StageFailed(Exception):
    """A stage timed out, went away or returned an error; `peer` names it."""

    def __init__(self, peer: str, message: str):
        super().__init__(f"stage {peer}: {message}")
        self.peer = peer


@dataclass(frozen=True)
class Hop:
    peer: str
    start: int
    end: int


class RemotePipeline:
    def __init__(self, node: Node, entry: EntryModel, route: list[Hop], mode: str = "push",
                 link_bytes_per_s: float | None = None, step_timeout_s: float = 30.0, compress: bool = True):
        """`compress=False`: raw frames on every hop of this pipeline's sessions (for comparisons)."""
        if mode not in ("push", "hops"):
            raise ValueError(f"mode must be push or hops, got {mode!r}")
        if not route or route[0].start != 0 or any(a.end != b.start for a, b in zip(route, route[1:])) or \
                route[-1].end != entry.config.num_hidden_layers:
            raise ValueError(f"route {route} does not cover layers [0, {entry.config.num_hidden_layers}) in order")
        self.node, self.entry, self.route, self.mode, self.compress = node, entry, route, mode, compress
        self.step_timeout_s = step_timeout_s
        self.links = {hop.peer: codec.LinkCodec(link_bytes_per_s) for hop in route}
        self._inbox = _Inbox.of(node)
        self._lost: set[str] = set()  # route peers whose connection dropped: fail fast, not after a timeout
        node.on_peer_disconnected.append(self._on_disconnected)
        self._channels: dict[str, Channel] = {}
        self._step_ids = itertools.count()
        self._lock = threading.Lock()

    # bytes on the wire as the entry saw them (its own sends and what came back)
    @property
    def wire_bytes(self) -> int:
        return sum(link.wire_bytes + link.wire_in for link in self.links.values())

    @property
    def raw_bytes(self) -> int:
        return sum(link.raw_bytes + link.raw_in for link in self.links.values())

    def open(self, max_length: int) -> str:
        session = os.urandom(8).hex()
        for i, hop in enumerate(self.route):
            last = i == len(self.route) - 1
            push = self.mode == "push"
            prev = self.route[i - 1].peer if push and i > 0 else self.node.peer_id
            nxt = self.route[i + 1].peer if push and not last else None
            self._request(hop, wire.message("open", session=session, max_length=max_length, prev=prev, next=nxt,
                                            layers=[hop.start, hop.end], compress=self.compress))
        return session

    def close(self, session: str) -> None:
        for hop in self.route:
            try:
                self._request(hop, wire.message("close", session=session))
            except StageFailed as e:
                log.debug("close: %s", e)

    def _request(self, hop: Hop, msg: dict) -> dict:
        try:
            return self.node.request(hop.peer, SESSION_PROTOCOL, msg, timeout=self.step_timeout_s)
        except (NodeError, TimeoutError, wire.RemoteError) as e:
            raise StageFailed(hop.peer, str(e)) from None

    def forward(self, session: str, token_ids: torch.Tensor, start: int, tree_mask: torch.Tensor | None = None,
                micro_batches: int = 1, keep: tuple[int, list[int]] | None = None) -> torch.Tensor:
        """Logits for `token_ids` placed at `start` (the stages roll their KV back to it first).

        `keep` (start, indices): the previous speculative round's accepted path, compacted by every
        stage before this step (it rides with the step: no extra round trip). With `micro_batches` > 1
        (push chain, no tree) a long prompt is cut into that many chunks sent back to back, so stage k
        works on chunk i while stage k+1 works on chunk i-1.
        """
        if self.mode == "push" and micro_batches > 1 and tree_mask is None and len(token_ids) >= 2 * micro_batches:
            steps, position = [], start
            for chunk in torch.tensor_split(token_ids, micro_batches):
                steps.append(self._send_step(self.route[0], session, self.entry.embed(chunk), position, None,
                                             keep if position == start else None))
                position += len(chunk)
            return self.entry.logits(torch.cat([self._await(session, step, self.route[0]) for step in steps]))
        hidden = self.entry.embed(token_ids)
        hops = self.route if self.mode == "hops" else self.route[:1]
        for hop in hops:
            step = self._send_step(hop, session, hidden, start, tree_mask, keep)
            hidden = self._await(session, step, hop)
        return self.entry.logits(hidden)

    def _send_step(self, hop: Hop, session: str, hidden: torch.Tensor, start: int,
                   tree_mask: torch.Tensor | None, keep: tuple[int, list[int]] | None) -> int:
        step = next(self._step_ids)
        msg = wire.message("step", entry=self.node.peer_id, session=session, step=step, start=start,
                           frame=tensors.encode(hidden, self.links[hop.peer], "auto" if self.compress else "raw"),
                           mask=pack_mask(tree_mask),
                           keep=None if keep is None else [keep[0], list(keep[1])])
        self._inbox.expect((session, step))
        try:
            self._channel(hop.peer).send(wire.pack(msg))
        except NodeError as e:
            self._inbox.wait((session, step), 0)
            raise StageFailed(hop.peer, str(e)) from None
        return step

    def _await(self, session: str, step: int, hop: Hop) -> torch.Tensor:
        reply = self._inbox.wait((session, step), self.step_timeout_s, lambda: bool(self._lost))
        if reply is None:
            if self._lost:
                raise StageFailed(next(iter(self._lost)), "connection lost")
            raise StageFailed(hop.peer, f"no result for step {step} within {self.step_timeout_s} s")
        last = self.route[-1] if self.mode == "push" else hop
        if reply["t"] == "result" and reply["from"] != last.peer:
            raise StageFailed(last.peer, f"result came from {reply['from']}, not the route's stage")
        if reply["t"] == "step_error":
            named = reply.get("culprit")
            stages = {h.peer for h in self.route}
            culprit = named if named in stages else reply["from"] if reply["from"] in stages else hop.peer
            raise StageFailed(culprit, str(reply.get("error")))
        return tensors.decode(reply["frame"], self.links[last.peer], self.node.config.max_tensor_bytes)

    def _on_disconnected(self, peer: str) -> None:
        if any(h.peer == peer for h in self.route):
            self._lost.add(peer)
            self._inbox.wake()

    def _channel(self, peer: str) -> Channel:
        with self._lock:
            channel = self._channels.get(peer)
            if channel is None or channel.closed:
                channel = self._channels[peer] = self.node.open_channel(peer, STEP_PROTOCOL)
            return channel
