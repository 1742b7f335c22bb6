"""beeswarm processes on the network test bed (tests/netbed.py): contributors, chats and status on its hosts."""
from __future__ import annotations

import json
import queue
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from helpers import lines_of, read_until
from netbed import Host, NetBed

MODEL = "tinycode"
PORT = 4001  # each host has its own namespace, so every node can listen on the same port
PROMPT = "def fibonacci(n):"


@dataclass
class Swarm:
    """beeswarm processes on the bed's hosts, their logs under `logs`."""
    bed: NetBed
    logs: Path
    env: dict[str, str]
    boot: str | None = None
    procs: list[subprocess.Popen] = field(default_factory=list)
    lines: dict[str, queue.Queue] = field(default_factory=dict)  # a contributor's stdout lines, by peer id

    def command(self, host: Host, name: str, *argv: str, verbose: bool = False) -> subprocess.Popen:
        """`beeswarm *argv` on `host`, its log (INFO and up when `verbose`) in `name`.log."""
        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 - the process writes it while it runs
        level = ["--log-level", "INFO"] if verbose else []
        proc = host.popen([sys.executable, "-m", "beeswarm", *level, *argv], stdout=subprocess.PIPE, stderr=log,
                          text=True, env={**self.env, "BEESWARM_CONFIG_DIR": str(self.logs / name)})
        self.procs.append(proc)
        return proc

    def start(self, host: Host, name: str, memory: int, *extra: str, verbose: bool = False) -> Callable[[], str]:
        """Start a headless contributor on `host`; the function returned waits for its peer id. Start the first
        (the swarm's bootstrap) alone; the others may start together."""
        argv = ["contribute", "--headless", "--model", MODEL, "--listen", f"/ip4/0.0.0.0/tcp/{PORT}",
                "--max-memory", str(memory), "--heartbeat", "1", *extra]
        proc = self.command(host, name, *argv, *(["--join", self.boot] if self.boot else []), verbose=verbose)
        lines = lines_of(proc)

        def peer_id() -> str:
            peer = read_until(lines, "peer ", 90)[0].split()[1]
            self.lines[peer] = lines
            if self.boot is None:
                self.boot = f"/ip4/{host.addr}/tcp/{PORT}/p2p/{peer}"
            return peer

        return peer_id

    def contribute(self, host: Host, name: str, memory: int, *extra: str, verbose: bool = False) -> str:
        """A headless contributor on `host`, started; returns its peer id."""
        return self.start(host, name, memory, *extra, verbose=verbose)()

    def chat(self, host: Host, name: str, tokens: int = 8, timeout: float = 240) -> dict:
        assert self.boot is not None
        out = host.run([sys.executable, "-m", "beeswarm", "chat", "--join", self.boot, "--model", MODEL, "--greedy",
                        "--no-spec", "--json", "--max-new-tokens", str(tokens), "--heartbeat", "1",
                        "--prompt", PROMPT], timeout=timeout, env={**self.env,
                                                                  "BEESWARM_CONFIG_DIR": str(self.logs / name)})
        (self.logs / f"{name}.log").write_text(out.stderr)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout)

    def status(self, host: Host) -> dict:
        assert self.boot is not None
        out = host.run([sys.executable, "-m", "beeswarm", "status", "--join", self.boot, "--json"], timeout=120,
                       env=self.env)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout)
