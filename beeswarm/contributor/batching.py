"""When a stage runs its next pass: how many sessions' steps it takes, and how long it waits for more.

A pass over b steps, each padded to the longest one's q tokens, costs about fixed + b q x per_token. The fixed
part (reading every weight of the span once, launching its kernels) is shared by every step in the pass; on a GPU
a decode step is almost all fixed cost. The stage learns both from its own passes: a least-squares line through
the recent (tokens, seconds) of its passes, the older ones weighing less. The steps taken are cut into passes of
similar lengths where the padding would cost more than another pass's fixed cost (`passes_for`).

A stage holding steps of fewer sessions than it could batch waits for the sessions whose next step is due: each
session's steps come round at its own pace (its cycle: the ring, and every stage's pass), so its next is expected
one cycle after its last. It waits at most `share` of a pass's fixed cost (and MOST_S), until the steps due within
that time have come, while

- it is compute-bound: it computed over `busy_above` of the recent time (an idle stage never waits: nothing
  would queue behind its pass);
- waiting pays: recent waits brought another session's step (GAIN_FLOOR on average). Otherwise it waits only one
  time in PROBE_EVERY, to notice when they would again.

A step that comes within the wait rides in this pass rather than paying the fixed cost again in a pass of its
own. A session due long after the wait (another wave of users, at another stage of the pipeline now) is not
waited for: merging waves would leave the pipeline's other stages idle. Pure: the clock is the caller's, no
torch, no network.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

MAX_BATCH = 16  # sessions' steps in one pass
RECENT_S = 2.0  # a session with no step for this long is forgotten
MOST_S = 0.05  # the longest wait for more steps
ALPHA = 0.1  # weight of the newest pass in the running figures
CYCLE_ALPHA = 0.3  # of a session's newest time between steps in its cycle
GAIN_FLOOR = 0.5  # sessions' steps a wait must bring on average to go on waiting
PROBE_EVERY = 8  # while waits do not pay, one in this many waits all the same


@dataclass
class _Stepper:
    last: float  # when its last step arrived
    cycle: float | None = None  # running time between its steps


@dataclass(frozen=True)
class Wait:
    until: float
    sessions: frozenset[str]  # those due: the wait ends early once they are all in hand


@dataclass
class Batching:
    max_batch: int = MAX_BATCH
    window: bool = True  # False: never wait (a pass takes what has arrived)
    share: float = 0.5  # of a pass's fixed cost, the most a stage waits
    busy_above: float = 0.5
    passes: int = 0
    steps: int = 0
    compute_s: float = 0.0
    busy: float = 0.0  # running share of the time spent computing
    gain: float = 1.0  # running sessions' steps a wait brought
    _line: list[float] = field(default_factory=lambda: [0.0] * 5)  # weighted n, x, y, xx, xy of (tokens, seconds)
    _last_end: float | None = None
    _stepped: dict[str, _Stepper] = field(default_factory=dict)
    _declined: int = 0  # waits skipped since the last one taken

    def arrived(self, session: str, now: float) -> None:
        known = self._stepped.get(session)
        if known is None:
            self._stepped[session] = _Stepper(now)
            if len(self._stepped) > 64 * self.max_batch:  # sessions that stopped stepping
                self._stepped = {s: k for s, k in self._stepped.items() if now - k.last <= RECENT_S}
            return
        gap = now - known.last
        known.cycle = gap if known.cycle is None else known.cycle + CYCLE_ALPHA * (gap - known.cycle)
        known.last = now

    def due(self, in_hand: Collection[str], now: float, within: float) -> dict[str, float]:
        """The sessions not in hand whose next step is expected within `within` of `now` (late by as much
        included), with when."""
        out = {}
        for session, known in self._stepped.items():
            if session not in in_hand and known.cycle is not None and now - known.last <= RECENT_S:
                expected = known.last + known.cycle
                if abs(expected - now) <= within:
                    out[session] = expected
        return out

    def ran(self, steps: int, tokens: int, started: float, ended: float) -> None:
        """A pass of `steps` steps, `tokens` tokens in all with their padding, computed from `started` to `ended`."""
        seconds = max(0.0, ended - started)
        idle = 0.0 if self._last_end is None else max(0.0, started - self._last_end)
        self._last_end = ended
        self.passes, self.steps, self.compute_s = self.passes + 1, self.steps + steps, self.compute_s + seconds
        if seconds + idle > 0:
            self.busy += ALPHA * (seconds / (seconds + idle) - self.busy)
        x, y = float(tokens), seconds
        self._line = [(1 - ALPHA) * s + ALPHA * v for s, v in zip(self._line, (1.0, x, y, x * x, x * y))]

    def _fit(self) -> tuple[float, float] | None:
        """(fixed seconds of a pass, seconds a token), as learnt (None: no pass yet)."""
        n, sx, sy, sxx, sxy = self._line
        if n <= 0:
            return None
        mx, my = sx / n, sy / n
        var = sxx / n - mx * mx
        if var <= 1e-9 * max(1.0, mx * mx):  # every pass the same size: no way to tell fixed from per token
            return my, 0.0
        slope = max(0.0, (sxy / n - mx * my) / var)
        return min(my, max(0.0, my - slope * mx)), slope

    @property
    def fixed_s(self) -> float | None:
        """A pass's cost whatever it holds, as learnt (None: no pass yet)."""
        fit = self._fit()
        return None if fit is None else fit[0]

    def passes_for(self, lengths: Sequence[int]) -> list[list[int]]:
        """Steps of `lengths` tokens (a pass pads each to its longest) cut into passes, as indices: longest first,
        a step joins the pass before unless the padding it brings would cost more than a pass of its own (before
        any figures: more padding than its own tokens). A decode step padded to a 500-token prompt's length costs
        500 tokens."""
        fit = self._fit()
        out: list[list[int]] = []
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            if out:
                padding = lengths[out[-1][0]] - lengths[i]
                fixed, per_token = fit if fit is not None and fit[1] > 0 else (float(lengths[i]), 1.0)
                if padding * per_token <= fixed:
                    out[-1].append(i)
                    continue
            out.append([i])
        return out

    def wait_for(self, in_hand: Collection[str], now: float) -> Wait | None:
        """Whether to wait for more steps, holding steps of the sessions `in_hand` (None: run now)."""
        fixed = self.fixed_s
        if not self.window or fixed is None or self.busy < self.busy_above or len(in_hand) >= self.max_batch:
            return None
        most = min(MOST_S, self.share * fixed)
        due = self.due(in_hand, now, most)
        if not due:
            return None
        if self.gain < GAIN_FLOOR:
            self._declined += 1
            if self._declined < PROBE_EVERY:
                return None
        self._declined = 0
        return Wait(min(now + most, max(now, *due.values()) + most / 4), frozenset(due))

    def waited(self, brought: int) -> None:
        """A wait brought steps of `brought` more sessions."""
        self.gain += 2 * ALPHA * (brought - self.gain)
