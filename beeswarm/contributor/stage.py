"""A contributor's stage server: sessions on its span, batched steps, and the push chain.

Protocols:
- `/beeswarm/session/1` (request/response): open (allocates KV, records the previous and next hop),
  close.
- `/beeswarm/step/1` (channels): a step carries (session, step id, start, optional tree mask, hidden
  frame, optional keep: the previous speculative round's accepted path, compacted first). The stage
  runs its layers and pushes the result straight to the next stage; the last stage (or every stage
  in client-hops mode) sends it to the entry on `/beeswarm/result/1`.
The messages are `beeswarm.protocol.session` and `beeswarm.protocol.step`.
A stage may hold two spans while it migrates (make-before-break); a session names the span it
expects at open, so a step can never run on layers the entry did not route it to.
Steps of concurrent sessions are batched into one call of the span runtime. Sessions belong to the
entry that opened them, and steps are only taken from the hop named at open, so a peer can never
touch another entry's session. Bad steps get an error sent to the session's entry; the stage keeps
serving everyone else.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import torch

from beeswarm import codec
from beeswarm.audit import commitments
from beeswarm.audit.faults import Fault
from beeswarm.audit.retention import LoggedStep, StepLog
from beeswarm.contributor.chain import CommitmentChain, PreviousLied
from beeswarm.contributor.links import LinkCodecs
from beeswarm.contributor.sessions import Session, Sessions
from beeswarm.contributor.step_queue import QueuedStep, StepQueue
from beeswarm.p2p.channel import Channel, ChannelPool, Outbox
from beeswarm.p2p.errors import NodeError
from beeswarm.p2p.node import Node
from beeswarm.p2p.signatures import verify_bytes
from beeswarm.protocol import Decoder, ErrorReply, Message, ProtocolError, Span, encode, ids
from beeswarm.protocol.rpcs import AUDIT, SESSION
from beeswarm.protocol.session import Close, Closed, Open, Opened, open_body
from beeswarm.protocol.step import CacheState, Commit, Result, Step, StepError
from beeswarm.shard import tensors
from beeswarm.shard.errors import SessionError, ShardError
from beeswarm.shard.span import SpanRuntime, StepInput

log = logging.getLogger(__name__)

REVEAL_THREADS = 2  # reveals encoded at once (a long session's reveal is megabytes: off the shared pool)


class _StaleCache(ProtocolError):
    """The step names a cache state the session's is not in here."""


@dataclass(frozen=True)
class Traffic:
    """What a stage computed and moved since it started."""

    steps: int
    tokens: int  # positions computed (a speculative round's tree counts each node)
    raw_in: int  # hidden-state bytes received, decoded
    wire_in: int  # ... as they crossed the wire
    raw_out: int
    wire_out: int


class StageServer:
    def __init__(self, node: Node, runtime: SpanRuntime, sessions: Sessions | None = None,
                 links: LinkCodecs | None = None, step_log: StepLog | None = None, fault: Fault | None = None,
                 coordinator: Callable[[], str | None] = lambda: None):
        """`sessions`: who may open one, within what budget (`sessions.Sessions`); `links`: the link codecs
        (`links.LinkCodecs`, with the measured rates of the links when given); `step_log`: what is kept for
        audits' reveals; `fault`: misbehave on purpose (tests only, see `audit.faults`); `coordinator()`: the
        peer that may ask for reveals of other entries' sessions (judging a refusal)."""
        self.node = node
        self.sessions = sessions if sessions is not None else Sessions()  # (an empty one is falsy)
        self.link = links or LinkCodecs()  # the codec of each link (`link(peer)`), and the bytes they moved
        self.tokens = 0  # positions computed, written by the compute thread only
        self.queue = StepQueue()  # steps arrived and not run, and what a pass takes
        self._out = Outbox(ChannelPool(node.open_channel))  # the compute thread never waits on a peer
        self._steps = Decoder(Step, limit=node.config.max_tensor_bytes)
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._thawed = threading.Event()  # cleared: paused
        self._thawed.set()
        self.runtimes: dict[Span, SpanRuntime] = {}
        self.fault = fault
        clock = self.sessions.clock
        self.chain = CommitmentChain(node.identity.key_pair, node.peer_id, step_log or StepLog(clock=clock),
                                     self._served, coordinator, clock)
        self.step_log = self.chain.step_log
        self._draining: set[Span] = set()  # spans the plan dropped, kept until their sessions end
        self.add(runtime)

    def start(self) -> StageServer:
        self.node.serve(SESSION, self._on_session)
        self.node.serve(AUDIT, self.chain.on_reveal, threads=REVEAL_THREADS)
        self.node.serve_channel(ids.STEP, self._on_step_channel)
        self._worker = threading.Thread(target=self._compute_loop, name="stage-compute", daemon=True)
        self._worker.start()
        return self

    def stop(self) -> None:
        self.queue.stop()
        self._thawed.set()
        if self._worker is not None:
            self._worker.join(10)
        self._out.close()

    def pause(self) -> None:
        """Compute nothing until `resume()`; steps queue up and the node stays connected and answers (what a stage
        frozen by SIGSTOP or a swapping host looks like to its peers, who know it only by its silence)."""
        self._thawed.clear()

    def resume(self) -> None:
        self._thawed.set()

    def add(self, runtime: SpanRuntime) -> None:
        """Serve another span (the new one of a migration) beside the current ones."""
        if self.fault is not None and (at := self.fault.corrupt(list(runtime.layers))) is not None:
            log.warning("TEST FAULT ON: layer %d of %s computes with wrong weights", runtime.span.start + at,
                        runtime.span)
        with self._lock:
            self.runtimes[runtime.span] = runtime
            self._draining.discard(runtime.span)

    def keep_only(self, spans: set[Span]) -> None:
        """Serve only `spans` to new sessions. A span dropped here drains: the sessions in flight on it go on
        to their end (or idle out), then it is freed; ending them now would make their entries re-route,
        prefill again and blame a healthy stage."""
        with self._lock:
            self._draining = {span for span in self.runtimes if span not in spans}
            self._free_unused()

    def _free_unused(self) -> None:
        """(Under the lock.) Free what no session uses any more: the draining spans, and the codecs of links
        to peers gone from every session (their byte counts are kept in the totals)."""
        sessions = self.sessions.all()
        used = {s.runtime.span for s in sessions}
        for span in [s for s in self._draining if s not in used]:
            del self.runtimes[span]
            self._draining.discard(span)
            log.info("layers %s freed: the plan moved on and their last session ended", span)
        self.link.keep({peer for s in sessions for peer in (s.entry, s.prev, s.next) if peer})

    def _served(self, span: Span) -> SpanRuntime:
        """The runtime serving `span` (a replay for an audit runs on it), ShardError when none does any more."""
        with self._lock:
            runtime = self.runtimes.get(span)
        if runtime is None:
            raise ShardError(f"this stage no longer holds layers {span}")
        return runtime

    @property
    def reveals(self) -> int:
        return self.chain.reveals

    @property
    def spans(self) -> tuple[Span, ...]:
        """Every span served to new sessions, in order (two while a migration is under way)."""
        with self._lock:
            return tuple(sorted(span for span in self.runtimes if span not in self._draining))

    @property
    def traffic(self) -> Traffic:
        """Steps and tokens computed; bytes as the links' codecs counted them."""
        moved = self.link.totals()
        return Traffic(self.queue.batching.steps, self.tokens, moved.raw_in, moved.wire_in, moved.raw_out,
                       moved.wire_out)

    @property
    def compute_s(self) -> float:
        """Seconds its layers computed."""
        return self.queue.batching.compute_s

    @property
    def queued(self) -> int:
        """Steps arrived and not run yet."""
        return len(self.queue)

    @property
    def busy(self) -> bool:
        return self.queued > 0

    # sessions ---------------------------------------------------------------------------------
    def _on_session(self, peer: str, msg: Open | Close) -> Message:
        self._expire_idle()
        if isinstance(msg, Close):
            session = self.sessions.close(f"{peer}/{msg.session}")
            if session is None:
                return ErrorReply(error=f"unknown session {msg.session!r}")
            self._end(session)
            log.info("session %s of %s closed: served %d layer-tokens paid by %s", msg.session, peer, session.served,
                     session.payer)
            return Closed()
        with self._lock:
            runtime = self.runtimes.get(msg.span) if msg.span not in self._draining else None
            served = sorted(set(self.runtimes) - self._draining)
        if runtime is None:
            # the entry's plan is ahead of or behind this stage's: not a fault, try again on the next plan
            return ErrorReply(error=f"this stage serves {', '.join(map(str, served))}, not layers {msg.span}",
                              busy=True)
        opened = self.sessions.open(peer, msg, self._payer(peer, msg), runtime)
        return opened if isinstance(opened, ErrorReply) else Opened(span=msg.span)

    def _payer(self, peer: str, msg: Open) -> str:
        """Whose credit `peer`'s session spends: the payer that signed for it, else the entry itself."""
        if msg.payer is None or msg.payer == peer:
            return peer
        if not verify_bytes(msg.payer, open_body(peer, msg.session), msg.payer_sig):
            raise ProtocolError("the session's payer did not sign for it")
        return msg.payer

    def _expire_idle(self) -> None:
        for session in self.sessions.expire_idle():
            log.info("session %s idle for %.0f s: closed", session.key, self.sessions.idle_timeout_s)
            self._end(session)

    def _end(self, session: Session) -> None:
        """Free what a session that was just closed or expired held."""
        with self._lock:
            self._free_unused()
        self.queue.forget(session.key)
        session.runtime.close(session.key)
        self.step_log.end(session.key)

    # steps ------------------------------------------------------------------------------------
    def _on_step_channel(self, channel: Channel) -> None:
        channel.on_frame = self._on_step_frame

    def _on_step_frame(self, channel: Channel, body: bytes) -> None:
        """In the node's loop: check the step's form and queue it for the compute thread. A step that cancels
        its session's earlier ones (from the session's own previous hop) drops those still queued."""
        item = QueuedStep(channel.peer, self._steps.decode(body))
        session = self.sessions.get(item.key) if item.msg.cancel else None
        self.queue.put(item, cancels=session is not None and session.prev == item.sender)

    def _compute_loop(self) -> None:
        codec.warm_up()  # calibrate the codec before the first step rather than during it
        while (taken := self.queue.next_pass(idle_s=min(60.0, self.sessions.idle_timeout_s / 4))) is not None:
            if not taken.compute and not taken.hold:
                self._expire_idle()
            self._thawed.wait()
            for item in taken.hold:
                self._hold(item)
            self._run_batch(taken.compute)

    def _run_batch(self, batch: list[QueuedStep]) -> None:
        ready: dict[SpanRuntime, list[tuple[QueuedStep, Session, StepInput]]] = {}
        for item in batch:
            try:
                prepared = self._prepare(item)
                ready.setdefault(prepared[1].runtime, []).append(prepared)
            except PreviousLied as e:
                self._fail(item, str(e), culprit=item.sender)
            except _StaleCache as e:
                self._fail(item, str(e), stale=True)
            except (ProtocolError, SessionError, codec.CodecError) as e:
                self._fail(item, str(e))
        passes = [[steps[i] for i in group] for steps in ready.values()
                  for group in self.queue.batching.passes_for([x.hidden.shape[0] for _, _, x in steps])]
        for steps in passes:
            runtime = steps[0][1].runtime
            outputs: Sequence[torch.Tensor | None]
            t0 = time.perf_counter()
            try:
                outputs = runtime.step([x for _, _, x in steps])
            except SessionError:
                outputs = [self._step_alone(runtime, item, step) for item, _, step in steps]  # find the bad one
            padded = len(steps) * max(x.hidden.shape[0] for _, _, x in steps)  # a pass pads each to its longest
            self.queue.batching.ran(len(steps), padded, t0, time.perf_counter())
            for (item, session, step), out in zip(steps, outputs):
                if out is not None:
                    if self.fault is not None:
                        out = self.fault.apply(step.hidden, out)
                    out = out.detach().to("cpu")
                    self._forward(item, session, out, self._commit(item, session, step, out))
                    self.tokens += step.hidden.shape[0]

    def _step_alone(self, runtime: SpanRuntime, item: QueuedStep, step: StepInput) -> torch.Tensor | None:
        try:
            return runtime.step([step])[0]
        except SessionError as e:
            self._fail(item, str(e))
            return None

    def _prepare(self, item: QueuedStep) -> tuple[QueuedStep, Session, StepInput]:
        msg = item.msg
        session = self._session_of(item)
        hidden = tensors.decode(msg.frame, self.link(item.sender), self.node.config.max_tensor_bytes)
        if hidden.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ProtocolError(f"hidden states must be floating point, got {hidden.dtype}")
        mask = tensors.decode_mask(msg.mask, hidden.shape[0], msg.start) if hidden.dim() == 2 else None
        item.context, item.input = commitments.context(msg.start, msg.mask, msg.keep), commitments.digest(hidden)
        self.chain.check_previous(session.entry, session.session, session.prev, msg, item.context, item.input)
        self._apply_keep(item, session)
        session.last_used = self.sessions.clock()
        return item, session, StepInput(session.key, hidden, msg.start, mask)

    def _session_of(self, item: QueuedStep) -> Session:
        session = self.sessions.get(item.key)
        if session is None or session.prev != item.sender:
            raise SessionError(f"unknown session {item.msg.session!r} (or not from its previous hop)")
        return session

    def _apply_keep(self, item: QueuedStep, session: Session) -> None:
        """The step's keep (the last speculative round's accepted path), once the session's cache is in the state
        the entry assumed for it: anything else would run the step on a cache the entry never meant."""
        msg = item.msg
        have = CacheState(session.runtime.length(session.key), session.keeps)
        if have != msg.expect:
            raise _StaleCache(f"step {msg.step} expects a cache of {msg.expect.length} positions after "
                              f"{msg.expect.keeps} keeps; this stage's holds {have.length} after {have.keeps}")
        if msg.keep is not None:
            session.runtime.keep(session.key, msg.keep.start, list(msg.keep.indices))
            session.keeps += 1

    def _hold(self, item: QueuedStep) -> None:
        """A step cancelled before it ran (or passed on held by an earlier stage): compute nothing, but apply its
        keep and hold its positions, as every stage of the route does in the same turn, and pass it on."""
        msg = item.msg
        try:
            session = self._session_of(item)
            positions = msg.held or tensors.decode(msg.frame, self.link(item.sender),
                                                   self.node.config.max_tensor_bytes).shape[0]
            self._apply_keep(item, session)
            session.runtime.hold(session.key, msg.start, positions)
        except _StaleCache as e:
            self._fail(item, str(e), stale=True)
            return
        except (ProtocolError, SessionError, codec.CodecError) as e:
            self._fail(item, str(e))
            return
        self.step_log.record(session.key, LoggedStep.held_step(msg.step, msg.start, msg.mask, msg.keep, positions))
        if session.next is not None:
            self._out.send(session.next, ids.STEP, encode(msgspec.structs.replace(msg, frame=b"", commits=(),
                                                                                 held=positions)),
                           lambda e: self._fail(item, f"cannot reach the next stage: {e}", culprit=session.next))

    def _commit(self, item: QueuedStep, session: Session, step: StepInput, out: torch.Tensor) -> Commit:
        session.served += len(session.runtime.span) * step.hidden.shape[-2]
        return self.chain.commit(session.entry, session.session, session.key, session.runtime.span, item.msg,
                                 item.context, item.input, step.hidden.detach().to("cpu"), out)

    def _forward(self, item: QueuedStep, session: Session, out: torch.Tensor, commit: Commit) -> None:
        layout = "auto" if session.compress else "raw"
        target = session.entry if session.next is None else session.next
        frame = tensors.encode(out, self.link(target), layout)
        reply: Message
        commits = (*item.msg.commits, commit)
        if session.next is None:
            protocol, reply = ids.RESULT, Result(session=session.session, step=item.msg.step, frame=frame,
                                                 commits=commits)
        else:
            protocol, reply = ids.STEP, msgspec.structs.replace(item.msg, frame=frame, commits=commits)
        def failed(e: NodeError) -> None:
            if target != session.entry:  # tell the entry at once, naming the hop that failed
                self._fail(item, f"cannot reach the next stage: {e}", culprit=target)
            else:
                log.warning("cannot return a result to %s: %s", target, e)

        self._out.send(target, protocol, encode(reply), failed)

    def _fail(self, item: QueuedStep, error: str, culprit: str | None = None, stale: bool = False) -> None:
        log.info("step %s of %s failed: %s", item.msg.step, item.key, error)
        reply = StepError(session=item.msg.session, step=item.msg.step, error=error[:500],
                          culprit=culprit or self.node.peer_id, stale=stale)
        self._out.send(item.msg.entry, ids.RESULT, encode(reply),
                       lambda e: log.info("cannot report the error to %s: %s", item.msg.entry, e))
