"""Logging: repeats of a message collapse to one line per interval; py-libp2p's records go through ours."""
from __future__ import annotations

import io
import logging

import pytest

from beeswarm import logs


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def record(msg: str, *args: object, name: str = "libp2p.pubsub.gossipsub", level: int = logging.WARNING):
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_repeats_of_a_message_collapse_to_one_line_per_interval_with_their_count():
    clock = Clock()
    f = logs.RepeatFilter(interval=10.0, clock=clock)
    shown = []

    def log(r: logging.LogRecord) -> None:
        if f.filter(r):
            shown.append(r.getMessage())

    for i in range(50):  # a storm: 50 in 5 s, each naming another peer
        log(record("Rate limit exceeded for peer %s on topic %s", f"12D3KooWPeer{i:040d}", "beeswarm/x/members"))
        clock.now += 0.1
    log(record("Failed to open TCP stream to /ip4/10.0.0.7/tcp/4001: refused"))  # another kind: shown
    assert len(shown) == 2 and shown[0].startswith("Rate limit exceeded for peer 12D3KooWPeer")
    clock.now = 111.0
    log(record("Rate limit exceeded for peer %s on topic %s", "12D3KooWOther", "beeswarm/x/members"))
    assert shown[-1].endswith("(50 times in the last 11 s)"), shown[-1]  # the 49 held back and this one
    clock.now += 1
    log(record("Rate limit exceeded for peer %s on topic %s", "12D3KooWOther", "beeswarm/x/members"))
    assert len(shown) == 3  # a new interval started with the line above
    clock.now += 20
    log(record("Rate limit exceeded for peer %s on topic %s", "12D3KooWOther", "beeswarm/x/members"))
    assert shown[-1].endswith("(2 times in the last 21 s)")
    clock.now += 20
    log(record("Rate limit exceeded for peer %s on topic %s", "12D3KooWOther", "beeswarm/x/members"))
    assert not shown[-1].endswith(")")  # nothing held back: plain
    for _ in range(3):  # INFO and DEBUG are asked for: never held back
        log(record("member %s joined", "x", level=logging.INFO))
    assert len(shown) == 8


def test_summarised_handler_makes_one_line_and_hands_records_to_the_root_handlers():
    stream = io.StringIO()
    root_handler = logging.StreamHandler(stream)
    root_handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("libp2p.test_summarised")
    root = logging.getLogger()
    root.addHandler(root_handler)
    handler = logs.Summarised(logging.WARNING, tracebacks=False)
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.error("all failed:\nError 1: refused\nError 2: timed out")
        for _ in range(5):
            logger.error("Failed to open TCP stream: %s", "all attempts to connect to 127.0.0.1:1 failed")
        try:
            raise OSError("Connection refused")
        except OSError:
            logger.exception("MultiselectClient handshake: read failed")
        logger.info("below the handler's level")
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
        root.removeHandler(root_handler)
    lines = stream.getvalue().splitlines()
    assert lines == ["ERROR libp2p.test_summarised: all failed: | Error 1: refused | Error 2: timed out",
                     "ERROR libp2p.test_summarised: Failed to open TCP stream: all attempts to connect to "
                     "127.0.0.1:1 failed",
                     "ERROR libp2p.test_summarised: MultiselectClient handshake: read failed: OSError: "
                     "Connection refused"]


@pytest.fixture
def saved_logging():
    """Put the loggers `logs.setup` changes back as they were."""
    saved = logs.save()
    yield
    logs.restore(saved)


def test_py_libp2p_records_go_through_our_configuration_even_after_its_import_resets_its_logger(saved_logging,
                                                                                               monkeypatch):
    import libp2p.utils.logging as libp2p_logging

    monkeypatch.delenv("LIBP2P_DEBUG", raising=False)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(logs.FORMAT))
    logging.getLogger().handlers[:] = [handler]  # what basicConfig installs in the CLI (pytest's back after)
    logs.setup("WARNING", stream=stream)
    libp2p_logging.setup_logging()  # what importing py-libp2p does: no handlers, no propagation
    assert logging.getLogger("libp2p").propagate is False
    logs.adopt_libp2p()  # node.py, after the import
    noisy = logging.getLogger("libp2p.transport.tcp.tcp")
    gossip = logging.getLogger("libp2p.pubsub.gossipsub")
    for i in range(20):
        gossip.warning("Rate limit exceeded for peer %s on topic %s", f"12D3KooWPeer{i}", "beeswarm/x/members")
    for _ in range(5):  # py-libp2p logs it at ERROR and raises it to us too: our message names the address
        noisy.error("Failed to open TCP stream: %s", "all attempts to connect to 127.0.0.1:1 failed")
    noisy.info("dialing")  # below WARNING at the default level
    out = stream.getvalue().splitlines()
    assert len(out) == 1 and " WARNING libp2p.pubsub.gossipsub: Rate limit exceeded for peer" in out[0], out
