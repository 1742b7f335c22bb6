"""A network test bed for "across home routers" tests, built from Linux network namespaces.

Topology (IPv4 only; every box is its own namespace, nothing is added to the host's own one):

    public hosts 198.51.100.10+ --+                          +-- home router WAN 203.0.113.10+
                                  +-- "internet" (a router) -+        | NAT + stateful firewall
                                                                      +-- LAN 10.0.N.0/24: machines .10+

The internet namespace routes between two public segments from the documentation ranges:
198.51.100.0/24 for public hosts and 203.0.113.0/24 for the home routers' WAN sides. 192.0.2.0/24 is
left unused on purpose: it is this machine's own eth0 subnet, and a bed address that looks like the
host's would only confuse someone reading the logs. The internet knows no private ranges, so a
private address is unreachable from anywhere but its own LAN, as on the real internet.

A home router masquerades its LAN behind its WAN address with nftables and drops unsolicited inbound
(the conntrack "established,related" rule is the only way in). Linux masquerade keeps the inner source
port when it is free (an ordinary port-preserving home NAT); `symmetric=True` uses `fully-random`
ports instead, which behaves like a symmetric NAT. Options: a tbf rate limit on the uplink (and
downlink), and an idle timeout for established TCP flows: the sysctl
net.netfilter.nf_conntrack_tcp_timeout_established set inside the router's namespace. Conntrack
timeouts have been per network namespace since Linux 4.x (checked on 6.18: setting it in one namespace
leaves the host and the other routers at their 432000 s); an nft `ct timeout` object per rule would be
the fallback. Past the timeout the router has forgotten the flow: inbound packets of it are dropped as
unsolicited, while the LAN side's next packet makes a new mapping (conntrack's default loose pickup),
as many home routers do.

    with NetBed() as bed:
        boot = bed.public_host("boot")
        home = bed.home_router("home1", symmetric=False, uplink_mbit=20, idle_timeout_s=None)
        alice = bed.behind(home, "alice")
        proc = alice.popen([...])      # runs inside alice's namespace (ip netns exec)

Every namespace is named `bsw-<pid>-<bed>-<name>`; closing the bed kills what it started and deletes
its namespaces, and `sweep()` deletes those left by a process that died before it could.
"""
from __future__ import annotations

import logging
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "bsw-"
PUBLIC_NET = "198.51.100"  # public hosts: .1 is the internet's side, hosts from .10
WAN_NET = "203.0.113"  # home routers' WAN sides: .1 is the internet's side, routers from .10
TOOLS = ("ip", "nft", "tc", "sysctl")
_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,23}")
_beds = 0  # beds made by this process: part of their namespaces' names, so two beds never collide


class NetBedError(RuntimeError):
    """A command that builds the bed failed (its stderr is in the message)."""


def _run(argv: Sequence[str], stdin: str | None = None) -> str:
    log.debug("%s", " ".join(argv))
    done = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NetBedError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _netns_names() -> list[str]:
    # `ip netns list` prints "name" or "name (id: N)", one a line
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_netns(ns: str) -> None:
    """Kill what still runs in `ns` (ours: nothing else can be inside it), then delete it.

    A namespace lives on while a process is in it, so `ip netns del` alone could leave it behind
    (with its veths and NAT) once only the name is gone."""
    try:
        pids = [int(p) for p in _run(["ip", "netns", "pids", ns]).split()]
    except NetBedError:
        pids = []
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    try:
        _run(["ip", "netns", "del", ns])
    except NetBedError as e:
        log.warning("could not delete namespace %s: %s", ns, e)


def sweep(prefix: str = PREFIX, everything: bool = False) -> list[str]:
    """Delete namespaces named `prefix<pid>-...` whose process is gone (or all of ours: `everything`).

    The cleanup for a crash: a bed that was killed before it could close leaves its namespaces,
    and the next bed (or `python tests/netbed.py --sweep`) takes them away. Returns the names deleted."""
    gone = []
    for ns in _netns_names():
        if not ns.startswith(prefix):
            continue
        pid = ns[len(prefix):].split("-", 1)[0]
        if not everything and (not pid.isdigit() or _pid_alive(int(pid))):
            continue  # another live bed's, or not of our making
        log.info("sweeping leftover namespace %s", ns)
        _delete_netns(ns)
        gone.append(ns)
    return gone


@cache
def netns_unavailable() -> str | None:
    """Why this machine can't build a bed (None when it can): checked once, by making a namespace."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} missing: `make install` apt-installs iproute2, nftables and procps"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", probe])
    except (NetBedError, OSError) as e:
        return f"cannot create a network namespace: {e}"
    try:
        _run(["ip", "netns", "exec", probe, "nft", "add", "table", "ip", "probe"])  # nf_tables usable?
    except (NetBedError, OSError) as e:
        return f"nftables does not work in a network namespace: {e}"
    finally:
        _delete_netns(probe)
    return None


def require_netns() -> None:
    """Skip the calling pytest test, naming the reason, where a bed can't be built."""
    import pytest

    reason = netns_unavailable()
    if reason:
        pytest.skip(f"netbed: {reason}")


@dataclass(eq=False)
class Host:
    """One box in the bed: its namespace and its own address (private for a machine behind a router)."""

    name: str
    ns: str
    addr: str
    bed: NetBed = field(repr=False)
    router: HomeRouter | None = field(default=None, repr=False)  # the home router it sits behind

    @property
    def public_addr(self) -> str:
        """The address the internet sees it from: its router's WAN address when behind one."""
        return self.router.addr if self.router else self.addr

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace (the environment passes through)."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """subprocess.Popen inside the namespace; the bed kills it when it closes."""
        proc = subprocess.Popen(self.argv(argv), **kwargs)
        self.bed._procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """subprocess.run inside the namespace (text output captured unless told otherwise)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 60)
        return subprocess.run(self.argv(argv), **kwargs)


@dataclass(eq=False)
class HomeRouter(Host):
    """A home router: `addr` is its WAN (public) address; it masquerades `lan_net` behind it."""

    lan_addr: str = ""
    lan_net: str = ""  # "10.0.N.0/24"
    symmetric: bool = False
    uplink_mbit: float | None = None
    downlink_mbit: float | None = None
    idle_timeout_s: int | None = None
    machines: list[Host] = field(default_factory=list, repr=False)


def _ruleset(symmetric: bool) -> str:
    """The home router's nftables: masquerade the LAN, let in only what belongs to a LAN-made flow."""
    return f"""
table ip nat {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "wan" masquerade{" fully-random" if symmetric else ""}
    }}
}}
table inet filter {{
    chain forward {{
        type filter hook forward priority filter; policy drop;
        ct state invalid drop
        ct state established,related accept
        iifname "lan" accept  # LAN -> internet (and LAN <-> LAN, should bridged frames come here)
    }}
    chain input {{
        type filter hook input priority filter; policy drop;
        ct state invalid drop
        ct state established,related accept
        iifname {{ "lo", "lan" }} accept
    }}
}}
"""


class NetBed:
    """The bed: an internet, public hosts, home routers and the machines behind them.

    Use it as a context manager; closing it (also after an exception) stops what its hosts started
    and deletes every namespace it made."""

    def __init__(self) -> None:
        global _beds
        _beds += 1
        self.prefix = f"{PREFIX}{os.getpid()}-{_beds}-"
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._internet: Host | None = None
        self._links = 0  # veth ends on the internet side are named by this counter
        self.public_hosts: list[Host] = []
        self.routers: list[HomeRouter] = []

    def __enter__(self) -> NetBed:
        sweep()  # a bed killed before it could close left its namespaces behind
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- building blocks -------------------------------------------------------------------

    def _netns(self, name: str) -> str:
        if not _NAME.fullmatch(name):
            raise ValueError(f"host name {name!r}: lower-case letters, digits and '-', at most 24")
        ns = self.prefix + name
        if ns in self._namespaces:
            raise ValueError(f"the bed already has a host named {name!r}")
        _run(["ip", "netns", "add", ns])
        self._namespaces.append(ns)
        # IPv4 only: no IPv6 link-local paths around the NAT (and no DAD delays); loopback up, since
        # a fresh namespace has it down and local servers bind there
        self._sysctl(ns, "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        return ns

    @staticmethod
    def _sysctl(ns: str, *settings: str) -> None:
        _run(["ip", "netns", "exec", ns, "sysctl", "-qw", *settings])

    @staticmethod
    def _veth(ns: str, end: str, peer_ns: str, peer_end: str) -> None:
        """A veth pair made straight between two of our namespaces (never in the host's)."""
        _run(["ip", "-n", ns, "link", "add", end, "type", "veth", "peer", "name", peer_end, "netns", peer_ns])

    @staticmethod
    def _bridge(ns: str, name: str, addr: str) -> None:
        _run(["ip", "-n", ns, "link", "add", name, "type", "bridge"])
        _run(["ip", "-n", ns, "addr", "add", addr, "dev", name])
        _run(["ip", "-n", ns, "link", "set", name, "up"])
        # br_netfilter (loaded here) would send bridged frames through the IP firewall: keep the
        # switches plain switches
        try:
            NetBed._sysctl(ns, "net.bridge.bridge-nf-call-iptables=0")
        except NetBedError:
            pass  # no br_netfilter: nothing to turn off

    @staticmethod
    def _tbf(ns: str, dev: str, mbit: float) -> None:
        # burst: 10 ms at the rate (tbf needs at least rate/HZ), never below 64 KiB so GSO frames pass
        burst = max(int(mbit * 1e6 / 8 / 100), 64 * 1024)
        _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
              "burst", str(burst), "latency", "50ms"])

    def _attach(self, host_ns: str, host_end: str, bridge: str, net: str, index: int) -> tuple[str, str]:
        """Plug a namespace into an internet segment: returns (its address, the internet-side end)."""
        inet = self.internet().ns
        self._links += 1
        inet_end = f"v{self._links}"
        self._veth(inet, inet_end, host_ns, host_end)
        _run(["ip", "-n", inet, "link", "set", inet_end, "master", bridge, "up"])
        addr = f"{net}.{10 + index}"
        _run(["ip", "-n", host_ns, "addr", "add", f"{addr}/24", "dev", host_end])
        _run(["ip", "-n", host_ns, "link", "set", host_end, "up"])
        _run(["ip", "-n", host_ns, "route", "add", "default", "via", f"{net}.1"])
        return addr, inet_end

    # --- the API -------------------------------------------------------------------------------

    def internet(self) -> Host:
        """The internet: a router between the public segments (made on first use)."""
        if self._internet is None:
            ns = self._netns("internet")
            self._bridge(ns, "pub", f"{PUBLIC_NET}.1/24")
            self._bridge(ns, "wan", f"{WAN_NET}.1/24")
            self._sysctl(ns, "net.ipv4.ip_forward=1")
            self._internet = Host("internet", ns, f"{PUBLIC_NET}.1", self)
            log.info("internet %s", ns)
        return self._internet

    def public_host(self, name: str) -> Host:
        """A host on the internet with a public address of its own (198.51.100.10 onwards)."""
        if len(self.public_hosts) >= 240:
            raise ValueError("at most 240 public hosts")
        self.internet()
        ns = self._netns(name)
        addr, _ = self._attach(ns, "eth0", "pub", PUBLIC_NET, len(self.public_hosts))
        host = Host(name, ns, addr, self)
        self.public_hosts.append(host)
        log.info("public host %s at %s", name, addr)
        return host

    def home_router(self, name: str, symmetric: bool = False, uplink_mbit: float | None = None,
                    idle_timeout_s: int | None = None, downlink_mbit: float | None = None) -> HomeRouter:
        """A home router: WAN address 203.0.113.10 onwards, LAN 10.0.N.0/24 (N = 1, 2, ...).

        symmetric: masquerade to a random port per flow (a symmetric NAT) instead of keeping the port.
        uplink_mbit / downlink_mbit: tbf on the WAN link, leaving / entering the home.
        idle_timeout_s: forget an established TCP flow after this long without a packet; inbound
        packets of a forgotten flow are then dropped like any unsolicited ones."""
        if len(self.routers) >= 240:
            raise ValueError("at most 240 home routers")
        self.internet()
        ns = self._netns(name)
        index = len(self.routers)
        wan, inet_end = self._attach(ns, "wan", "wan", WAN_NET, index)
        lan_net = f"10.0.{index + 1}"
        self._bridge(ns, "lan", f"{lan_net}.1/24")
        self._sysctl(ns, "net.ipv4.ip_forward=1")
        _run(["ip", "netns", "exec", ns, "nft", "-f", "-"], stdin=_ruleset(symmetric))
        if idle_timeout_s is not None:
            # per-netns on this kernel (and exists once the ruleset above loaded conntrack): this router only
            self._sysctl(ns, f"net.netfilter.nf_conntrack_tcp_timeout_established={int(idle_timeout_s)}")
        if uplink_mbit:
            self._tbf(ns, "wan", uplink_mbit)
        if downlink_mbit:
            self._tbf(self.internet().ns, inet_end, downlink_mbit)
        router = HomeRouter(name, ns, wan, self, lan_addr=f"{lan_net}.1", lan_net=f"{lan_net}.0/24",
                            symmetric=symmetric, uplink_mbit=uplink_mbit, downlink_mbit=downlink_mbit,
                            idle_timeout_s=idle_timeout_s)
        self.routers.append(router)
        log.info("home router %s WAN %s LAN %s%s", name, wan, router.lan_net,
                 " (symmetric NAT)" if symmetric else "")
        return router

    def behind(self, router: HomeRouter, name: str) -> Host:
        """A machine on `router`'s LAN (10.0.N.10 onwards), its default route via the router."""
        if len(router.machines) >= 240:
            raise ValueError("at most 240 machines behind one router")
        ns = self._netns(name)
        end = f"l{len(router.machines) + 1}"
        self._veth(router.ns, end, ns, "eth0")
        _run(["ip", "-n", router.ns, "link", "set", end, "master", "lan", "up"])
        addr = router.lan_addr.rsplit(".", 1)[0] + f".{10 + len(router.machines)}"
        _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        _run(["ip", "-n", ns, "route", "add", "default", "via", router.lan_addr])
        host = Host(name, ns, addr, self, router=router)
        router.machines.append(host)
        log.info("%s at %s behind %s", name, addr, router.name)
        return host

    def close(self) -> None:
        """Stop every process the hosts started, then delete every namespace (safe to call twice)."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()  # `ip netns exec` execs the program: this is the program itself
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.warning("pid %d did not stop", proc.pid)
        self._procs.clear()
        for ns in reversed(self._namespaces):
            _delete_netns(ns)
        self._namespaces.clear()
        self._internet = None
        log.info("%s* cleaned up", self.prefix)


# --- Python helpers run inside the namespaces (python -c: no files to ship) ---------------------

# A TCP echo server: prints its port, then "ip port" of each client; "push S\n" makes it send
# "pushed\n" S seconds later (the server speaking first after an idle spell, as a peer would).
ECHO_SERVER = r"""
import socket, sys, threading, time
srv = socket.create_server((sys.argv[1], int(sys.argv[2])), backlog=64)
print(srv.getsockname()[1], flush=True)
def serve(conn, peer):
    print(peer[0], peer[1], flush=True)
    with conn:
        while data := conn.recv(65536):
            if data.startswith(b"push "):
                time.sleep(float(data.split()[1]))
                conn.sendall(b"pushed\n")
            else:
                conn.sendall(data)
while True:
    conn, peer = srv.accept()
    threading.Thread(target=serve, args=(conn, peer), daemon=True).start()
"""

# A TCP client: connects from one local port to each "addr:port" target (all at once, so the same
# inner port goes to several places), says something, and prints "ok PORT" or "error KIND" per target.
# With a send "push S", it waits up to W seconds for the server's push: "ok PORT pushed" or "ok PORT silent".
TCP_PROBE = r"""
import errno, socket, sys
def error(e):
    return "error " + (errno.errorcode.get(e.errno, type(e).__name__) if e.errno else type(e).__name__)
local_port, timeout, send, wait = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3].encode(), float(sys.argv[4])
socks = []
for target in sys.argv[5:]:
    addr, port = target.rsplit(":", 1)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.settimeout(timeout)
    s.bind(("0.0.0.0", local_port))
    try:
        s.connect((addr, int(port)))
        s.sendall(send)
        socks.append((s, "ok"))
    except OSError as e:
        socks.append((s, error(e)))
for s, state in socks:
    if state == "ok":
        try:
            if send.startswith(b"push "):
                s.settimeout(wait)
                try:
                    state += " %d %s" % (s.getsockname()[1], "pushed" if s.recv(100) else "closed")
                except TimeoutError:
                    state += " %d silent" % s.getsockname()[1]
            else:
                state += " %d" % s.getsockname()[1] if s.recv(100) == send else " %d garbled" % s.getsockname()[1]
        except OSError as e:
            state = error(e)
    print(state, flush=True)
"""


def python_argv(code: str, *args: object) -> list[str]:
    """This Python running `code` (-I: no user site, no PYTHONPATH: the snippets need only the stdlib)."""
    return [sys.executable, "-I", "-c", code, *map(str, args)]


class EchoServer:
    """ECHO_SERVER running on `host`: `port`, and `peer()` for the (ip, port) each client came from."""

    def __init__(self, host: Host, port: int = 0, bind: str = "0.0.0.0") -> None:
        self.host = host
        self.proc = host.popen(python_argv(ECHO_SERVER, bind, port), stdout=subprocess.PIPE, text=True)
        self._lines: queue.Queue[str] = queue.Queue()
        # a reader thread, so peer() can wait with a timeout on a pipe
        threading.Thread(target=self._read, daemon=True, name=f"echo-{host.name}").start()
        first = self._next(10.0, "its port")
        self.port = int(first)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())

    def _next(self, timeout: float, what: str) -> str:
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"echo server on {self.host.name}: no {what} within {timeout} s") from None

    def peer(self, timeout: float = 5.0) -> tuple[str, int]:
        """The (ip, port) the next client connected from, as this server saw it."""
        ip, port = self._next(timeout, "client").split()
        return ip, int(port)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=5)

    def __enter__(self) -> EchoServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class Probe:
    """What TCP_PROBE saw for one target: ok, its local port, and (for a push) whether it came."""

    ok: bool
    local_port: int | None = None
    note: str = ""  # "pushed"/"silent" after a push; the exception's name when not ok


def tcp_probe(host: Host, targets: Sequence[tuple[str, int]], local_port: int = 0, timeout: float = 2.0,
              send: str = "hello", wait: float = 0.0) -> list[Probe]:
    """Connect from `host` to each (addr, port) target, from one local port; one Probe per target."""
    argv = python_argv(TCP_PROBE, local_port, timeout, send, wait, *(f"{a}:{p}" for a, p in targets))
    done = host.run(argv, timeout=timeout * len(targets) + wait + 30)
    if done.returncode != 0:
        raise NetBedError(f"tcp probe on {host.name} failed: {done.stderr.strip()}")
    probes = []
    for line in done.stdout.splitlines():
        word, *rest = line.split()
        if word == "ok":
            probes.append(Probe(True, int(rest[0]), " ".join(rest[1:])))
        else:
            probes.append(Probe(False, None, " ".join(rest)))
    return probes


if __name__ == "__main__":
    # `python tests/netbed.py --sweep`: delete the namespaces of beds whose process died
    logging.basicConfig(level=logging.INFO)
    if sys.argv[1:] == ["--sweep"]:
        print("\n".join(sweep()) or "nothing to sweep")
    else:
        print(__doc__)
