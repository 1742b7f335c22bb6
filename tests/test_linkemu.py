"""The benchmarks' link emulator: added one-way delay and rate within 10% of what was asked."""
from __future__ import annotations

import os
import socket
import statistics
import threading
import time

import pytest

from linkemu import EmulatorProcess

pytestmark = pytest.mark.slow  # the emulator runs in a process of its own


def server(handle) -> int:
    """A server on 127.0.0.1 running `handle(conn)` for every connection, each in its own thread."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)

    def one(conn):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        handle(conn)
        conn.close()

    def serve():
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=one, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


def echo(conn):
    while data := conn.recv(65536):
        conn.sendall(data)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def through(delay_s: float = 0.0, rate_bps: float | None = None, handle=echo, connections: int = 1):
    """Client sockets to a server behind the emulator (both directions on links of the same kind)."""
    port = server(handle)
    emu = EmulatorProcess([("server", port, free_port())], {"server": delay_s, "client": delay_s}, rate_bps)
    emu.register("client", os.getpid())
    socks = [socket.create_connection(("127.0.0.1", emu.ports[0])) for _ in range(connections)]
    for sock in socks:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return emu, socks[0] if connections == 1 else socks


def rtt(sock) -> float:
    t = time.perf_counter()
    sock.sendall(b"x" * 100)
    got = 0
    while got < 100:
        got += len(sock.recv(100 - got))
    return time.perf_counter() - t


@pytest.mark.parametrize("delay_ms", [1, 10, 100, 300])
def test_added_delay_is_within_10_percent(delay_ms):
    """Pings alternate between a proxy without delay and one with it, so both see the same load;
    the fastest of each estimates the fixed cost (noise on a busy machine only ever adds)."""
    base_emu, base = through()
    emu, sock = through(delay_s=delay_ms / 1000)
    pings = 40 if delay_ms < 100 else 4
    try:
        base_rtts, rtts = zip(*[(rtt(base), rtt(sock)) for _ in range(pings)])
    finally:
        for s, e in ((sock, emu), (base, base_emu)):
            s.close()
            e.stop()
    added = min(rtts) - min(base_rtts)
    assert added / 2 == pytest.approx(delay_ms / 1000, rel=0.10), f"one way {added / 2 * 1000:.3f} ms"


@pytest.mark.parametrize("mbit", [5, 100, 2000])
def test_rate_is_within_10_percent(mbit):
    seconds = 1.5
    total = int(mbit * 1e6 / 8 * seconds)
    arrived: list[float] = []

    def sink(conn):
        got = 0
        while got < total and (data := conn.recv(1 << 20)):
            if not got:
                arrived.append(time.perf_counter())
            got += len(data)
        arrived.append(time.perf_counter())

    emu, sock = through(rate_bps=mbit * 1e6, handle=sink)
    try:
        block = b"\0" * (1 << 20)
        sent = 0
        while sent < total:
            n = min(len(block), total - sent)
            sock.sendall(block[:n])
            sent += n
        deadline = time.monotonic() + 30
        while len(arrived) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # a poll: the receiver thread records what arrived
    finally:
        sock.close()
        emu.stop()
    rate = total * 8 / (arrived[1] - arrived[0])
    assert rate == pytest.approx(mbit * 1e6, rel=0.10), f"{rate / 1e6:.1f} Mbit/s"


def test_many_concurrent_connections_each_get_the_delay():
    base_emu, base = through()
    base_rtt = min(rtt(base) for _ in range(20))
    base.close()
    base_emu.stop()
    emu, socks = through(delay_s=0.020, connections=16)
    rtts: list[float] = []
    try:
        threads = [threading.Thread(target=lambda s=s: rtts.append(min(rtt(s) for _ in range(5)))) for s in socks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for sock in socks:
            sock.close()
        emu.stop()
    assert len(rtts) == 16
    assert (statistics.median(rtts) - base_rtt) / 2 == pytest.approx(0.020, rel=0.10)
