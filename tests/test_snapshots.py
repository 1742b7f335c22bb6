"""Snapshots of the contribute dashboard's screens (pytest-textual-snapshot; `--snapshot-update` accepts
changes after a look at the report).

A snapshot needs the same figures every run, so the dashboard here renders one recorded status instead
of a live contributor (tests/test_dashboard.py drives it with a real one). The chat app's snapshot is in
tests/test_tui.py, beside its real swarm.
"""
from __future__ import annotations

import logging
import threading

import pytest

from beeswarm.contributor.status import ContributorStatus, PeerRow, Progress, ServingFigures, ShardFigures
from beeswarm.protocol.spans import Span
from beeswarm.tui.dashboard_app import DashboardApp

ME = "12D3KooWGJ8Zz1xAfS1dw3QV2uSLkD1zK7nV7V8V3xFqQ9N7hBee"
STATUS = ContributorStatus(
    peer=ME, swarm="beeswarm", model="tinycode", private=True, state="serving",
    coordinator="12D3KooWQ1ZL3wRrFmQ6dZ7XQv2w1e5G7t9bD5K3u1qPcoord", term=3, epoch=17,
    addrs=(f"/ip4/192.0.2.7/tcp/31337/p2p/{ME}",),
    peers=(PeerRow(ME, "contributor", Span(0, 4), "cuda:0", 41.5, None, None, "serving", me=True, reach="public"),
           PeerRow("12D3KooWQ1ZL3wRrFmQ6dZ7XQv2w1e5G7t9bD5K3u1qPcoord", "contributor", Span(4, 8), "cpu", 40.9, 23.4,
                   87.0, "serving", reach="public"),
           PeerRow("12D3KooWHx7nJr2vK1s9Fq3Lw8pD4mZ6cT5bY2aN1uEclient", "client", None, "cpu", 0.0, 61.2, 18.0,
                   "joining", reach="private")),
    shard=ShardFigures(Span(0, 4), 0.25, 8 << 30, 3 << 30),
    serving=ServingFigures(sessions=2, steps=812, tokens=1930, tokens_per_s=41.5,
                           history=tuple(float(min(t, 41.5)) for t in range(0, 120, 2)), raw_in=7 << 20,
                           wire_in=5 << 20, raw_out=7 << 20, wire_out=5 << 20, reveals=3, kept_bytes=12 << 20,
                           credit=1_234_567, receipts=42, receipts_waiting=2),
    progress=(Progress("bench", "device benchmark", 6, 6, started=0.0),
              Progress("download model-00001-of-00002.safetensors", "download model-00001-of-00002...",
                       (1 << 30), (1 << 30), unit="B", started=0.0),
              Progress("load", "loading layers [0, 4)", 3, 4, started=0.0),
              Progress("probe 12D3KooWQ1ZL3wRrFmQ6dZ7XQv2w1e5G7t9bD5K3u1qPcoord", "link probe u1qPcoord", 0, 3,
                       started=0.0, error="peer unreachable")))


class Recorded:
    """A contributor that has stopped moving: what `DashboardApp` reads, fixed at STATUS."""

    ready, paused = True, False

    def __init__(self):
        self.stopping = threading.Event()

    def status(self) -> ContributorStatus:
        return STATUS

    def stop(self) -> None:
        self.stopping.set()


@pytest.fixture(autouse=True)
def quiet_log():
    """Nothing logged by other tests' leftovers may reach the log panel while a screen is taken."""
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


def test_dashboard_main_screen(snap_compare):
    assert snap_compare(DashboardApp(Recorded(), start=False), terminal_size=(130, 42))


def test_dashboard_help(snap_compare):
    assert snap_compare(DashboardApp(Recorded(), start=False), press=["question_mark"], terminal_size=(130, 42))
