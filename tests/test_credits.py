"""Credits: receipts signed by real Ed25519 identities, the coordinator's ledger of them, and what an entry's
receipts count and a full stage admits first, on real nodes."""
from __future__ import annotations

import threading
import time

import msgspec
import pytest

from beeswarm.client.dataplane import Inbox, RemotePipeline, SessionSteps, StageBusy, StageFailed
from beeswarm.contributor import admission
from beeswarm.contributor.sessions import Sessions
from beeswarm.contributor.stage import StageServer
from beeswarm.credits.entry_receipts import ReceiptBook
from beeswarm.credits.ledger import FREE_ALLOWANCE, MAX_AGE_S, MEMORY, CreditLedger, rank
from beeswarm.credits.receipts import receipt_verifies, sign_ledger, sign_receipt, verify_ledger
from beeswarm.generation.generate import generate
from beeswarm.generation.sampling import SamplingParams
from beeswarm.p2p import identity
from beeswarm.protocol import CONTROL_LIMIT, ProtocolError, encode
from beeswarm.protocol.coordinator import Stage
from beeswarm.protocol.credits import MAX_BALANCES, MAX_RECENT, Receipt, swarm_id
from beeswarm.shard import EntryModel, Span, SpanRuntime
from beeswarm.spec.draft import DraftModel
from beeswarm.spec.speculate import speculative_generate
from beeswarm.spec.tuner import MAX_TREE_NODES, Tuner
from helpers import reference_greedy, wait_for
from tiny_checkpoints import write_tiny_checkpoint

SWARM = swarm_id("beeswarm", "tinycode")
NOW = 1_800_000_000.0


@pytest.fixture(scope="module")
def peers():
    return [identity.ephemeral() for _ in range(4)]


def receipt(entry, stage, session="s1", prefill=100, decode=40, issued=NOW, swarm=SWARM) -> Receipt:
    """`entry`'s receipt, paid by itself."""
    return sign_receipt(entry.key_pair, Receipt(swarm, entry.peer_id, entry.peer_id, stage.peer_id, session, prefill,
                                                decode, issued))


def record(ledger: CreditLedger, r: Receipt, now: float = NOW, capacity: float | None = 1e9) -> str | None:
    return ledger.record(r, receipt_verifies(r), now, capacity)


def test_a_receipt_moves_its_units_from_the_entry_to_the_stage_once(peers):
    entry, stage = peers[0], peers[1]
    ledger = CreditLedger(SWARM)
    r = receipt(entry, stage)
    assert record(ledger, r) is None
    assert ledger.balance(stage.peer_id) == 140 and ledger.balance(entry.peer_id) == -140
    assert ledger.can_spend(entry.peer_id) == FREE_ALLOWANCE - 140
    assert record(ledger, r) == "already counted (a replay)"
    assert ledger.balance(stage.peer_id) == 140 and ledger.seq == 1


def test_forged_foreign_stale_and_self_paid_receipts_are_refused_saying_why(peers):
    entry, stage, thief = peers[0], peers[1], peers[2]
    ledger = CreditLedger(SWARM)
    honest = receipt(entry, stage)
    inflated = msgspec.structs.replace(honest, decode=10**9)  # the stage rewrites the units it was given
    stolen = msgspec.structs.replace(honest, stage=thief.peer_id)  # another peer claims the stage's receipt
    signed_by_thief = sign_receipt(thief.key_pair, msgspec.structs.replace(honest, sig=b""))  # not the entry's key
    assert record(ledger, inflated).startswith("forged")
    assert record(ledger, stolen).startswith("forged")
    assert record(ledger, signed_by_thief).startswith("forged")
    assert record(ledger, receipt(entry, stage, swarm=swarm_id("beeswarm", "other-model"))).startswith(
        "a receipt for another swarm")
    assert record(ledger, receipt(entry, stage, issued=NOW - MAX_AGE_S - 1)).startswith("too old")
    assert record(ledger, receipt(entry, stage, issued=NOW + 3600)) == "issued in the future"
    assert record(ledger, receipt(entry, entry)) == "an identity cannot pay itself"
    assert record(ledger, receipt(entry, stage, issued=float("nan"))).startswith("too old")
    assert record(ledger, receipt(entry, stage), capacity=None).startswith("the stage's capacity is unknown")
    assert ledger.accounts == {} and ledger.seq == 0


def test_a_stage_caught_lying_forfeits_its_balance_and_later_receipts(peers):
    entry, liar = peers[0], peers[1]
    ledger = CreditLedger(SWARM)
    assert record(ledger, receipt(entry, liar, "a")) is None
    assert ledger.forfeit(liar.peer_id) and not ledger.forfeit(liar.peer_id)
    assert ledger.balance(liar.peer_id) == 0
    assert record(ledger, receipt(entry, liar, "b")).startswith("the stage was caught lying")
    assert ledger.balance(entry.peer_id) == -140  # what the entry spent stays spent


def test_self_dealing_earns_nothing_net_and_fresh_payers_no_more_than_the_stages_capacity(peers):
    """An owner's own entry paying its own stage moves credit between its two accounts; fresh payer keys
    (each with a free allowance) paying its stage for work never done earn it no more than its hardware
    could have served meanwhile, whatever real work shares that capacity."""
    owner_entry, owner_stage, customer = peers[2], peers[3], peers[0]
    ledger = CreditLedger(SWARM)
    capacity = 100.0  # layer-tokens per second: 60,000 per 10-minute window
    assert record(ledger, receipt(owner_entry, owner_stage, "own", 30_000, 0), capacity=capacity) is None
    assert ledger.balance(owner_stage.peer_id) + ledger.balance(owner_entry.peer_id) == 0  # nothing made
    assert record(ledger, receipt(customer, owner_stage, "real", 20_000, 0), capacity=capacity) is None
    sybils = [identity.ephemeral() for _ in range(5)]
    refused = [record(ledger, receipt(s, owner_stage, "fake", 5_000, 0), capacity=capacity) for s in sybils]
    assert refused[:2] == [None, None]  # up to the capacity: indistinguishable from work it could have done
    assert all(why.startswith("more work than the stage can have served") for why in refused[2:])
    assert ledger.accounts[owner_stage.peer_id].earned == 60_000  # = capacity x window, real and fake together
    later = NOW + 700  # the window has passed: the stage can have served that much since
    assert record(ledger, receipt(sybils[4], owner_stage, "next", 5_000, 0, issued=later), later, capacity) is None


def test_the_ledger_forgets_old_receipts_but_refuses_their_replays(peers):
    entry, stage = peers[0], peers[1]
    ledger = CreditLedger(SWARM)
    first = receipt(entry, stage, "first", 1, 0, issued=NOW - 100)
    assert record(ledger, first) is None
    for i in range(MEMORY):  # from many stages: one stage is credited for so many sessions in a window only
        ledger.record(msgspec.structs.replace(first, stage=f"stage{i % 8}", session=f"s{i}", issued=NOW - 50), True,
                      NOW, 1e9)
    assert first.key not in ledger.recent and ledger.horizon == NOW - 100
    assert record(ledger, first).startswith("too old")
    # the earliest issued are forgotten first: receipts dated late, recorded early, never push the horizon past
    # receipts still on their way (forgetting in arrival order would have set it to NOW + 20)
    flooded = CreditLedger(SWARM)
    for i in range(MEMORY // 2):
        flooded.record(msgspec.structs.replace(first, stage=f"late{i % 8}", session=f"late{i}", issued=NOW + 20),
                       True, NOW, 1e9)
    for i in range(MEMORY):
        flooded.record(msgspec.structs.replace(first, stage=f"stage{i % 8}", session=f"s{i}", issued=NOW - 50), True,
                       NOW, 1e9)
    assert flooded.horizon == NOW - 50
    assert record(flooded, receipt(entry, stage, "on its way", issued=NOW - 10)) is None


def test_the_largest_ledger_is_one_gossip_message_and_its_successor_refuses_what_it_left_out(peers):
    """Every account full and MEMORY receipts remembered: what is published (the newest MAX_RECENT, and a horizon
    past the rest) fits one gossip message, so a busy swarm's coordinator can still publish it (a chaos hour
    grew one past 64 KiB before, and its successors could no longer continue it)."""
    coordinator = peers[0]
    big = 1 << 49
    accounts = [(identity.ephemeral(), identity.ephemeral()) for _ in range(MAX_BALANCES // 2)]
    ledger = CreditLedger(SWARM)
    receipts = [receipt(*accounts[i % len(accounts)], session=f"s{i}", prefill=big, decode=0, issued=NOW - MEMORY + i)
                for i in range(MEMORY)]
    for r in receipts:
        assert record(ledger, r, capacity=1e18) is None
    state = ledger.state(coordinator.peer_id, NOW)
    assert len(state.balances) == MAX_BALANCES and len(state.recent) == MAX_RECENT and len(ledger.recent) == MEMORY
    signed = sign_ledger(coordinator.key_pair, state)
    assert len(encode(signed)) <= CONTROL_LIMIT and verify_ledger(signed) == state

    new = CreditLedger(SWARM)
    assert new.continue_from(state, NOW)
    assert record(new, receipts[-1], capacity=1e18) == "already counted (a replay)"
    assert record(new, receipts[-MAX_RECENT - 1], capacity=1e18).startswith("too old")  # left out: past the horizon
    assert record(new, receipt(*accounts[0], session="next", issued=NOW + 1), capacity=1e18) is None


def test_a_signed_ledger_verifies_and_a_successor_continues_it_without_losing_or_doubling(peers):
    coordinator, successor, entry, stage = peers
    old = CreditLedger(SWARM)
    counted = receipt(entry, stage, "x")
    assert record(old, counted) is None
    signed = sign_ledger(coordinator.key_pair, old.state(coordinator.peer_id, NOW))
    state = verify_ledger(signed)
    assert {b.node: b.balance for b in state.balances} == {entry.peer_id: -140, stage.peer_id: 140}
    assert {b.node: (b.hour, b.day) for b in state.balances} == {entry.peer_id: ((0, 140), (0, 140)),
                                                                 stage.peer_id: ((140, 0), (140, 0))}
    assert rank(state, stage.peer_id) == 1 and rank(state, entry.peer_id) == 2

    new = CreditLedger(SWARM)
    assert new.continue_from(state, NOW) and not new.continue_from(state, NOW)  # not newer: nothing taken twice
    assert record(new, counted) == "already counted (a replay)"  # handed in again after the coordinator died
    assert record(new, receipt(entry, stage, "y")) is None
    assert new.balance(stage.peer_id) == 280 and new.seq == 2
    later = new.state(successor.peer_id, NOW + 2 * 3600)  # an hour's figures age out of it, the day's stay
    assert {b.node: (b.hour, b.day) for b in later.balances}[stage.peer_id] == ((0, 0), (280, 0))

    tampered = msgspec.structs.replace(signed, body=signed.body[:-1] + bytes([signed.body[-1] ^ 1]))
    with pytest.raises(ProtocolError):
        verify_ledger(tampered)
    assert not CreditLedger(swarm_id("beeswarm", "other")).continue_from(state, NOW)


# --- receipts and admission on real nodes (in process) ---------------------------------------------------------


def test_an_entrys_receipts_count_each_stages_layers_times_positions_prefill_and_decode_apart(mesh, tiny_llama):
    stages = mesh(2, members=False)
    splits = [(0, 3), (3, 8)]
    servers = [StageServer(node, SpanRuntime(tiny_llama, Span(a, b), dtype="float32", device="cpu")).start()
               for node, (a, b) in zip(stages, splits)]
    (entry_node,) = mesh(1, members=False, bootstrap=[])
    for node in stages:
        entry_node.connect(node.addrs[0])
    stages[0].connect(stages[1].addrs[0])
    book = ReceiptBook(entry_node, SWARM)
    route = tuple(Stage(node=node.peer_id, span=Span(a, b)) for node, (a, b) in zip(stages, splits))
    pipe = RemotePipeline(entry_node, Inbox(entry_node).start(), EntryModel(tiny_llama, dtype="float32", device="cpu"),
                          route, receipts=book)
    prompt, new = [1, 5, 9, 2, 7], 6
    session = pipe.open(64)
    book.begin(session, len(prompt))
    generate(lambda t, s: pipe.forward(session, t, s, micro_batches=2), prompt, new, SamplingParams(0.0, 1.0))
    pipe.close_session(session)
    receipts = {r.stage: r for r in book.settle([session], caught=set())}
    # the prompt once, then one position per new token but the last (it is never fed back)
    assert {stage: (r.prefill, r.decode) for stage, r in receipts.items()} == {
        stages[0].peer_id: (3 * 5, 3 * (new - 1)), stages[1].peer_id: (5 * 5, 5 * (new - 1))}
    assert all(receipt_verifies(r) and r.entry == r.payer == entry_node.peer_id for r in receipts.values())
    assert book.settle([session], caught=set()) == []  # receipted once
    for server in servers:
        server.stop()


def test_a_full_stage_admits_a_credited_payers_session_before_an_uncredited_ones(mesh, tiny_llama, peers):
    rich = peers[0]
    (stage_node,) = mesh(1, members=False)
    runtime = SpanRuntime(tiny_llama, Span(0, 8), dtype="float32", device="cpu")
    balances = {rich.peer_id: 50_000}
    StageServer(stage_node, runtime, Sessions(runtime.kv_bytes(50), credit=balances.get)).start()
    entry = EntryModel(tiny_llama, dtype="float32", device="cpu")
    route = (Stage(node=stage_node.peer_id, span=Span(0, 8)),)
    pipes = {}
    for name, payer in (("occupant", None), ("newcomer", None), ("credited", rich.key_pair)):
        (node,) = mesh(1, members=False, bootstrap=[])
        node.connect(stage_node.addrs[0])
        pipes[name] = RemotePipeline(node, Inbox(node).start(), entry, route, receipts=ReceiptBook(node, SWARM, payer))
    held = pipes["occupant"].open(50)
    for name in ("newcomer", "credited"):  # both find the stage full and back off
        with pytest.raises(StageBusy, match="no memory"):
            pipes[name].open(50)
    pipes["occupant"].close_session(held)
    with pytest.raises(StageBusy, match="room is kept for 1 entry that asked first or hold more credit"):
        pipes["newcomer"].open(50)  # asks first once room frees, but the credited payer is still waiting
    pipes["credited"].open(50)

    # a session claiming a payer that did not sign for it is refused, not admitted on the payer's credit
    forger = pipes["newcomer"]
    forger.receipts.vouch = lambda session: (rich.peer_id, b"\0" * 64)
    with pytest.raises(StageFailed, match="payer did not sign"):
        forger.open(10)


def test_a_full_stage_admits_a_speculative_session_with_smaller_trees_rather_than_refuse_it(mesh, tiny_llama,
                                                                                            tmp_path):
    """A speculative session reserves KV for the trees it may keep in flight (4 steps of 65 nodes): on a stage
    with room for one such session and a little more, the next user was refused and backed off every round. It
    is admitted with the room there is (its trees shrink to fit), and its tokens are transformers' greedy ones."""
    prompt, new = [5, 6, 7, 8], 16
    full, least = len(prompt) + new + 4 * (MAX_TREE_NODES + 1), len(prompt) + new + MAX_TREE_NODES + 1
    (stage_node,) = mesh(1, members=False)
    runtime = SpanRuntime(tiny_llama, Span(0, 8), dtype="float32", device="cpu")
    StageServer(stage_node, runtime, Sessions(runtime.kv_bytes(full + least + 10))).start()
    entry = EntryModel(tiny_llama, dtype="float32", device="cpu")
    route = (Stage(node=stage_node.peer_id, span=Span(0, 8)),)
    pipes = []
    for _ in range(3):
        (node,) = mesh(1, members=False, bootstrap=[])
        node.connect(stage_node.addrs[0])
        pipes.append(RemotePipeline(node, Inbox(node).start(), entry, route))
    assert pipes[0].open_within(full, least)[1] == full
    with pytest.raises(StageBusy, match="no memory"):
        pipes[1].open(full)  # as it was
    session, length = pipes[1].open_within(full, least)
    assert length == least + 10
    with pytest.raises(StageBusy, match="no memory"):  # no room left for even the least
        pipes[2].open_within(full, least)
    draft = DraftModel(str(write_tiny_checkpoint(tmp_path / "draft", "llama", num_layers=1, seed=5)),
                       entry.config.vocab_size)
    got = speculative_generate(SessionSteps(pipes[1], session), draft, prompt, new, SamplingParams(),
                               Tuner(in_flight=4), max_length=length, max_in_flight=4)
    assert got.tokens == reference_greedy(tiny_llama, prompt, new)


def test_an_entry_whose_next_stage_is_full_holds_the_stages_before_it_while_it_waits(mesh, tiny_llama):
    """32 users on 3 stages: 24 gave up after 120 s. An entry a full second stage refused let its first stage's
    session go, went to the back of that stage's queue when it asked again, and none was ever at the front of
    both. It holds the first stage now while the second keeps its place, and gets its turn at both."""
    splits = {"first": (0, 3), "other first": (0, 3), "second": (3, 8)}
    nodes = dict(zip(splits, mesh(3, members=False)))
    sessions = {}
    for name, (a, b) in splits.items():
        runtime = SpanRuntime(tiny_llama, Span(a, b), dtype="float32", device="cpu")
        sessions[name] = Sessions(runtime.kv_bytes(50))  # room for one session each
        StageServer(nodes[name], runtime, sessions[name]).start()
    for name in ("first", "other first"):
        nodes[name].connect(nodes["second"].addrs[0])
    entry = EntryModel(tiny_llama, dtype="float32", device="cpu")

    def pipe(first: str) -> RemotePipeline:
        (node,) = mesh(1, members=False, bootstrap=[])
        for stage in nodes.values():
            node.connect(stage.addrs[0])
        route = tuple(Stage(node=nodes[name].peer_id, span=Span(*splits[name])) for name in (first, "second"))
        return RemotePipeline(node, Inbox(node).start(), entry, route)

    occupant, waiter, later = pipe("other first"), pipe("first"), pipe("first")
    held = occupant.open(50)  # the second stage is full
    refusals: list[StageBusy] = []

    def wait(busy: StageBusy) -> None:
        refusals.append(busy)
        if len(refusals) == 2:
            occupant.close_session(held)  # room frees at the second stage while the waiter holds the first
        time.sleep(0.05)

    opened: dict[str, tuple[str, int]] = {}
    thread = threading.Thread(target=lambda: opened.setdefault("session", waiter.open_within(50, 50, wait)))
    thread.start()
    wait_for(lambda: refusals, 10, "the second stage to refuse the waiter")
    with pytest.raises(StageBusy, match="no memory"):  # the first stage's room is the waiter's
        later.open(50)
    thread.join(10)
    assert refusals[0].peer == nodes["second"].peer_id and refusals[0].queued
    session, length = opened["session"]
    assert length == 50
    prompt = [3, 1, 4, 1, 5]
    got = generate(lambda t, s: waiter.forward(session, t, s), prompt, 8, SamplingParams(0.0, 1.0))
    assert got.tokens == reference_greedy(tiny_llama, prompt, 8)

    # waiting ends when `wait` says so: what was held is let go, and the stage's room is the next entry's
    def give_up(busy: StageBusy) -> None:
        raise busy

    with pytest.raises(StageBusy, match="no memory"):
        later.open_within(50, 50, give_up)  # the first stage is the waiter's still: nothing held, nothing waited
    waiter.close_session(session)
    blocker = occupant.open(50)
    with pytest.raises(StageBusy, match="no memory") as refused:
        later.open_within(50, 50, give_up)
    assert refused.value.peer == nodes["second"].peer_id
    assert len(sessions["first"]) == 0  # the first stage's room was let go
    occupant.close_session(blocker)


def test_whom_a_full_stage_keeps_room_for_is_forgotten_once_it_stops_asking():
    now = [0.0]
    waiting = admission.Waiting(clock=lambda: now[0])
    assert [admission.tier(b) for b in (5, None, 0, -FREE_ALLOWANCE, -FREE_ALLOWANCE - 1)] == [2, 1, 1, 1, 0]
    waiting.refused("rich", admission.tier(5))
    assert waiting.ahead("newcomer", admission.tier(None)) == 1 and waiting.ahead("rich", 2) == 0
    now[0] += admission.WAIT_MEMORY_S + 0.1  # it gave up (or was served elsewhere): room is nobody's again
    assert waiting.ahead("newcomer", admission.tier(None)) == 0
    # within a tier, whoever asked first; asking again keeps one's place
    waiting.refused("early", 1)
    now[0] += 1
    waiting.refused("late", 1)
    waiting.refused("early", 1)
    assert (waiting.ahead("early", 1), waiting.ahead("late", 1), waiting.ahead("newcomer", 1)) == (0, 1, 2)
    assert waiting.ahead("rich", 2) == 0 and waiting.ahead("poor", 0) == 2
    for i in range(admission.MAX_WAITING + 10):  # a crowd of newcomers is remembered within bounds
        waiting.refused(f"peer{i}", 1)
    waiting.refused("rich", 2)
    assert len(waiting) == admission.MAX_WAITING and waiting.ahead("rich", 2) == 0  # the latest of the lowest go
