"""What a stage keeps so it can answer reveals: every step of a session while it is open, and for
`retain_s` after it ends within `max_bytes` (the oldest ended sessions go first). An open session's steps
are never dropped: a reveal refused for want of them would get an honest stage excluded, and what they
take is bounded by the sessions admitted (their hidden states are no bigger than the KV cache the
stage's memory budget already admits them for, beyond the first few layers)."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from beeswarm.protocol.spans import Span
from beeswarm.protocol.step import Keep

RETAIN_S = 600.0
MAX_BYTES = 1 << 30


@dataclass(frozen=True)
class LoggedStep:
    step: int
    start: int
    mask: bytes | None
    keep: Keep | None
    input: torch.Tensor  # on the host
    output: torch.Tensor
    digests: tuple[bytes, bytes, bytes] | None = None  # (context, input, output) as committed: a reveal signs them
    held: int = 0  # > 0: cancelled, not computed: its keep applied and this many positions held (no input, output)

    @classmethod
    def held_step(cls, step: int, start: int, mask: bytes | None, keep: Keep | None, positions: int) -> LoggedStep:
        """A step the stage did not compute (`Step.held`): what a replay must apply all the same."""
        nothing = torch.empty(0)
        return cls(step, start, mask, keep, nothing, nothing, held=positions)

    @property
    def nbytes(self) -> int:
        return self.input.nbytes + self.output.nbytes + len(self.mask or b"")


@dataclass
class _Log:
    steps: list[LoggedStep] = field(default_factory=list)
    nbytes: int = 0
    ended: float | None = None  # when the session ended (None: still open)
    span: Span | None = None  # the layers its steps ran through


class StepLog:
    def __init__(self, retain_s: float = RETAIN_S, max_bytes: int = MAX_BYTES,
                 clock: Callable[[], float] = time.monotonic):
        self.retain_s, self.max_bytes, self.clock = retain_s, max_bytes, clock
        self._logs: dict[str, _Log] = {}
        # the ended sessions, the one that ended first first: eviction looks at the front only (a stage records a
        # step per step it serves, and scanning every session kept, ten minutes' worth, cost more than the step)
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def record(self, key: str, step: LoggedStep, span: Span | None = None) -> None:
        """Keep `step` of session `key` (run through `span`, where it computed anything)."""
        with self._lock:
            log = self._logs.setdefault(key, _Log())
            log.steps.append(step)
            log.span = span or log.span
            log.nbytes += step.nbytes
            self._bytes += step.nbytes
            self._evict()

    def end(self, key: str) -> None:
        """The session ended: keep its log for `retain_s` more."""
        with self._lock:
            if key in self._logs:
                self._logs[key].ended = self.clock()
                self._ended[key] = None
                self._ended.move_to_end(key)
            self._evict()

    def upto(self, key: str, step: int) -> list[LoggedStep] | None:
        """The session's steps in the order they ran, up to and including `step` (None: not kept, or no
        such step)."""
        with self._lock:
            self._evict()
            log = self._logs.get(key)
            if log is None:
                return None
            for i, s in enumerate(log.steps):
                if s.step == step:
                    return log.steps[:i + 1]
            return None

    def span_of(self, key: str) -> Span | None:
        """The layers session `key`'s steps ran through (None: not kept, or nothing computed)."""
        with self._lock:
            log = self._logs.get(key)
            return log.span if log is not None else None

    def _evict(self) -> None:
        """Drop the ended sessions past `retain_s`, then more of them, first ended first, while over `max_bytes`."""
        now = self.clock()
        while self._ended:
            key = next(iter(self._ended))
            ended = self._logs[key].ended
            assert ended is not None
            if now - ended <= self.retain_s and self._bytes <= self.max_bytes:
                break
            del self._ended[key]
            self._bytes -= self._logs.pop(key).nbytes
