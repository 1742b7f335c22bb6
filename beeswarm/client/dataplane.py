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
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from beeswarm import codec
from beeswarm.audit import commitments
from beeswarm.audit.auditor import Auditor
from beeswarm.credits.entry_receipts import ReceiptBook
from beeswarm.p2p.channel import Channel, ChannelPool
from beeswarm.p2p.errors import NodeError
from beeswarm.p2p.node import Node
from beeswarm.protocol import Decoder, ProtocolError, RemoteError, encode, ids
from beeswarm.protocol.audit import Evidence
from beeswarm.protocol.coordinator import Stage
from beeswarm.protocol.rpcs import SESSION
from beeswarm.protocol.session import Close, Closed, Open, Opened
from beeswarm.protocol.step import CacheState, Keep, Result, Step, StepError
from beeswarm.shard import tensors
from beeswarm.shard.entry_model import EntryModel

log = logging.getLogger(__name__)

Route = tuple[Stage, ...]  # stages covering every layer in order
# a step's result waited for this long at most; a stage that dies or stops beating fails its steps sooner
STEP_TIMEOUT_S = 30.0
CLOSE_AFTER_FAILURE_S = 5.0  # a session's other stages are told it closed, after a failure, this briefly


class Inbox:
    """Results for every pipeline of one entry node (stages keep one result channel per entry)."""

    def __init__(self, node: Node):
        self.node = node
        # key -> (sender, reply, when it came: perf_counter seconds)
        self.results: dict[tuple[str, int], tuple[str, Result | StepError, float]] = {}
        self.waiting: set[tuple[str, int]] = set()
        self.cond = threading.Condition()
        self._replies: Decoder[Result | StepError] = Decoder(Result, StepError, limit=node.config.max_tensor_bytes)

    def start(self) -> Inbox:
        self.node.serve_channel(ids.RESULT, self._on_channel)
        return self

    def _on_channel(self, channel: Channel) -> None:
        channel.on_frame = self._on_frame

    def _on_frame(self, channel: Channel, body: bytes) -> None:
        msg = self._replies.decode(body)
        key = (msg.session, msg.step)
        with self.cond:
            if key not in self.waiting:
                return  # late (after a timeout or failover) or never asked for: drop
            self.results[key] = (channel.peer, msg, time.perf_counter())
            self.cond.notify_all()

    def wait(self, key: tuple[str, int], timeout: float,
             give_up: Callable[[], bool] = lambda: False) -> tuple[str, Result | StepError, float] | None:
        """(sender, reply, arrival time) for `key`, or None after `timeout` or as soon as `give_up()` holds."""
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


@dataclass
class SessionSteps:
    """One session of a push pipeline as a speculation target (`spec.speculate.Target`)."""

    pipe: RemotePipeline
    session: str

    def submit(self, ids: torch.Tensor, start: int, mask: torch.Tensor | None,
               keep: tuple[int, list[int]] | None, cancel: bool = False) -> int:
        return self.pipe.submit(self.session, ids, start, mask, keep, cancel)

    def collect(self, step: int) -> tuple[torch.Tensor, float]:
        return self.pipe.collect(self.session, step)

    def discard(self, step: int) -> None:
        self.pipe.discard(self.session, step)


class StageFailed(Exception):
    """A stage timed out, went away or returned an error; `peer` names it."""

    def __init__(self, peer: str, message: str):
        super().__init__(f"stage {peer}: {message}")
        self.peer = peer


class StepTimedOut(StageFailed):
    """No result within the step timeout and no stage known gone: in a push chain the silent one could be any of
    the route's stages, so `peer` (the first) is a guess, not a culprit."""


class OutOfStep(StageFailed):
    """A stage's cache for the session is not in the state the entry assumed for a step (`Step.expect`): something
    on the way was lost or reordered. Nothing ran on the wrong cache; the session starts over, nobody is blamed."""


class StageBusy(StageFailed):
    """A healthy stage cannot take a session now: its KV memory or session slots are taken, or it does not
    serve the span the entry's plan names (yet, or any more). `room`: the longest session it could take now
    (tokens; 0: none, or not a matter of memory); `queued`: the stage keeps the entry's place in its queue for
    memory while it asks again."""

    def __init__(self, peer: str, message: str, room: int = 0, queued: bool = False):
        super().__init__(peer, message)
        self.room, self.queued = room, queued


@dataclass(frozen=True)
class SentStep:
    """A step sent and not yet back: the digests of its context and input, its first position and how many."""
    context: bytes
    input: bytes
    start: int
    positions: int


@dataclass(frozen=True)
class PipelineOptions:
    mode: str = "push"  # "push": stage to stage; "hops": every hop back through the entry (Petals' routing)
    link_bytes_per_s: float | None = None  # the entry's uplink for its codec (None: measured)
    step_timeout_s: float = STEP_TIMEOUT_S
    compress: bool = True  # False: raw frames on every hop (for comparisons)

    def __post_init__(self) -> None:
        if self.mode not in ("push", "hops"):
            raise ValueError(f"mode must be push or hops, got {self.mode!r}")


class RemotePipeline:
    def __init__(self, node: Node, inbox: Inbox, entry: EntryModel, route: Route,
                 options: PipelineOptions = PipelineOptions(), auditor: Auditor | None = None,
                 receipts: ReceiptBook | None = None):
        """`auditor`: gets every step's checked commitments (None: they are checked, then dropped); `receipts`:
        counts the work they show.
        Call `close()` when done with it: it stops watching the route's connections."""
        spans = [s.span for s in route]
        if not route or spans[0].start != 0 or any(a.end != b.start for a, b in itertools.pairwise(spans)) or \
                spans[-1].end != entry.config.num_hidden_layers:
            raise ValueError(f"route {[str(s) for s in spans]} does not cover layers "
                             f"[0, {entry.config.num_hidden_layers}) in order")
        self.node, self.entry, self.route, self.options = node, entry, route, options
        self.links = {stage.node: codec.LinkCodec(options.link_bytes_per_s) for stage in route}
        self.inbox = inbox
        self._lost: dict[str, str] = {}  # route peer -> why it is gone: fail fast, not after the step timeout
        self._unwatch = node.watch_peers(self.found, self._on_disconnected)
        self._channels = ChannelPool(node.open_channel)
        self._step_ids = itertools.count()
        self.auditor, self.receipts = auditor, receipts
        self._sent: dict[tuple[str, int], SentStep] = {}
        self._caches: dict[str, CacheState] = {}  # session -> its stages' cache once every step sent has run

    def close(self) -> None:
        self._unwatch()
        self._channels.close()

    # bytes on the wire as the entry saw them (its own sends and what came back)
    @property
    def wire_bytes(self) -> int:
        return sum(link.wire_bytes + link.wire_in for link in self.links.values())

    @property
    def raw_bytes(self) -> int:
        return sum(link.raw_bytes + link.raw_in for link in self.links.values())

    def open_within(self, max_length: int, min_length: int,
                    wait: Callable[[StageBusy], None] | None = None) -> tuple[str, int]:
        """(a session on every stage of the route, its length): `max_length` if every stage has room for it, else
        the most room a full stage has left, down to `min_length` (speculation's trees shrink to fit; it is not
        refused for room it would only use at full width; the stages opened before keep their longer sessions).

        The stages are opened in route order. One after the first that keeps this entry's place in its queue
        (StageBusy.queued) is asked again after `wait(busy)`, while the sessions opened before it are held: let
        go, the entry would go to the back of those stages' queues, and on a crowded swarm no entry would ever be
        at the front of every queue at once. Holding cannot deadlock: every route takes its stages in layer
        order. `wait` raises the StageBusy when the entry should stop waiting. Any other refusal (StageBusy or
        StageFailed) closes the sessions already opened and is raised."""
        session = os.urandom(8).hex()
        push = self.options.mode == "push"
        payer, payer_sig = self.receipts.vouch(session) if self.receipts else (None, b"")
        length = max_length
        i = 0
        try:
            for i, stage in enumerate(self.route):
                prev = self.route[i - 1].node if push and i > 0 else self.node.peer_id
                nxt = self.route[i + 1].node if push and i < len(self.route) - 1 else None
                while True:
                    try:
                        self._request(stage, Open(session=session, max_length=length, prev=prev, next=nxt,
                                                  span=stage.span, compress=self.options.compress, payer=payer,
                                                  payer_sig=payer_sig))
                        break
                    except StageBusy as e:
                        if min_length <= e.room < length:
                            log.info("stage %s has room for a session of %d tokens, not %d: taking that", e.peer,
                                     e.room, length)
                            length = e.room
                        elif i > 0 and wait is not None and e.queued:
                            wait(e)  # holding route[:i]
                        else:
                            raise
        except StageFailed:
            self.close_session(session, self.route[:i])
            raise
        self._caches[session] = CacheState(0, 0)
        return session, length

    def open(self, max_length: int) -> str:
        """A session of `max_length` on every stage of the route; if one stage refuses, those already opened are
        closed and the refusal is raised."""
        return self.open_within(max_length, max_length)[0]

    def close_session(self, session: str, stages: Route | None = None, failed: str | None = None) -> None:
        """Close `session` on `stages` (all of the route's by default). After a failure (`failed`: the stage
        that failed) the others are told in the background, briefly, and the failed one not at all: a dead
        stage would hold the caller up for the whole request timeout."""
        for key in [k for k in list(self._sent) if k[0] == session]:  # steps never awaited (a failure)
            self._sent.pop(key, None)
        self._caches.pop(session, None)
        targets = [s for s in (self.route if stages is None else stages) if s.node != failed]

        def close(timeout: float) -> None:
            for stage in targets:
                try:
                    self._request(stage, Close(session=session), timeout)
                except StageFailed as e:
                    log.debug("close: %s", e)

        if failed is None:
            close(self.options.step_timeout_s)
        else:
            threading.Thread(target=close, args=(CLOSE_AFTER_FAILURE_S,), name="close", daemon=True).start()
        if self.auditor is not None and stages is None:
            self.auditor.ended(session)  # its audits are drawn now, once per stage

    def _request(self, stage: Stage, msg: Open | Close, timeout: float | None = None) -> Opened | Closed:
        try:
            return self.node.request(stage.node, SESSION, msg, timeout=timeout or self.options.step_timeout_s)
        except RemoteError as e:
            if e.busy:
                raise StageBusy(stage.node, str(e), e.room, e.queued) from None
            raise StageFailed(stage.node, str(e)) from None
        except (NodeError, TimeoutError) as e:
            raise StageFailed(stage.node, str(e)) from None

    def forward(self, session: str, token_ids: torch.Tensor, start: int, tree_mask: torch.Tensor | None = None,
                micro_batches: int = 1, keep: tuple[int, list[int]] | None = None) -> torch.Tensor:
        """Logits for `token_ids` placed at `start` (the stages roll their KV back to it first).

        `keep` (start, indices): the previous speculative round's accepted path, compacted by every
        stage before this step (it rides with the step: no extra round trip). With `micro_batches` > 1
        (push chain, no tree) a long prompt is cut into that many chunks sent back to back, so stage k
        works on chunk i while stage k+1 works on chunk i-1.
        """
        kept = None if keep is None else Keep(keep[0], tuple(keep[1]))
        push = self.options.mode == "push"
        if push and micro_batches > 1 and tree_mask is None and len(token_ids) >= 2 * micro_batches:
            steps, position = [], start
            for chunk in torch.tensor_split(token_ids, micro_batches):
                chunk_keep = kept if position == start else None
                steps.append(self._send_step(self.route[0], session, self.entry.embed(chunk), position, None,
                                             chunk_keep, self._advance(session, position, len(chunk), chunk_keep)))
                position += len(chunk)
            return self.entry.logits(torch.cat([self._await(session, step, self.route[0])[0] for step in steps]))
        hidden = self.entry.embed(token_ids)
        stages = self.route[:1] if push else self.route
        expect = self._advance(session, start, len(token_ids), kept)  # each stage's cache, in either mode
        for stage in stages:
            step = self._send_step(stage, session, hidden, start, tree_mask, kept, expect)
            hidden = self._await(session, step, stage)[0]
        return self.entry.logits(hidden)

    def submit(self, session: str, token_ids: torch.Tensor, start: int, tree_mask: torch.Tensor | None = None,
               keep: tuple[int, list[int]] | None = None, cancel: bool = False) -> int:
        """Send a step into the push chain without waiting for it; `collect` it later. The stages run a
        session's steps in the order sent, so several may be in flight (pipelined speculation); `cancel`: the
        earlier ones not computed yet are dropped (`discard` them)."""
        if self.options.mode != "push":
            raise ValueError("steps in flight need the push chain")
        kept = None if keep is None else Keep(keep[0], tuple(keep[1]))
        return self._send_step(self.route[0], session, self.entry.embed(token_ids), start, tree_mask, kept,
                               self._advance(session, start, len(token_ids), kept), cancel)

    def collect(self, session: str, step: int) -> tuple[torch.Tensor, float]:
        """A submitted step's logits, and when its result arrived (perf_counter seconds)."""
        hidden, arrived = self._await(session, step, self.route[0])
        return self.entry.logits(hidden), arrived

    def discard(self, session: str, step: int) -> None:
        """A submitted step's result is not wanted: it is dropped when it comes."""
        self._sent.pop((session, step), None)
        self.inbox.wait((session, step), 0)
        if self.auditor is not None:
            self.auditor.unobserved(session, step)

    def _advance(self, session: str, start: int, positions: int, keep: Keep | None) -> CacheState:
        """The state the stages' cache for `session` is in when a step arrives (its `expect`); the session's
        moves on to the state after the step. A step cancelled later moves it the same: the stages hold it."""
        try:
            before = self._caches[session]
        except KeyError:
            raise ValueError(f"session {session!r} is not open on this pipeline, or a step of it failed") from None
        self._caches[session] = before.after(start, positions, keep)
        return before

    def _send_step(self, stage: Stage, session: str, hidden: torch.Tensor, start: int,
                   tree_mask: torch.Tensor | None, keep: Keep | None, expect: CacheState, cancel: bool = False) -> int:
        step = next(self._step_ids)
        frame = tensors.encode(hidden, self.links[stage.node], "auto" if self.options.compress else "raw")
        msg = Step(entry=self.node.peer_id, session=session, step=step, start=start, frame=frame, expect=expect,
                   mask=tensors.encode_mask(tree_mask), keep=keep, cancel=cancel)
        self._sent[(session, step)] = SentStep(commitments.context(start, msg.mask, keep), commitments.digest(hidden),
                                            start, hidden.shape[-2])
        self.inbox.expect((session, step))
        try:
            self._channels.send(stage.node, ids.STEP, encode(msg))
        except NodeError as e:
            self.inbox.wait((session, step), 0)
            self._sent.pop((session, step), None)
            raise StageFailed(stage.node, str(e)) from None
        return step

    def _await(self, session: str, step: int, stage: Stage) -> tuple[torch.Tensor, float]:
        """The step's hidden states from the route's last stage (checked), and when they arrived."""
        sent = self._sent.pop((session, step))
        got = self.inbox.wait((session, step), self.options.step_timeout_s, lambda: bool(self._lost))
        if got is None:
            lost = dict(self._lost)
            if lost:
                peer, why = next(iter(lost.items()))
                raise StageFailed(peer, why)
            raise StepTimedOut(stage.node, f"no result for step {step} within {self.options.step_timeout_s} s")
        sender, reply, arrived = got
        last = self.route[-1] if self.options.mode == "push" else stage
        if isinstance(reply, StepError):
            nodes = {s.node for s in self.route}
            culprit = reply.culprit if reply.culprit in nodes else sender if sender in nodes else stage.node
            self._caches.pop(session, None)  # in a state nobody can name now: the session takes no more steps
            raise (OutOfStep if reply.stale else StageFailed)(culprit, reply.error)
        if sender != last.node:
            raise StageFailed(last.node, f"result came from {sender}, not the route's stage")
        try:
            hidden = tensors.decode(reply.frame, self.links[last.node], self.node.config.max_tensor_bytes)
        except (codec.CodecError, ProtocolError) as e:
            raise StageFailed(last.node, f"bad result frame: {e}") from None
        stages = self.route if self.options.mode == "push" else (stage,)
        self.check_commits(session, step, stages, sent, reply, hidden)
        if self.auditor is not None:
            self.auditor.observe(session, reply.commits)
        if self.receipts is not None:
            self.receipts.count(session, reply.commits, sent.start, sent.positions)
        return hidden, arrived

    def check_commits(self, session: str, step: int, stages: Route, sent: SentStep, reply: Result,
                       hidden: torch.Tensor) -> None:
        """Every stage's commitment must be there, signed, and chained: each one's input what the one before
        it sent, the first one's what this entry sent, the last one's output what came back. An honest stage
        checks its predecessor's before computing, so the first stage whose commitment breaks the chain is
        the one to blame; where both links are signed by stages, that is evidence for everyone."""
        context, previous = sent.context, sent.input
        commits = reply.commits
        if len(commits) != len(stages):
            raise StageFailed(stages[-1].node, f"{len(commits)} commitments for a route of {len(stages)} stages")
        for i, (stage, c) in enumerate(zip(stages, commits, strict=True)):
            if c.stage != stage.node or c.step != step or c.span != stage.span or \
                    not commitments.verify(c, self.node.peer_id, session):
                # stage i+1 carried a commitment it should have refused; the last stage sent it itself
                blamed = stages[min(i + 1, len(stages) - 1)].node
                raise StageFailed(blamed, f"the commitment of stage {i} for step {step} is missing or forged")
            if c.context != context or c.input != previous:
                if i > 0 and self.auditor is not None:
                    self.auditor.accuse(Evidence(kind="chain", accused=c.stage, accuser=self.node.peer_id,
                                                 session=session, span=c.span, commits=(commits[i - 1], c),
                                                 detail=f"step {step}"))
                raise StageFailed(c.stage, f"step {step}: it signed for an input it was not sent")
            previous = c.output
        if previous != commitments.digest(hidden):
            raise StageFailed(stages[-1].node, f"step {step}: the result is not what it committed to")

    def lose(self, peer: str, why: str) -> None:
        """`peer` is gone (its connection dropped, or it stopped beating): steps waiting on the route fail now."""
        if any(s.node == peer for s in self.route):
            self._lost[peer] = why
            self.inbox.wake()

    def found(self, peer: str) -> None:
        """`peer` is back (reconnected, or beating again): this pipeline may route through it again."""
        self._lost.pop(peer, None)

    def _on_disconnected(self, peer: str) -> None:
        self.lose(peer, "connection lost")
