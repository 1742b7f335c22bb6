"""P2P mesh: real py-libp2p nodes on 127.0.0.1, in one process and as separate processes."""
from __future__ import annotations

import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import trio

from beeswarm.p2p import reach, wire
from beeswarm.p2p.channel import Channel, Outbox
from beeswarm.p2p.errors import PeerUnavailable
from beeswarm.p2p.probe import Prober
from beeswarm.protocol import Message, RemoteError, encode
from beeswarm.protocol.membership import Heartbeat
from beeswarm.protocol.rpcs import Rpc
from helpers import INTERVAL, lines_of, read_until, wait_for


class Ping(Message, frozen=True, tag="ping"):
    n: int = 0


class Echo(Message, frozen=True, tag="echo"):
    n: int = 0
    peer: str = ""


ECHO: Rpc[Ping, Echo] = Rpc("/test/echo/1", (Ping,), (Echo,))
SLOW: Rpc[Ping, Echo] = Rpc("/test/slow/1", (Ping,), (Echo,))


def echo(peer: str, msg: Ping) -> Echo:
    if msg.n < 0:
        raise KeyError("a handler bug")
    return Echo(n=msg.n, peer=peer)

@pytest.fixture
def swarm(mesh):
    return mesh


def test_membership_converges_and_a_stopped_node_is_declared_gone(swarm):
    nodes = swarm(4)
    wait_for(lambda: all(len(n.members.view()) == 3 for n in nodes), 10, "membership to converge")
    left = []
    nodes[0].members.listeners.append(lambda event, info: event == "leave" and left.append(info.peer))
    victim = nodes[3]
    victim.stop()
    wait_for(lambda: left, 3 * INTERVAL + 1, "the stopped node to be declared gone")
    assert left == [victim.peer_id]
    assert victim.peer_id not in nodes[0].members.view()
    assert not [t for t in threading.enumerate() if t.name == f"p2p-{victim.peer_id[-6:]}"]


def test_request_channel_and_stop_are_prompt(swarm):
    a, b = swarm(2, members=False)
    a.serve(ECHO, echo)
    b.connect(a.addrs[0])
    reply = b.request(a.peer_id, ECHO, Ping(n=7))
    assert reply == Echo(peer=b.peer_id, n=7)
    with pytest.raises(RemoteError, match="internal error"):  # handler bug (KeyError): an error reply
        b.request(a.peer_id, ECHO, Ping(n=-1))
    a.stop()  # (how long it takes is p2p_bench's figure; here: it ends the node and its connections)
    assert not a.connected_peers()
    wait_for(lambda: a.peer_id not in b.connected_peers(), 10, "the stopped node's connection to close")
    with pytest.raises((PeerUnavailable, TimeoutError)):
        b.request(a.peer_id, ECHO, Ping(n=1), timeout=3)


@pytest.mark.slow  # (8 s: a reader slower than the writer, on purpose)
def test_slow_reader_does_not_get_its_stream_reset(swarm):
    """A channel handler that computes for 8 s before reading still gets every byte."""
    a, b = swarm(2, members=False)
    received = []

    def slow(channel: Channel):
        def work():
            time.sleep(8)  # a handler busy for longer than the sender's patience, on purpose
            received.extend(channel.recv(timeout=10) for _ in range(4))
            channel.send(b"done")
        threading.Thread(target=work, daemon=True).start()

    a.serve_channel("/test/slow/1", slow)
    b.connect(a.addrs[0])
    channel = b.open_channel(a.peer_id, "/test/slow/1")
    chunk = os.urandom(4 * 1024 * 1024)
    for _ in range(4):
        channel.send(chunk, timeout=20)
    assert channel.recv(timeout=20) == b"done"
    assert received == [chunk] * 4


@pytest.mark.slow  # (8 s: outsiders given time to get in)
def test_private_swarm_admits_only_peers_with_the_secret(swarm):
    secret = b"correct horse battery staple"
    insiders = swarm(2, secret=secret)
    for n in insiders:
        n.serve(ECHO, echo)
    wait_for(lambda: all(len(n.members.view()) == 1 for n in insiders), 10, "insiders to see each other")
    assert insiders[1].request(insiders[0].peer_id, ECHO, Ping()).peer == insiders[1].peer_id
    boot = insiders[0].addrs[0]
    (wrong,) = swarm(1, secret=b"wrong secret", bootstrap=[boot])
    (open_node,) = swarm(1, secret=None, bootstrap=[boot])
    time.sleep(3 * INTERVAL)  # long enough for three beats: none of them may reach an outsider
    for outsider in (wrong, open_node):
        assert outsider.members.view() == {}, "an outsider learned the membership"
        assert outsider.peer_id not in insiders[0].members.view()
        assert insiders[0].peer_id not in outsider.connected_peers()
        with pytest.raises((PeerUnavailable, TimeoutError, RemoteError)):
            outsider.request(insiders[0].peer_id, ECHO, Ping(), timeout=3)
    assert len(insiders[0].members.view()) == 1


def test_hostile_input_is_survived_while_a_good_peer_is_served(swarm):
    target, good, evil = swarm(3, members=False)
    target.serve(ECHO, echo)
    Prober(target).start()
    got = []
    target.serve_channel("/test/chan/1", lambda ch: got.append(ch))
    for n in (good, evil):
        n.connect(target.addrs[0])
    rng = random.Random(7)

    async def barrage():
        for i in range(60):
            protocol = rng.choice(["/test/echo/1", "/beeswarm/probe/1", "/test/chan/1", "/beeswarm/auth/1"])
            try:
                stream = await evil.open_stream(target.peer_id, protocol)
                kind = i % 4
                if kind == 0:
                    await stream.write(os.urandom(rng.randint(1, 300)))
                elif kind == 1:  # announces a frame far above every limit
                    await stream.write((2**31).to_bytes(4, "big") + b"x" * 100)
                elif kind == 2:  # well-framed but wrong-typed messages
                    await wire.write_frame(stream, msgspec.msgpack.encode({"t": 5, "v": "x", "n": "seven"}))
                else:
                    await wire.write_frame(stream, msgspec.msgpack.encode({"t": "ping", "v": 1, "n": "not an int"}))
                await stream.close()
            except Exception:  # noqa: BLE001 - the target may drop us: that is the point
                pass

    stop = threading.Event()
    served = []

    def good_client():
        while not stop.is_set():
            served.append(good.request(target.peer_id, ECHO, Ping(n=1), timeout=5).n)

    worker = threading.Thread(target=good_client)
    worker.start()
    try:
        evil.call(barrage)
    finally:
        time.sleep(0.5)  # the good client keeps asking a little after the barrage too
        stop.set()
        worker.join(10)
    assert served and all(n == 1 for n in served)
    assert target.bans.is_banned(evil.peer_id)
    assert not target.bans.is_banned(good.peer_id)
    assert good.request(target.peer_id, ECHO, Ping(n=2)).n == 2
    with pytest.raises(RemoteError, match=r"\$\.n"):  # a bad field in a well-formed request: an error reply naming it
        good.request(target.peer_id, ECHO, Ping(n="x"))  # type: ignore[arg-type]


def test_probe_measures_rtt_and_throughput(swarm):
    a, b = swarm(2, members=False)
    Prober(a).start()
    prober = Prober(b).start()
    b.connect(a.addrs[0])
    parts: list[int] = []
    probe = prober.probe(a.peer_id, bulk_bytes=1 << 20, on_part=parts.append)
    assert parts == [1, 2, 3]  # pings, upload, download: a progress bar's steps
    assert 0 < probe.rtt_ms < float("inf")  # (its size on loopback is p2p_bench's figure)
    assert probe.up_mbps > 10 and probe.down_mbps > 10
    assert prober.probe(a.peer_id) is probe  # cached


def _spawn(env, *args):
    """tests/p2p_node.py in its own process; its stderr goes to stderr.log in its config folder."""
    folder = Path(env["BEESWARM_CONFIG_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "stderr.log", "a") as stderr:
        return subprocess.Popen([sys.executable, str(Path(__file__).with_name("p2p_node.py")), "--interval",
                                 str(INTERVAL), *args], stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)


def _read_until(proc, prefix: str, timeout: float = 20) -> str:
    result = []

    def reader():
        for line in proc.stdout:
            if line.startswith(prefix):
                result.append(line.strip())
                return

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(timeout)
    if not result:
        raise AssertionError(f"no {prefix!r} line within {timeout} s")
    return result[0]


@pytest.mark.slow
def test_separate_processes_join_detect_a_kill_and_keep_identity(tmp_path):
    procs = []
    envs = []
    for i in range(3):
        env = {**os.environ, "BEESWARM_CONFIG_DIR": str(tmp_path / f"node{i}"),
               "PYTHON_KEYRING_BACKEND": "keyring.backends.fail.Keyring"}
        env.pop("BEESWARM_IDENTITY", None)
        envs.append(env)
    try:
        first = _spawn(envs[0])
        procs.append(first)
        first_id = _read_until(first, "peer ").split()[1]
        boot = _read_until(first, "addr ").split()[1]
        for env in envs[1:]:
            procs.append(_spawn(env, "--bootstrap", boot))
        victim_id = _read_until(procs[2], "peer ").split()[1]
        _read_until(first, f"join {victim_id}")
        key_file = tmp_path / "node0" / "identity.secret"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        procs[2].send_signal(signal.SIGKILL)
        # noticed from the dropped connection within about an interval, not after 3 missed heartbeats
        _read_until(first, f"leave {victim_id}", timeout=2 * INTERVAL + 0.5)
        first.send_signal(signal.SIGINT)
        try:
            first.wait(10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"no exit 10 s after SIGINT; its stderr:\n{(tmp_path / 'node0' / 'stderr.log').read_text()}")
        again = _spawn(envs[0])
        procs.append(again)
        assert _read_until(again, "peer ").split()[1] == first_id
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.slow
def test_a_node_stays_open_to_newcomers_after_hundreds_of_peers_vanished(mesh):
    """py-libp2p 0.8.1 held one of 250 inbound slots per connection ever accepted, until the process ended:
    after ~250 peers had come and gone, every newcomer's handshake was reset (p2p/libp2p_hardening.py, guard E).
    Its auto-connector also kept a record of every peer that ever left (p2p/transport.py)."""
    (node,) = mesh(1, members=False, setup=lambda n: setattr(n.config, "forget_every_s", 1.0))
    addr = node.addrs[0]
    script = str(Path(__file__).parent / "vanishing_peers.py")
    for _ in range(9):  # 270 distinct peers, 30 at a time, each group killed with -9 once all are connected
        proc = subprocess.Popen([sys.executable, script, addr, "30"], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        try:
            read_until(lines_of(proc), "connected 30", 60)
        finally:
            proc.kill()
            proc.wait()
    wait_for(lambda: not node.connected_peers(), 30, "the vanished peers' connections to close")
    # nothing of them is kept: their inbound slots are free and the peerstore forgot them
    wait_for(lambda: node.stats().known_peers == 1, 10, "the vanished peers to leave the peerstore")
    assert node.stats().inbound_slots == 0
    assert node.stats().disconnects_remembered == 0  # was one entry per vanished peer
    (newcomer,) = mesh(1, members=False, bootstrap=[])
    assert newcomer.connect(addr, timeout=10) == node.peer_id
    wait_for(lambda: node.stats().connected_peers == 1, 10, "the node to count the newcomer")


def test_a_node_behind_a_relay_is_reachable_through_it(mesh):
    (relay,) = mesh(1, members=False, setup=lambda n: setattr(n.config, "relay_service", True))
    relay_addr = relay.addrs[0]

    def behind_nat(node):
        node.config.listen = []  # accepts no direct connections at all
        node.config.relays = [relay_addr]

    (target,) = mesh(1, bootstrap=[relay_addr], setup=behind_nat)
    target.serve(ECHO, echo)
    assert target.addrs == [f"{relay_addr}/p2p-circuit/p2p/{target.peer_id}"]
    (source,) = mesh(1, bootstrap=[relay_addr])
    assert source.connect(target.addrs[0]) == target.peer_id
    assert source.request(target.peer_id, ECHO, Ping(n=5)).n == 5
    wait_for(lambda: target.peer_id in source.members.view(), 10, "the relayed node in the membership")


def test_hostile_gossip_is_dropped_and_counted(mesh):
    honest, evil = mesh(2)
    wait_for(lambda: evil.peer_id in honest.members.view(), 10, "the evil node to join")
    topic = honest.topic("members")
    mine = msgspec.msgpack.decode(encode(Heartbeat(info=evil.members.info)))["info"]
    forged = {**mine, "peer": "12D3KooWSomebodyElse"}  # impersonation
    for msg in ({"t": "heartbeat", "v": 1, "info": "not a map"}, {"t": "heartbeat", "v": 1, "info": forged},
                {"t": "heartbeat", "v": 1, "info": {**mine, "memory_bytes": "lots"}},
                {"t": "heartbeat"}, {"t": "mystery", "v": 1}):
        evil.call(evil.publish_encoded, topic, msgspec.msgpack.encode(msg))  # any bytes a hostile peer can send
    wait_for(lambda: honest.bans.is_banned(evil.peer_id), 10, "the gossiping peer to be banned")
    assert set(honest.members.view()) <= {evil.peer_id}
    assert "12D3KooWSomebodyElse" not in honest.members.view()


def test_bans_grow_with_each_ban_and_expire():
    from beeswarm.p2p.bans import BASE_S, STRIKES_PER_BAN, BanList

    now = [0.0]
    bans = BanList(clock=lambda: now[0])
    for _ in range(STRIKES_PER_BAN - 1):
        assert not bans.strike("p", "malformed")
    assert not bans.is_banned("p")
    assert bans.strike("p", "malformed") and bans.is_banned("p") and bans.remaining("p") == BASE_S
    now[0] += BASE_S
    assert not bans.is_banned("p")  # served again once the ban ran out
    assert bans.strike("p", "timed out", severe=True)  # one severe strike bans at once, for twice as long
    assert bans.remaining("p") == 2 * BASE_S
    assert not bans.is_banned("q")
    bans.lift("p")  # banned on a word found false: served again, its next ban the shortest again
    assert not bans.is_banned("p")
    assert bans.strike("p", "timed out", severe=True) and bans.remaining("p") == BASE_S


def test_strikes_from_endless_new_identities_keep_the_ban_list_bounded_and_bans_in_force():
    from beeswarm.p2p.bans import MAX_RECORDS, BanList

    now = [0.0]
    bans = BanList(clock=lambda: now[0])
    assert bans.strike("p", "forged commitment", severe=True)
    for i in range(3 * MAX_RECORDS):  # a fresh key per malformed message costs an attacker nothing
        now[0] += 0.0001
        bans.strike(f"sybil{i}", "malformed")
    assert len(bans) <= MAX_RECORDS
    assert bans.is_banned("p")
    last = f"sybil{3 * MAX_RECORDS - 1}"  # the recent records are kept: two more strikes ban it
    assert not bans.strike(last, "malformed") and bans.strike(last, "malformed")


@pytest.mark.slow  # 3 s or more: out of `make test-fast`
def test_a_paused_node_does_not_drop_the_members_that_kept_beating(mesh):
    """SIGSTOP, then SIGCONT: the node's clock jumps; its members' silence timers start again instead of
    every member being dropped at once (and rejoining a beat later, re-planning the swarm twice)."""
    from beeswarm.p2p.membership import Membership, NodeInfo

    offset = [0.0]
    left: list[str] = []

    def paused_clock(node):
        node.members = Membership(node, NodeInfo(peer=node.peer_id), interval=INTERVAL,
                                  clock=lambda: time.monotonic() + offset[0])
        node.members.listeners.append(lambda event, info: left.append(info.peer) if event == "leave" else None)
        node.members.start()

    (a,) = mesh(1)
    (b,) = mesh(1, bootstrap=[a.addrs[0]], members=False, setup=paused_clock)
    wait_for(lambda: a.peer_id in b.members.view(), 10, "b to see a")
    offset[0] += 30.0  # as if b had been stopped for 30 s while a kept beating
    time.sleep(4 * INTERVAL)  # past MISSED_BEATS intervals: a would have been dropped by now
    assert a.peer_id in b.members.view() and not left


def test_a_swarm_split_in_two_joins_again_through_a_member_one_side_heard_of(mesh):
    """Chaos, 4 minutes in: a newcomer whose bootstrap died as it joined started a swarm of its own, newcomers
    joined it, and the two sides never met again (each knew only its own members); the chats' side then died
    out and every chat lost its route. A member heard of once stays in the address book after it leaves the
    view and is dialled again: one such dial joins the two sides."""
    left = mesh(2)
    right = mesh(2, bootstrap=None)
    wait_for(lambda: all(len(n.members.view()) == 1 for n in left + right), 15, "two swarms of two")
    right[1].members.book.saw(left[1].peer_id, tuple(left[1].addrs))  # (heard of it before the split)
    wait_for(lambda: all(len(n.members.view()) == 3 for n in left + right), 20, "one swarm of four")


def test_a_channel_arriving_while_the_node_stops_is_no_error(mesh, caplog):
    """A probe channel that arrived as a chat process exited logged "Nursery is closed to new arrivals" with
    a traceback at ERROR: stopping is quiet."""
    a, b = mesh(2, members=False)
    arrived = threading.Event()

    def slow_handler(channel: Channel) -> None:  # still running when the node's own tasks have ended
        arrived.set()
        time.sleep(1.0)  # busy while the node stops

    a.serve_channel("/test/slow/1", slow_handler)
    b.open_channel(a.peer_id, "/test/slow/1")
    assert arrived.wait(10)
    with caplog.at_level("DEBUG"):
        a.stop()
        time.sleep(1.5)  # the handler returns after the node's loop closed its nursery
    errors = [r for r in caplog.records if r.levelno >= 40]
    assert not errors, [r.getMessage() for r in errors]


def test_a_stopped_node_closes_its_connections(mesh):
    """py-libp2p's shutdown left connections open: peers saw a stopped node as connected until its process
    exited, and a process that starts and stops nodes (a benchmark's newcomers, a test) kept their sockets."""
    (node,) = mesh(1, members=False)
    for _ in range(3):
        (visitor,) = mesh(1, members=False, bootstrap=[])
        visitor.connect(node.addrs[0])
        visitor.stop()
    wait_for(lambda: not node.connected_peers(), 5, "the stopped visitors' connections to close")


def test_a_channel_closed_locally_leaves_no_reader_behind(mesh):
    """py-libp2p never wakes a read pending on a stream reset locally: every probe channel a contributor closed
    kept its reader task for as long as the connection lived (tasks grew by one a probe under the soak)."""
    served: list[Channel] = []
    a, b = mesh(2, members=False, setup=lambda n: n.serve_channel("/test/close/1", served.append))
    a.connect(b.addrs[0])

    counts: list[int] = []

    def steady() -> bool:
        # The connection's own tasks (identify, pubsub's greeting of the new peer) start for a while after the
        # dial: on a loaded machine a count taken at once was 10 short of the settled one, and the test failed
        counts.append(a.stats().tasks)
        time.sleep(0.3)
        return len(counts) >= 3 and len(set(counts[-3:])) == 1

    def open_send_close(n: int) -> None:
        for _ in range(n):
            channel = a.open_channel(b.peer_id, "/test/close/1")
            channel.send(b"x")
            channel.close()

    open_send_close(1)
    wait_for(steady, 20, "the connection's own tasks to settle")
    before = counts[-1]
    open_send_close(30)
    # (a few tasks come and go with the connection's own traffic: 30 readers left behind would not)
    wait_for(lambda: a.stats().tasks < before + 10, 10, "the closed channels' readers to end")


def test_messages_written_at_once_on_one_stream_arrive_whole(mesh):
    """py-libp2p's yamux writes a message in frames of at most 64 KiB (fewer bytes when the peer's window is
    short), taking the stream's lock per frame: two tasks writing to one stream at once (pubsub's publish and
    its forwarding of others' messages do) had their frames interleaved, and the reader parsed garbage: the
    "invalid-signed-record" errors of an honest swarm under churn."""
    served: list[Channel] = []
    a, b = mesh(2, members=False, setup=lambda n: n.serve_channel("/test/whole/1", served.append, limit=1 << 20))
    a.connect(b.addrs[0])
    bodies = [bytes([i]) * 300_000 for i in range(1, 4)]

    async def write_at_once() -> None:
        stream = await a.open_stream(b.peer_id, "/test/whole/1")
        async with trio.open_nursery() as nursery:
            for body in bodies:
                nursery.start_soon(wire.write_frame, stream, body)

    a.call(write_at_once)
    channel = wait_for(lambda: served and served[0], 10, "the channel")
    assert sorted(channel.recv(timeout=10) for _ in bodies) == bodies


def test_a_relay_slot_is_renewed_before_it_lapses_and_taken_again_when_its_connection_drops(mesh):
    (relay,) = mesh(1, members=False, setup=lambda n: setattr(n.config, "relay_service", True))
    relay_addr = relay.addrs[0]
    (node,) = mesh(1, members=False, bootstrap=[], setup=lambda n: setattr(n.config, "relays", [relay_addr]))
    slots = node.relays
    first = wait_for(lambda: slots.held.get(relay.peer_id), 10, "a slot on the relay")
    assert node.addrs[-1] == f"{relay_addr}/p2p-circuit/p2p/{node.peer_id}"
    now = [first.taken + 0.6 * (first.expires - first.taken)]  # past half its lifetime
    slots.clock = lambda: now[0]
    node.call(slots.tend)
    renewed = slots.held[relay.peer_id]
    assert renewed.taken == now[0] and renewed.expires >= first.expires
    node.call(node.disconnect_async, relay.peer_id)  # the connection to the relay drops: the slot with it
    wait_for(lambda: not node.is_connected(relay.peer_id), 10, "the connection to close")

    def taken_again():
        now[0] += reach.RELAY_RETRY_S  # (a relay whose slot failed while the connection dropped waits this long)
        node.call(slots.tend)
        return slots.held.get(relay.peer_id)

    again = wait_for(taken_again, 10, "the slot taken again")
    assert again.taken > renewed.taken and node.is_connected(relay.peer_id)


class PeersThatMayStopReading:
    """A channel pool whose sends to the peers in `frozen` block (the peer stopped reading: its window is full)
    until `thaw` is set (`stuck`: one is blocked); what reaches each peer is recorded in order."""

    def __init__(self, frozen: set[str]):
        self.frozen, self.thaw, self.stuck, self.got = frozen, threading.Event(), threading.Event(), {}

    def send(self, peer: str, protocol: str, body: bytes) -> None:
        if peer in self.frozen:
            self.stuck.set()
            self.thaw.wait(30)
        self.got.setdefault(peer, []).append(body)

    def close(self) -> None:
        self.thaw.set()


def test_an_outbox_never_makes_its_caller_wait_for_a_peer_that_stopped_reading():
    """A stage's compute thread sends through an outbox: a next hop that stops reading holds up only what goes to
    it (in order once it reads again); past the outbox's depth its frames fail at once, never blocking."""
    pool = PeersThatMayStopReading({"frozen"})
    outbox, failed = Outbox(pool, depth=4), []
    outbox.send("frozen", "/p", b"0", failed.append)
    assert pool.stuck.wait(5)  # its sender is stuck on the peer
    t0 = time.monotonic()
    for i in range(1, 6):
        outbox.send("frozen", "/p", b"%d" % i, failed.append)
    assert time.monotonic() - t0 < 1.0 and len(failed) == 1 and "frames already wait" in str(failed[0])
    for i in range(3):  # another peer is served meanwhile
        outbox.send("live", "/p", b"%d" % i, failed.append)
    wait_for(lambda: pool.got.get("live") == [b"0", b"1", b"2"], 5, "the live peer's frames")
    pool.thaw.set()
    wait_for(lambda: pool.got.get("frozen") == [b"0", b"1", b"2", b"3", b"4"], 5, "the thawed peer's frames, in order")
    outbox.close()


def test_slow_handlers_with_threads_of_their_own_never_starve_the_quick_ones(mesh):
    """Audits, reveals and judging take seconds each: more of them at once than trio's 40 shared worker
    threads once left session opens, beats and every quick request waiting behind them."""
    a, b = mesh(2, members=False)
    release = threading.Event()

    def audit(peer: str, msg: Ping) -> Echo:
        release.wait(30)
        return echo(peer, msg)

    a.serve(SLOW, audit, threads=1)
    a.serve(ECHO, echo)
    b.connect(a.addrs[0])
    replies: list = []
    slow = [threading.Thread(target=lambda i=i: replies.append(b.request(a.peer_id, SLOW, Ping(n=i), timeout=60)))
            for i in range(48)]
    try:
        for t in slow:
            t.start()
        time.sleep(1.0)  # the slow requests arrive first (were this too short, the test would pass, never fail)
        assert b.request(a.peer_id, ECHO, Ping(n=7), timeout=5) == Echo(n=7, peer=b.peer_id)
    finally:
        release.set()
        for t in slow:
            t.join(60)
    assert sorted(r.n for r in replies) == list(range(48))  # and every slow one answered in its turn
