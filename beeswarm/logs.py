"""One logging configuration for beeswarm and py-libp2p: one line a record, repeats summarised.

py-libp2p configures its `libp2p` logger when imported (no handlers, no propagation, WARNING), so its
records fall through to Python's last-resort handler and reach stderr raw: unformatted, multi-line,
one per event ("Rate limit exceeded for peer ...", "Failed to open TCP stream ..." hundreds of times
while a peer is gone). `setup()` (the CLI calls it) sends the `beeswarm`, `libp2p` and `multiaddr`
loggers through `Summarised`, which flattens each record to one line and lets `RepeatFilter`
collapse repeats of a message per interval, then hands it to the root logger's handlers (stderr,
or the dashboard's log panel). `adopt_libp2p()` applies it again after py-libp2p's import (node.py
calls it) and does nothing before `setup()` or when LIBP2P_DEBUG asks for py-libp2p's own logging.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
OURS = "beeswarm"
THIRD_PARTY = ("libp2p", "multiaddr")
INTERVAL_S = 10.0
# py-libp2p logs these at ERROR and raises the same failure to its caller, who reports it with context
# (which peer, which bootstrap address): shown at DEBUG only, so a refused dial is one line, ours.
RAISED_TOO = ("Failed to open TCP stream", "Unexpected error opening TCP stream", "MultiselectClient handshake:",
              "failed to upgrade security for peer", "Failed to open stream to peer",
              # and its relay logs every circuit that ends as an ERROR: yamux's close and reset are not the mplex
              # exceptions it knows as an end of stream (relay/circuit_v2/protocol.py:278)
              "Error reading from hop stream", "Unexpected error reading from stream", "Error relaying data",
              "Error writing to destination stream", "Unexpected error handling hop stream",
              "Error sending status message")

# What varies between repeats of one message: multiaddrs and paths, peer ids and other long base58 or
# hex tokens, numbers. py-libp2p formats many messages with f-strings, so `record.msg` alone differs.
_VARYING = re.compile(r"(/[\w.:%-]+)+|\b[1-9A-HJ-NP-Za-km-z]{20,}\b|\b0x[0-9a-fA-F]+\b|\d+(\.\d+)?")


def template(message: str) -> str:
    """`message` with the parts that differ between repeats (addresses, peer ids, numbers) blanked."""
    return _VARYING.sub("#", message)


class RepeatFilter(logging.Filter):
    """Lets the first record of a kind through, then holds back the same kind for `interval` seconds.

    A kind is (logger, level, message template). The first record of a kind after its interval
    carries how many there were since the last one shown: "... (N times in the last 12 s)". Records
    below `level` always pass (INFO and DEBUG are asked for, not noise)."""

    def __init__(self, interval: float = INTERVAL_S, level: int = logging.WARNING,
                 clock: Callable[[], float] = time.monotonic, max_kinds: int = 1000):
        super().__init__()
        self.interval, self.level, self.clock, self.max_kinds = interval, level, clock, max_kinds
        self._kinds: dict[tuple[str, int, str], list[float]] = {}  # kind -> [last shown at, held back since]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.level:
            return True
        key = (record.name, record.levelno, template(str(record.msg)))
        now = self.clock()
        with self._lock:
            seen = self._kinds.get(key)
            if seen is not None and now - seen[0] < self.interval:
                seen[1] += 1
                return False
            if len(self._kinds) >= self.max_kinds:  # forget the kinds with nothing held back
                self._kinds = {k: v for k, v in self._kinds.items() if v[1] and now - v[0] < self.interval}
            self._kinds[key] = [now, 0]
        if seen is not None and seen[1]:
            record.msg = f"{record.getMessage()} ({seen[1] + 1} times in the last {now - seen[0]:.0f} s)"
            record.args = None
        return True


class Summarised(logging.Handler):
    """Forwards records to the root logger's handlers as one line each, repeats collapsed by `RepeatFilter`.

    Set on a logger that does not propagate; records below `level` are dropped."""

    def __init__(self, level: int = logging.NOTSET, interval: float = INTERVAL_S, tracebacks: bool = True,
                 demote: tuple[str, ...] = ()):
        super().__init__(level)
        self.tracebacks = tracebacks  # False: an exception is its type and message, not a traceback
        self.demote = demote  # messages starting so are DEBUG records
        self.addFilter(RepeatFilter(interval))

    def handle(self, record: logging.LogRecord) -> bool:
        record = logging.makeLogRecord(record.__dict__)  # other handlers may see the original
        message = record.getMessage()
        if self.demote and record.levelno > logging.DEBUG and message.startswith(self.demote):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            if record.levelno < self.level:
                return False
        if record.exc_info and not self.tracebacks:
            error = record.exc_info[1]
            message = f"{message}: {type(error).__name__}: {error}" if error is not None else message
            record.exc_info, record.exc_text = None, None
        if "\n" in message:
            message = " | ".join(line.strip() for line in message.splitlines() if line.strip())
        record.msg, record.args = message, None
        if not self.filter(record):
            return False
        self.emit(record)  # no lock of ours: the root's handlers take their own
        return True

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger().handle(record)


_level: int | None = None  # set by `setup()`


# warnings torchao's import logs (CUDA-only kernels absent, torch deprecations): not the user's concern
IMPORT_NOISE = ("torchao", "torch.utils._pytree")


def setup(level: str | int = "WARNING", stream: TextIO | None = None, interval: float = INTERVAL_S) -> None:
    """The process's logging: records at `level` and above on `stream` (stderr), one line each,
    repeated warnings summarised per `interval`. py-libp2p's and multiaddr's records are shown from
    WARNING up (all of them at DEBUG), without tracebacks unless at DEBUG."""
    global _level
    numeric = logging.getLevelName(level) if isinstance(level, str) else level
    logging.basicConfig(level=numeric, format=FORMAT, stream=stream or sys.stderr)
    _level = numeric
    ours = logging.getLogger(OURS)
    _route(ours, Summarised(interval=interval))
    adopt_libp2p(interval)
    for name in IMPORT_NOISE:
        logging.getLogger(name).setLevel(numeric if numeric <= logging.DEBUG else logging.ERROR)


def adopt_libp2p(interval: float = INTERVAL_S) -> None:
    """Send py-libp2p's and multiaddr's loggers through our configuration (after `setup()`; again after
    py-libp2p's import, which resets its logger). Left alone when LIBP2P_DEBUG is set."""
    if _level is None or os.environ.get("LIBP2P_DEBUG"):
        return
    floor = logging.DEBUG if _level <= logging.DEBUG else max(_level, logging.WARNING)
    for name in THIRD_PARTY:
        logger = logging.getLogger(name)
        logger.setLevel(floor)
        _route(logger, Summarised(floor, interval, tracebacks=floor <= logging.DEBUG, demote=RAISED_TOO))
    for name, child in list(logging.root.manager.loggerDict.items()):  # py-libp2p sets a few levels itself
        if isinstance(child, logging.Logger) and name.startswith(tuple(f"{n}." for n in THIRD_PARTY)):
            child.setLevel(logging.NOTSET)
            child.handlers.clear()
            child.propagate = True


@dataclass(frozen=True)
class Saved:
    """The logging configuration `setup()` changes, as it was (`save()`, `restore()`: for code that configures
    logging for a while, tests and embedders)."""
    level: int | None
    loggers: dict[str, tuple[int, list[logging.Handler], bool]]  # name -> (level, handlers, propagate)


def save() -> Saved:
    return Saved(_level, {name: (logger.level, list(logger.handlers), logger.propagate)
                          for name in ("", OURS, *THIRD_PARTY) for logger in [logging.getLogger(name)]})


def restore(saved: Saved) -> None:
    global _level
    for name, (level, handlers, propagate) in saved.loggers.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.handlers[:] = handlers
        logger.propagate = propagate
    _level = saved.level


def _route(logger: logging.Logger, handler: Summarised) -> None:
    for old in [h for h in logger.handlers if isinstance(h, Summarised)]:
        logger.removeHandler(old)
    if logger.name in THIRD_PARTY:
        logger.handlers.clear()  # py-libp2p's own (a queue to its listener when LIBP2P_DEBUG was set)
    logger.addHandler(handler)
    logger.propagate = False
