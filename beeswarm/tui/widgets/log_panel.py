"""The log, fed by Python's logging from any thread."""
from __future__ import annotations

import collections
import logging

from textual.widgets import Log

KEPT_LINES = 2000  # lines waiting for the panel at most (the oldest go first)


class LogPanel(Log):
    pass


class PanelHandler(logging.Handler):
    """Keeps records for a LogPanel; the app writes them out on its own timer (`lines`).

    `emit` never waits for the app: a terminal that stops reading (Ctrl-S, a slow SSH link) stalls the app's loop,
    and a handler waiting on it would stall every thread that logs, the node's p2p loop among them, holding
    whatever lock it logged under. While the app is stalled, lines past KEPT_LINES are dropped, and counted."""

    def __init__(self, level: int = logging.INFO):
        super().__init__(level)
        self._waiting: collections.deque[str] = collections.deque(maxlen=KEPT_LINES)
        self.dropped = 0  # lines dropped while the panel was not written (counted, then shown as one line)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # noqa: BLE001 - logging's own contract: a bad record is reported, never raised
            self.handleError(record)
            return
        if len(self._waiting) == KEPT_LINES:
            self.dropped += 1
        self._waiting.append(line)  # (a deque's append and popleft are thread-safe)

    def lines(self) -> list[str]:
        """The lines logged since the last call (in the app's thread), with a note of any dropped."""
        out = []
        if self.dropped:
            out.append(f"({self.dropped} log lines dropped while the screen was not updated)")
            self.dropped = 0
        while self._waiting:
            out.append(self._waiting.popleft())
        return out
