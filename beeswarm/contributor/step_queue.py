"""A stage's incoming steps: what arrived, in order, and what its next pass takes.

The node's loop puts steps in (`put`); the compute thread takes each pass's (`next_pass`): the first pending step of
each session, up to the batch size, once it has waited for more as `Batching` decides. A session's later steps wait
in arrival order for the passes after (put back at the queue's end, a step arriving meanwhile could overtake
them). A step that a later one of its session cancelled before it ran, or one that comes held, is not computed:
it is handed back in its turn, for the stage to apply its cache edits and pass it on.
"""
from __future__ import annotations

import collections
import queue
import time
from dataclasses import dataclass, field

from beeswarm.contributor.batching import Batching
from beeswarm.protocol.step import Step


@dataclass
class QueuedStep:
    sender: str
    msg: Step
    context: bytes = b""  # digests of its arguments and input hidden states, for its commitment
    input: bytes = b""

    @property
    def key(self) -> str:
        return f"{self.msg.entry}/{self.msg.session}"


@dataclass(frozen=True)
class Pass:
    compute: list[QueuedStep]  # one step of each of these sessions
    hold: list[QueuedStep] = field(default_factory=list)  # in their turn, before the pass: cache edits only


class StepQueue:
    def __init__(self, batching: Batching | None = None):
        self.batching = batching or Batching()  # what a pass takes, and its figures (steps, passes, compute_s)
        self._queue: queue.Queue[QueuedStep | None] = queue.Queue()
        self._pending: collections.deque[QueuedStep] = collections.deque()  # off the queue, not run: arrival order
        self._cancelled: dict[str, int] = {}  # session key -> its steps before this one are not computed

    def __len__(self) -> int:
        return self._queue.qsize() + len(self._pending)

    def put(self, item: QueuedStep, cancels: bool = False) -> None:
        """Queue a step (any thread); `cancels`: it cancels its session's earlier steps not run yet."""
        if cancels:
            self._cancelled[item.key] = item.msg.step
        self._queue.put(item)

    def forget(self, session: str) -> None:
        """The session ended."""
        self._cancelled.pop(session, None)

    def stop(self) -> None:
        """`next_pass` returns None from now on."""
        self._queue.put(None)

    def next_pass(self, idle_s: float) -> Pass | None:
        """The next pass: waits up to `idle_s` for a first step (an empty pass when none came), then for more as
        `batching` says; None once stopped."""
        if not self._pending:
            try:
                first = self._queue.get(timeout=idle_s)
            except queue.Empty:
                return Pass([])
            if first is None:
                return None
            self._take(first)
        if not self._take_arrived() or not self._wait_for_more():
            return None
        return self._take_pass()

    def _take(self, item: QueuedStep) -> None:
        self._pending.append(item)
        self.batching.arrived(item.key, time.perf_counter())

    def _take_arrived(self, timeout: float = 0.0) -> bool:
        """Take what has arrived (waiting up to `timeout` for the first); False once stopped."""
        while True:
            try:
                item = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                return False
            self._take(item)
            timeout = 0.0

    def _wait_for_more(self) -> bool:
        """Wait for the steps `batching` says are due (a compute-bound stage holding fewer sessions than it could
        batch); False once stopped."""
        in_hand = {item.key for item in self._pending}
        wait = self.batching.wait_for(in_hand, time.perf_counter())
        if wait is None:
            return True
        had = len(in_hand)
        while (left := wait.until - time.perf_counter()) > 0 and not wait.sessions <= in_hand:
            if not self._take_arrived(left):
                return False
            in_hand = {item.key for item in self._pending}
        self.batching.waited(len(in_hand) - had)
        return True

    def _take_pass(self) -> Pass:
        """The first pending step of each session (up to `batching.max_batch` sessions), taken out of pending,
        with the held and cancelled steps first in their sessions' lines before them."""
        taken = Pass([])
        waiting: set[str] = set()  # sessions with a step in the pass or still pending before this one
        left: collections.deque[QueuedStep] = collections.deque()
        for item in self._pending:
            if item.key in waiting:
                left.append(item)
            elif item.msg.held or item.msg.step < self._cancelled.get(item.key, -1):
                taken.hold.append(item)  # (its session's next step may run in this pass, after it)
            elif len(taken.compute) < self.batching.max_batch:
                taken.compute.append(item)
                waiting.add(item.key)
            else:
                left.append(item)
                waiting.add(item.key)
        self._pending = left
        return taken
