"""`beeswarm swarm --local N`: N contributor processes on 127.0.0.1, as N small machines would be.

Each child gets its own config dir, a key of its own (handed over in BEESWARM_IDENTITY: children
must not share the one key an OS keyring holds) and a memory budget of its share of the model (an
even split of the layers plus 5%), so the plan really spans all N. The first child's key and port are
chosen here, so the others know its address and start beside it (each spends seconds importing
torch) instead of after it. Children die with the launcher (PR_SET_PDEATHSIG on Linux), so a killed
launcher leaves no orphans.
"""
from __future__ import annotations

import ctypes
import json
import logging
import math
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from beeswarm.config import cache_dir
from beeswarm.contributor.contributor import model_shape
from beeswarm.p2p import identity
from beeswarm.p2p.descriptor import SwarmDescriptor, write
from beeswarm.protocol.membership import Quant
from beeswarm.protocol.spans import Span, even_splits

log = logging.getLogger(__name__)
CONTEXT_TOKENS = 2048


class LocalSwarmError(Exception):
    pass


@dataclass
class Child:
    index: int
    process: subprocess.Popen
    peer: str | None = None
    addr: str | None = None
    span: Span | None = None
    lines: queue.Queue[str | None] = field(default_factory=queue.Queue)  # what the child printed


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the first child listens on it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _runs_dir() -> Path:
    path = cache_dir() / "local-swarm"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _die_with_parent() -> None:
    """In the child before exec, Linux only: SIGTERM when the launcher dies (no portable equivalent;
    elsewhere children are stopped by `LocalSwarm.stop` and the launcher's signal handlers)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def budgets(model: str, n: int, dtype: str = "auto", device: str = "auto", quant: Quant = "none") -> list[int]:
    """Memory per child: its even share of the layers (weights + KV for the default context) + 5%."""
    shape = model_shape(model, device, dtype, quant)
    per_layer = shape.layer_bytes + CONTEXT_TOKENS * shape.kv_bytes_per_token_layer
    return [math.ceil(len(span) * per_layer * 1.05) for span in even_splits(shape.num_layers, n)]


def beeswarm_command() -> list[str]:
    """How to run beeswarm again: the bundle's own binary when frozen by PyInstaller, else `python -m`."""
    return [sys.executable] if getattr(sys, "frozen", False) else [sys.executable, "-m", "beeswarm"]


def threads_per_process(processes: int) -> int:
    """Torch threads for each of `processes` sharing this machine's cores.

    Torch pools that each spin on every core starve one another: on 2 cores, 3 stages and an entry
    decode at 38 tok/s with default pools and 70 tok/s with one thread each.
    """
    return max(1, (os.cpu_count() or 1) // processes)


@dataclass(frozen=True)
class ChildFlags:
    """What every contributor of a local swarm is started with, besides its model (its command line)."""
    heartbeat: float = 1.0
    device: str = "auto"
    quant: Quant = "none"
    log_level: str = "WARNING"


class LocalSwarm:
    def __init__(self, n: int, model: str = "tinycode", base_port: int = 0, flags: ChildFlags = ChildFlags(),
                 state_dir: Path | None = None, announce: list[str] | None = None,
                 on_spawn: Callable[[int, int], None] | None = None):
        """`announce`: per child, the multiaddr peers should dial instead of its own (a link emulator's);
        `on_spawn(index, pid)` is called as each child starts, before it can dial anyone."""
        self.n, self.model, self.base_port, self.flags = n, model, base_port, flags
        self.announce, self.on_spawn = announce, on_spawn
        # One folder per run: two local swarms on one machine must not share identities.
        self.state_dir = state_dir or Path(tempfile.mkdtemp(prefix="swarm-", dir=_runs_dir()))
        self.children: list[Child] = []
        self.num_layers = 0
        self._keys: dict[int, identity.Identity] = {}  # a child's key, kept if it is started again

    def _key(self, index: int) -> identity.Identity:
        return self._keys.setdefault(index, identity.ephemeral())

    def _spawn(self, index: int, budget: int, joins: Sequence[str] = (), port: int | None = None) -> Child:
        port = port if port is not None else self.base_port + index if self.base_port else 0
        f = self.flags
        cmd = [*beeswarm_command(), "--log-level", f.log_level, "contribute", "--headless", "--json-events",
               "--model", self.model, "--listen", f"/ip4/127.0.0.1/tcp/{port}", "--max-memory", str(budget),
               "--device", f.device, "--heartbeat", str(f.heartbeat), "--quant", f.quant]
        for join in joins:
            cmd += ["--join", join]
        if self.announce:
            cmd += ["--announce", self.announce[index]]
        env = {**os.environ, "BEESWARM_CONFIG_DIR": str(self.state_dir / f"node{index}"),
               "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads_per_process(self.n))),
               identity.ENV: identity.encoded(self._key(index))}
        log_file = open(self.state_dir / f"node{index}.log", "a")  # noqa: SIM115 - lives as long as the child
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL,
                                   text=True, env=env,
                                   preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        log_file.close()  # the child holds its own descriptor
        child = Child(index, process)
        if self.on_spawn:
            self.on_spawn(index, process.pid)
        threading.Thread(target=self._read, args=(child,), daemon=True, name=f"child-{index}").start()
        return child

    @staticmethod
    def _read(child: Child) -> None:
        """The child's events, one JSON object a line (`contribute --json-events`)."""
        assert child.process.stdout is not None
        for line in child.process.stdout:
            try:
                event = json.loads(line)
                kind = event["event"]
                if kind == "peer":
                    child.peer = event["peer"]
                elif kind == "addr" and child.addr is None:
                    child.addr = event["addr"]
                elif kind == "serving":
                    child.span = Span(event["start"], event["end"])
            except (ValueError, KeyError, TypeError):
                log.warning("contributor %d printed %r", child.index, line.rstrip())
            child.lines.put(line.rstrip())
        child.lines.put(None)

    def start(self, timeout: float = 120.0) -> str:
        """Start every child; returns the bootstrap multiaddr (the first child's)."""
        from beeswarm.shard import checkpoint
        from beeswarm.shard.loader import load_config

        self.num_layers = load_config(checkpoint.resolve_config(self.model)).num_hidden_layers
        if not 1 <= self.n <= self.num_layers:
            raise LocalSwarmError(f"--local {self.n}: the model has {self.num_layers} layers; use 1..{self.num_layers}")
        sizes = budgets(self.model, self.n, device=self.flags.device, quant=self.flags.quant)
        port = self.base_port or _free_port()
        first = self._spawn(0, sizes[0], port=port)
        self.children.append(first)
        boot = f"{self.announce[0] if self.announce else f'/ip4/127.0.0.1/tcp/{port}'}/p2p/{self._key(0).peer_id}"
        for i in range(1, self.n):  # (a bootstrap not listening yet is dialled again every few seconds)
            self.children.append(self._spawn(i, sizes[i], [boot]))
        deadline = time.monotonic() + timeout
        while first.addr is None:
            if first.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise LocalSwarmError(f"the first contributor did not start (exit status {first.process.poll()})")
            time.sleep(0.05)
        return boot

    def covered(self) -> bool:
        spans = sorted(c.span for c in self.children if c.span)
        reach = 0
        for a, b in ((s.start, s.end) for s in spans):
            if a > reach:
                return False
            reach = max(reach, b)
        return reach == self.num_layers and all(c.span for c in self.children)

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.covered():
            dead = [c for c in self.children if c.process.poll() is not None]
            if dead:
                raise LocalSwarmError(f"contributor {dead[0].index} exited with status {dead[0].process.poll()}")
            if time.monotonic() > deadline:
                raise LocalSwarmError(f"the swarm did not cover all {self.num_layers} layers within {timeout:.0f} s")
            time.sleep(0.1)

    def descriptor(self, bootstrap: str) -> SwarmDescriptor:
        return SwarmDescriptor(name="local", model=self.model, bootstrap=(bootstrap,), private=False,
                               quant=self.flags.quant)

    def write_descriptor(self, bootstrap: str) -> Path:
        return write(self.descriptor(bootstrap), self.state_dir / "swarm.json")

    def stop(self, grace: float = 8.0) -> None:
        for c in self.children:
            if c.process.poll() is None:
                c.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for c in self.children:
            try:
                c.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.process.kill()
                c.process.wait()
        if self.state_dir.parent == _runs_dir():
            shutil.rmtree(self.state_dir, ignore_errors=True)
