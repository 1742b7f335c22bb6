"""Userspace link emulator: a TCP proxy in front of each node, with one-way delay and a rate limit.

This machine's kernel has no netem, so delay is emulated here. Every node listens on its real
port and announces its proxy's port instead, so every connection between nodes crosses a proxy.
Both directions of a connection get their own directed link: the proxy knows the node it fronts,
and finds the dialling node by the connection's source port (/proc/net/tcp -> socket inode ->
the registered process holding it). A link serialises bytes at its rate (shared by every
connection on it) and delivers each chunk `delay` later, in order.

    emu = LinkEmulator(lambda src, dst: Link(delay_s=0.040, rate_bps=100e6))
    emu.add_node("s1", real_port, proxy_port)
    emu.register("s1", pid)
    emu.start(); ...; emu.stop()

`EmulatorProcess` runs it in a process of its own (what the benchmarks use).
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)
CHUNK = 64 * 1024


@dataclass(frozen=True)
class Link:
    delay_s: float = 0.0  # one way
    rate_bps: float | None = None  # bits per second; None: unlimited


class _Direction:
    """The state of one directed link, shared by every connection crossing it."""

    def __init__(self, link: Link):
        self.link = link
        self.busy_until = 0.0


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
    def __init__(self, link: Callable[[str, str], Link], host: str = "127.0.0.1"):
        self.link, self.host = link, host
        self.pids: dict[int, str] = {}
        self._nodes: list[tuple[str, int, int]] = []  # name, real port, proxy port
        self._directions: dict[tuple[str, str], _Direction] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._servers: list[asyncio.base_events.Server] = []
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.unknown_dialers = 0

    def add_node(self, name: str, real_port: int, proxy_port: int) -> int:
        self._nodes.append((name, real_port, proxy_port))
        return proxy_port

    def register(self, name: str, pid: int) -> None:
        self.pids[pid] = name

    def direction(self, src: str, dst: str) -> _Direction:
        key = (src, dst)
        if key not in self._directions:
            self._directions[key] = _Direction(self.link(src, dst))
        return self._directions[key]

    # lifecycle ------------------------------------------------------------------------------------
    def start(self) -> LinkEmulator:
        self._thread = threading.Thread(target=self._run, daemon=True, name="linkemu")
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("link emulator did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        for name, real, proxy in self._nodes:
            handler = (lambda n, r: lambda rd, wr: self._serve(n, r, rd, wr))(name, real)
            self._servers.append(self._loop.run_until_complete(asyncio.start_server(handler, self.host, proxy)))
        self._ready.set()
        self._loop.run_forever()
        for server in self._servers:
            server.close()
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        if pending:
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()

    # one proxied connection -----------------------------------------------------------------------
    async def _serve(self, name: str, real_port: int, reader, writer) -> None:
        dialer = _owner(writer.get_extra_info("peername")[1], self.pids)
        if dialer is None:
            self.unknown_dialers += 1
            dialer = "?"
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, real_port)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(self._pump(reader, up_writer, self.direction(dialer, name)),
                                 self._pump(up_reader, writer, self.direction(name, dialer)),
                                 return_exceptions=True)
        except asyncio.CancelledError:  # the emulator is stopping
            pass

    async def _pump(self, reader, writer, direction: _Direction) -> None:
        loop = asyncio.get_running_loop()
        queue: collections.deque[tuple[float, bytes]] = collections.deque()
        arrived = asyncio.Event()
        done = False

        async def deliver() -> None:
            while True:
                while not queue:
                    if done:
                        return
                    arrived.clear()
                    await arrived.wait()
                when, data = queue.popleft()
                wait = when - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        link = direction.link
        try:
            while data := await reader.read(CHUNK):
                now = loop.time()
                start = max(now, direction.busy_until)
                direction.busy_until = start + (len(data) * 8 / link.rate_bps if link.rate_bps else 0.0)
                queue.append((direction.busy_until + link.delay_s, data))
                arrived.set()
        except (ConnectionError, OSError):
            pass
        finally:
            done = True
            arrived.set()
            try:
                await sender
                writer.close()
            except (ConnectionError, OSError, asyncio.CancelledError):
                sender.cancel()


class EmulatorProcess:
    """The emulator in a process of its own, so it shares no GIL with the processes it measures.

    `delays`: one-way delay in seconds of the links into each node; `rate_bps` for every link.
    """

    def __init__(self, nodes: list[tuple[str, int, int]], delays: dict[str, float], rate_bps: float | None = None):
        spec = {"nodes": nodes, "delays": delays, "rate_bps": rate_bps}
        self.proc = subprocess.Popen([sys.executable, __file__, json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("link emulator process did not start")
        self.unknown_dialers = 0

    def register(self, name: str, pid: int) -> None:
        self.proc.stdin.write(f"{name} {pid}\n")
        self.proc.stdin.flush()
        if self.proc.stdout.readline().strip() != "ok":
            raise RuntimeError("link emulator process did not take the registration")

    def stop(self) -> None:
        self.proc.stdin.close()  # the emulator reports and exits on end of input
        line = self.proc.stdout.readline().split()
        self.unknown_dialers = int(line[1]) if line[:1] == ["unknown"] else -1
        self.proc.wait(10)


def _serve_from_stdin(spec: dict) -> None:
    delays, rate = spec["delays"], spec["rate_bps"]
    emu = LinkEmulator(lambda src, dst: Link(delays.get(dst, 0.0), rate))
    for name, real, proxy in spec["nodes"]:
        emu.add_node(name, real, proxy)
    emu.start()
    print("ready", flush=True)
    for line in sys.stdin:
        name, pid = line.split()
        emu.register(name, int(pid))
        print("ok", flush=True)
    print(f"unknown {emu.unknown_dialers}", flush=True)
    emu.stop()


if __name__ == "__main__":
    _serve_from_stdin(json.loads(sys.argv[1]))
