"""A stage's sessions: who may open one (the KV budget, a cap per entry, credit tiers for who waits), close and
idle expiry. The stage server asks it; it holds no runtime of its own beyond the one each session names.

`open` checks the budget and reserves the session's room under one lock, so concurrent opens cannot both pass
it; the cache is allocated outside the lock (allocation can take a while, and the stage's plan changes must not
wait on it).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from beeswarm.contributor import admission
from beeswarm.protocol import ErrorReply
from beeswarm.protocol.session import Open
from beeswarm.shard.errors import SessionError
from beeswarm.shard.span import SpanRuntime

MAX_SESSIONS_PER_PEER = 64


@dataclass
class Session:
    key: str  # "<entry peer>/<session id>": the runtime's session id
    runtime: SpanRuntime  # the span the session was opened on (a node may hold two while migrating)
    entry: str
    session: str
    prev: str  # the only peer whose steps are accepted
    next: str | None  # None: return results to the entry
    last_used: float
    compress: bool = True  # False: raw frames (the entry asked for no compression, for comparisons)
    kv_bytes: int = 0  # the KV cache allocated for it
    payer: str = ""  # whose credit it spends (the entry's own, or the payer that signed for it)
    served: int = 0  # layer-tokens computed for it (logged at its end: the stage's own tally of its receipts)
    keeps: int = 0  # keeps applied to its cache (`CacheState.keeps`)


class Sessions:
    def __init__(self, kv_budget_bytes: int | None = None, idle_timeout_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic,
                 credit: Callable[[str], int | None] = lambda payer: None):
        """`kv_budget_bytes`: memory for KV caches across sessions (None: whatever allocation allows); `clock`:
        monotonic seconds, for idle expiry; `credit(payer)`: its balance in the swarm's ledger (None: no
        account), for whom a full stage admits first."""
        self.kv_budget_bytes, self.idle_timeout_s = kv_budget_bytes, idle_timeout_s
        self.clock, self.credit = clock, credit
        self.waiting = admission.Waiting(clock)
        self._open: dict[str, Session] = {}
        self._opening: dict[str, int] = {}  # sessions being allocated -> the KV bytes reserved for them
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._open)

    def get(self, key: str) -> Session | None:
        return self._open.get(key)

    def all(self) -> list[Session]:
        with self._lock:
            return list(self._open.values())

    def open(self, peer: str, msg: Open, payer: str, runtime: SpanRuntime) -> Session | ErrorReply:
        """Open `peer`'s session `msg` on `runtime`, its cache allocated; or the reply saying why not."""
        key = f"{peer}/{msg.session}"
        with self._lock:
            if sum(s.entry == peer for s in self._open.values()) >= MAX_SESSIONS_PER_PEER:
                return ErrorReply(error=f"too many sessions from one peer (max {MAX_SESSIONS_PER_PEER})", busy=True)
            if key in self._open or key in self._opening:
                return ErrorReply(error=f"session {msg.session!r} is already open")
            need = runtime.kv_bytes(msg.max_length)
            rank = admission.tier(self.credit(payer))
            if self.kv_budget_bytes is not None:
                used = sum(s.kv_bytes for s in self._open.values()) + sum(self._opening.values())
                if used + need > self.kv_budget_bytes:
                    fits = need <= self.kv_budget_bytes  # one that can never fit waits for nothing
                    if fits:
                        self.waiting.refused(payer, rank)
                    free = max(0, self.kv_budget_bytes - used)
                    room = free // runtime.kv_bytes(1) if self.waiting.ahead(payer, rank) == 0 else 0
                    return ErrorReply(error=f"no memory for a session of {msg.max_length} tokens: it needs {need} "
                                            f"bytes of KV cache, {free} are free", busy=True, room=room, queued=fits)
            if ahead := self.waiting.ahead(payer, rank):
                self.waiting.refused(payer, rank)  # it keeps its place in the queue
                return ErrorReply(error=f"room is kept for {ahead} entr{'ies' if ahead > 1 else 'y'} that asked "
                                        "first or hold more credit", busy=True, queued=True)
            self._opening[key] = need
        try:
            runtime.open(key, msg.max_length)
        except SessionError as e:
            return ErrorReply(error=str(e))
        finally:
            with self._lock:
                del self._opening[key]
        session = Session(key, runtime, peer, msg.session, msg.prev, msg.next, self.clock(), msg.compress, need, payer)
        with self._lock:
            self.waiting.admitted(payer)
            self._open[key] = session
        return session

    def close(self, key: str) -> Session | None:
        """Forget the session (its caller frees its cache); None if it was not open."""
        with self._lock:
            return self._open.pop(key, None)

    def expire_idle(self) -> list[Session]:
        """Forget the sessions idle past the timeout, and return them (their caller frees their caches)."""
        cutoff = self.clock() - self.idle_timeout_s
        with self._lock:
            stale = [s for s in self._open.values() if s.last_used < cutoff]
            for s in stale:
                del self._open[s.key]
        return stale
