"""A local swarm whose every connection crosses the link emulator, and the entry that uses it.

Each of the N stages and the entry listens on its own port and announces a proxy's port instead;
the emulator (its own process) gives every directed link its delay and rate, and `set_links`
changes them between measurements without restarting anything.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from beeswarm.client.swarm import ClientOptions, SwarmClient
from beeswarm.contributor.local_swarm import LocalSwarm
from beeswarm.generation.sampling import SamplingParams
from beeswarm.shard import EntryModel, checkpoint
from beeswarm.shard.loader import load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # helpers shared with the tests
from linkemu import EmulatorProcess  # noqa: E402


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def consecutive_free_ports(n: int) -> list[int]:
    for base in range(23000, 60000, 97):
        try:
            socks = [socket.create_server(("127.0.0.1", base + i)) for i in range(n)]
        except OSError:
            continue
        for s in socks:
            s.close()
        return list(range(base, base + n))
    raise RuntimeError("no free ports")


class EmulatedSwarm:
    """`delays`: one-way seconds into each node ("s0".. "s{n-1}", then `entries`); `rate_bps` on every link.
    An entry in another process listens on `ports(name)[0]`, announces `ports(name)[1]`, and is `register`ed."""

    def __init__(self, model: str, n: int = 3, delays: dict[str, float] | None = None,
                 rate_bps: float | None = None, entries: tuple[str, ...] = ("entry",)):
        self.model, self.n = model, n
        self.names = [f"s{i}" for i in range(n)] + list(entries)
        self.real, self.proxy = consecutive_free_ports(n) + free_ports(len(entries)), free_ports(n + len(entries))
        self.emu = EmulatorProcess(list(zip(self.names, self.real, self.proxy)), delays or {}, rate_bps)
        if "entry" in entries:
            self.emu.register("entry", os.getpid())  # the entry of `client()`, in this process
        self.swarm = LocalSwarm(n, model, base_port=self.real[0],
                                announce=[f"/ip4/127.0.0.1/tcp/{p}" for p in self.proxy[:n]],
                                on_spawn=lambda i, pid: self.emu.register(f"s{i}", pid))
        self.bootstrap: str | None = None

    def start(self) -> EmulatedSwarm:
        self.bootstrap = self.swarm.start()
        self.swarm.wait_ready(timeout=300)
        return self

    def ports(self, name: str) -> tuple[int, int]:
        """(the port `name` listens on, the proxy port it announces)."""
        i = self.names.index(name)
        return self.real[i], self.proxy[i]

    def register(self, name: str, pid: int) -> None:
        self.emu.register(name, pid)

    def vocab_size(self) -> int:
        return int(load_config(checkpoint.resolve_config(self.model)).vocab_size)

    def client(self, options: ClientOptions | None = None, **kwargs) -> SwarmClient:
        entry = EntryModel.load(self.model, "float32", "cpu")
        real, proxy = self.ports("entry")
        client = SwarmClient.create(entry, [self.bootstrap], interval=1.0, listen=[f"/ip4/127.0.0.1/tcp/{real}"],
                                    announce=[f"/ip4/127.0.0.1/tcp/{proxy}"], options=options, **kwargs).start()
        self.settle(client)
        return client

    @staticmethod
    def settle(client: SwarmClient, tries: int = 15) -> None:
        """Warm every channel, and wait out the re-plan that follows the first link probes."""
        last = None
        for _ in range(tries):
            out = client.generate([1, 2, 3], 4, SamplingParams())
            if out.recoveries == 0 and out.route == last:
                return
            last = out.route
            time.sleep(2)

    def set_links(self, delays: dict[str, float], rate_bps: float | None = None) -> None:
        self.emu.set_links(delays, rate_bps)

    def stop(self, grace: float = 8.0) -> None:
        """`grace`: seconds the contributors get to leave (and say what they served) before they are killed."""
        self.swarm.stop(grace)
        self.emu.stop()
