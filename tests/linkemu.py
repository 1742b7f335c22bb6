"""Userspace link emulator: a TCP proxy in front of each node, with one-way delay and a rate limit.

This machine's kernel has no netem, so delay is emulated here. Every node listens on its real
port and announces its proxy's port instead, so every connection between nodes crosses a proxy.
Both directions of a connection get their own directed link: the proxy knows the node it fronts,
and finds the dialling node by the connection's source port (/proc/net/tcp -> socket inode ->
the registered process holding it). Bytes leave a node through its uplink at the link's rate
(shared by everything the node sends, as a home or office uplink is) and arrive the link's
one-way delay later, in order.

    emu = LinkEmulator(lambda src, dst: Link(delay_s=0.040, rate_bps=100e6))
    emu.add_node("s1", real_port, proxy_port)
    emu.register("s1", pid)
    emu.start(); ...; emu.stop()

`EmulatorProcess` runs it in a process of its own (what the benchmarks use).
"""
from __future__ import annotations

import collections
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)
CHUNK = 64 * 1024


@dataclass(frozen=True)
class Link:
    delay_s: float = 0.0  # one way
    rate_bps: float | None = None  # bits per second; None: unlimited


class _Uplink:
    """A node's serialiser: its rate is shared by everything it sends, to any peer."""

    def __init__(self):
        self.busy_until = 0.0  # perf_counter time it is free again
        self.lock = threading.Lock()


class _Direction:
    """One directed link: the sender's uplink (shared), then the path's one-way delay."""

    def __init__(self, link: Link, uplink: _Uplink):
        self.link, self.uplink = link, uplink

    @property
    def chunk(self) -> int:
        """Bytes per read: small on slow links, so delivery is smooth (about 1 ms of the link's time)."""
        rate = self.link.rate_bps
        return CHUNK if not rate else int(max(1500, min(CHUNK, rate / 8 / 1000)))

    @property
    def queue_limit(self) -> int:
        """Bytes in flight before the sender is held back: twice the bandwidth-delay product, >= 4 MiB."""
        return max(4 * 2**20, int((self.link.rate_bps or 0) / 8 * self.link.delay_s * 2))

    def stamp(self, size: int, now: float) -> float:
        """When a chunk of `size` bytes read at `now` reaches the far end."""
        up = self.uplink
        with up.lock:
            start = max(now, up.busy_until)
            up.busy_until = start + (size * 8 / self.link.rate_bps if self.link.rate_bps else 0.0)
            return up.busy_until + self.link.delay_s


def _socket_inode(port: int) -> str | None:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                return fields[9]
    return None


def _owner(port: int, pids: dict[int, str]) -> str | None:
    """The registered node whose process holds the local end of 127.0.0.1:`port`."""
    inode = _socket_inode(port)
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for pid, name in pids.items():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    return name
            except OSError:
                continue
    return None


class LinkEmulator:
    """Proxies on `host`, one per node; threads, not asyncio, for sub-millisecond timing."""

    def __init__(self, link: Callable[[str, str], Link], host: str = "127.0.0.1"):
        self.link, self.host = link, host
        self.pids: dict[int, str] = {}
        self._listeners: list[tuple[str, int, socket.socket]] = []
        self._directions: dict[tuple[str, str], _Direction] = {}
        self._uplinks: dict[str, _Uplink] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._sockets: set[socket.socket] = set()
        self.unknown_dialers = 0

    def add_node(self, name: str, real_port: int, proxy_port: int) -> int:
        listener = socket.create_server((self.host, proxy_port), backlog=64)
        self._listeners.append((name, real_port, listener))
        return listener.getsockname()[1]

    def register(self, name: str, pid: int) -> None:
        self.pids[pid] = name

    def set_links(self, link: Callable[[str, str], Link]) -> None:
        """Change every link, including those of open connections."""
        with self._lock:
            self.link = link
            for (src, dst), direction in self._directions.items():
                direction.link = link(src, dst)

    def direction(self, src: str, dst: str) -> _Direction:
        with self._lock:
            if (src, dst) not in self._directions:
                uplink = self._uplinks.setdefault(src, _Uplink())
                self._directions[(src, dst)] = _Direction(self.link(src, dst), uplink)
            return self._directions[(src, dst)]

    def start(self) -> LinkEmulator:
        for name, real, listener in self._listeners:
            threading.Thread(target=self._accept, args=(name, real, listener), daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        for _, _, listener in self._listeners:
            listener.close()
        with self._lock:
            for sock in self._sockets:
                _close(sock)

    def _accept(self, name: str, real_port: int, listener: socket.socket) -> None:
        while not self._stopped.is_set():
            try:
                conn, peer = listener.accept()
            except OSError:
                return
            dialer = _owner(peer[1], self.pids)
            if dialer is None:
                self.unknown_dialers += 1
                dialer = "?"
            try:
                upstream = socket.create_connection((self.host, real_port))
            except OSError:
                _close(conn)
                continue
            for sock in (conn, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets.update((conn, upstream))
            _Pump(conn, upstream, self.direction(dialer, name)).start()
            _Pump(upstream, conn, self.direction(name, dialer)).start()


SPIN_S = 0.0015  # sleeps overshoot by ~0.1 ms under load: wait out the last stretch in a yielding spin


def _sleep_until(when: float) -> None:
    wait = when - time.perf_counter()
    if wait > SPIN_S:
        time.sleep(wait - SPIN_S)
    while time.perf_counter() < when:
        time.sleep(0)  # yields the GIL to the other pumps


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class _Pump:
    """One direction of one connection: a reader stamps chunks, a writer delivers them on time.

    The queue is bounded (a bandwidth-delay product plus slack), so a sender that outruns the link
    is held back by TCP, as on a real link.
    """

    def __init__(self, src: socket.socket, dst: socket.socket, direction: _Direction):
        self.src, self.dst, self.direction = src, dst, direction
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.queued = 0
        self.cond = threading.Condition()
        self.done = False

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self) -> None:
        try:
            while data := self.src.recv(self.direction.chunk):
                now = time.perf_counter()
                with self.cond:
                    while self.queued > self.direction.queue_limit and not self.done:
                        self.cond.wait()
                    self.queue.append((self.direction.stamp(len(data), now), data))
                    self.queued += len(data)
                    self.cond.notify_all()
        except OSError:
            pass
        with self.cond:
            self.done = True
            self.cond.notify_all()

    def _write(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.queue and not self.done:
                        self.cond.wait()
                    if not self.queue:
                        break
                    when, data = self.queue.popleft()
                    self.queued -= len(data)
                    self.cond.notify_all()
                _sleep_until(when)
                self.dst.sendall(data)
            self.dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


class EmulatorProcess:
    """The emulator in a process of its own, so it shares no GIL with the processes it measures.

    `delays`: one-way delay in seconds of the links into each node; `rate_bps` for every link.
    """

    def __init__(self, nodes: list[tuple[str, int, int]], delays: dict[str, float], rate_bps: float | None = None):
        spec = {"nodes": nodes, "delays": delays, "rate_bps": rate_bps}
        self.proc = subprocess.Popen([sys.executable, __file__, json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().split()
        if line[:1] != ["ready"]:
            raise RuntimeError("link emulator process did not start")
        self.ports = [int(p) for p in line[1:]]  # the proxies' ports, in the order of `nodes`
        self.unknown_dialers = 0

    def register(self, name: str, pid: int) -> None:
        self._say(f"{name} {pid}")

    def set_links(self, delays: dict[str, float], rate_bps: float | None = None) -> None:
        self._say("links " + json.dumps({"delays": delays, "rate_bps": rate_bps}))

    def _say(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        if self.proc.stdout.readline().strip() != "ok":
            raise RuntimeError(f"link emulator process did not take {line!r}")

    def stop(self) -> None:
        self.proc.stdin.close()  # the emulator reports and exits on end of input
        line = self.proc.stdout.readline().split()
        self.unknown_dialers = int(line[1]) if line[:1] == ["unknown"] else -1
        self.proc.wait(10)


def _links(spec: dict) -> Callable[[str, str], Link]:
    delays, rate = spec["delays"], spec["rate_bps"]
    return lambda src, dst: Link(delays.get(dst, 0.0), rate)


def _serve_from_stdin(spec: dict) -> None:
    emu = LinkEmulator(_links(spec))
    ports = [emu.add_node(name, real, proxy) for name, real, proxy in spec["nodes"]]
    emu.start()
    print("ready", *ports, flush=True)
    for line in sys.stdin:
        if line.startswith("links "):
            emu.set_links(_links(json.loads(line[6:])))
        else:
            name, pid = line.split()
            emu.register(name, int(pid))
        print("ok", flush=True)
    print(f"unknown {emu.unknown_dialers}", flush=True)
    emu.stop()


if __name__ == "__main__":
    _serve_from_stdin(json.loads(sys.argv[1]))
