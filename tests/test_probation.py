"""Probation (pure): how the chance of a whole-session audit falls as a stage's layers are checked on more steps,
the closed form behind PROBATION_STEPS, the pieces an audit by layers checks, and the coordinator's ledger of
checks, which no single entry can fill and a new key starts from nothing in."""
from __future__ import annotations

import random
import threading

from beeswarm.audit import DEFAULT_RATE
from beeswarm.audit.book import AuditBook
from beeswarm.audit.pieces import SPOT_LAYERS, cover, detection, spot
from beeswarm.audit.probation import (
    CONFIDENCE,
    LIE_RATE,
    MAX_STAGES,
    PER_ENTRY,
    PROBATION_STEPS,
    PUBLISHED_UP_TO,
    Ledger,
    caught_chance,
    session_audit_chance,
)
from beeswarm.protocol import Span
from beeswarm.protocol.coordinator import Checked, Standing
from beeswarm.protocol.step import Commit


def test_a_newcomer_is_audited_whole_until_its_layers_were_checked_on_enough_steps_then_less():
    chances = [session_audit_chance(n, DEFAULT_RATE) for n in range(0, 4 * PROBATION_STEPS, 10)]
    assert all(c == 1.0 for n, c in zip(range(0, 4 * PROBATION_STEPS, 10), chances) if n < PROBATION_STEPS)
    assert session_audit_chance(PROBATION_STEPS, DEFAULT_RATE) == 0.5
    assert session_audit_chance(PROBATION_STEPS + PROBATION_STEPS // 3, DEFAULT_RATE) == 0.25
    assert all(a > b or a == b == 0.0 for a, b in zip(chances, chances[1:]) if a < 1.0)
    assert chances[-1] == 0.0  # below the per-step rate: that rate alone applies


def test_probation_catches_a_lie_on_one_step_in_twenty_with_99_percent_and_not_one_step_less():
    assert caught_chance(PROBATION_STEPS, LIE_RATE) >= CONFIDENCE > caught_chance(PROBATION_STEPS - 1, LIE_RATE)
    assert PROBATION_STEPS == 90  # three 32-token chats


def test_a_newcomers_tokens_do_not_stand_while_its_audit_outlasts_the_wait_for_it():
    """A generation waits for its audits a while (`settle`'s timeout); when the audit of a stage on probation is
    still running then (its auditor slow, its link being made again), its tokens were released unchecked. They
    are not: it is named with the caught. An established stage's spot check still running holds nothing back."""
    span = Span(0, 4)
    book = AuditBook(1.0, standing=lambda stage: dict.fromkeys(range(4), 10 * PROBATION_STEPS if stage == "old" else 0))
    for step in range(3):
        book.observe("s", [Commit(stage, step, span, b"c", b"i", b"o", b"sig") for stage in ("new", "old")])
    jobs = book.ended("s")
    assert sorted((j.stage, j.whole, j.probation) for j in jobs) == [("new", True, True), ("old", False, False)]
    assert book.settle(["s"], timeout=0.0) == {"new"}  # both audits still running
    finish = threading.Timer(0.2, book.finished, [next(j for j in jobs if j.probation)])
    finish.start()  # the newcomer's audit passes while the generation waits on for it (the other's does not)
    assert book.settle(["s"], timeout=0.0, probation_timeout=30.0) == set()
    finish.join()
    jobs = [j for j in jobs if not j.probation]
    for job in jobs:  # they passed after all (nothing recorded either caught)
        book.finished(job)
    assert book.pending() == 0 and book.settle(["s"], timeout=0.0) == set()


def test_cover_checks_every_layer_by_its_holders_and_spot_checks_where_nobody_holds_them():
    span = Span(0, 8)
    serving = {"A": Span(0, 3), "B": Span(2, 5), "C": Span(10, 12)}
    pieces = cover(span, serving)
    assert [p.layers for p in pieces] == [Span(0, 3), Span(3, 5), Span(5, 6), Span(6, 7), Span(7, 8)]
    assert [set(p.holders) for p in pieces] == [{"A"}, {"B"}, set(), set(), set()]
    assert cover(span, {"A": Span(0, 8)})[0].layers == span  # held whole: one piece
    drawn = spot(span, serving, random.Random(1))
    assert len(drawn) == SPOT_LAYERS and all(len(p.layers) == 1 and span.start <= p.layers.start < span.end
                                             for p in drawn)
    assert all(set(p.holders) == {h for h, s in serving.items() if s.start <= p.layers.start < s.end} for p in drawn)
    assert detection(SPOT_LAYERS, 8) == SPOT_LAYERS / 8 and detection(8, 8) == 1.0


def test_the_ledger_counts_each_session_once_and_no_entry_vouches_a_stage_out_of_probation_alone():
    ledger = Ledger()
    layers = range(0, 4)
    assert ledger.credit("S", "E1", "s1", layers, 32) and not ledger.credit("S", "E1", "s1", layers, 32)
    assert not ledger.credit("S", "E2", "s1", layers, 32)  # nor through another entry
    for i in range(10):
        ledger.credit("S", "E1", f"more{i}", layers, 32)
    assert ledger.least("S", Span(0, 4)) == PER_ENTRY * 32 < PROBATION_STEPS
    ledger.credit("S", "E2", "s2", range(0, 2), 32)  # a piece: only its layers count
    assert ledger.least("S", Span(0, 2)) == 3 * 32 and ledger.least("S", Span(0, 4)) == 2 * 32
    ledger.forget("S")  # caught: it starts from nothing
    assert ledger.least("S", Span(0, 4)) == 0 and ledger.credit("S", "E1", "s3", layers, 1)


def test_the_ledger_travels_capped_in_plans_as_runs_of_layers_merges_into_a_successors_and_stays_bounded():
    ledger = Ledger()
    for entry in range(40):
        for k in range(PER_ENTRY):
            ledger.credit("old", f"E{entry}", f"s{entry}.{k}", range(0, 8), 32)
    ledger.credit("new", "E0", "x", range(0, 4), 16)
    ledger.credit("new", "E1", "y", range(2, 4), 16)
    published = ledger.published(["new", "old", "unknown"], most=8)
    assert published == {"new": [(Span(0, 2), 16), (Span(2, 4), 32)], "old": [(Span(0, 8), PUBLISHED_UP_TO)]}
    assert list(ledger.published(["new", "old"], most=1)) == ["new"]  # the stages named first go first
    standing = Standing("new", tuple(Checked(span, steps) for span, steps in published["new"]))
    assert standing.layers() == {0: 16, 1: 16, 2: 32, 3: 32} and standing.least(Span(0, 4)) == 16
    assert standing.least(Span(0, 6)) == 0  # layers it never served were never checked
    successor = Ledger()
    successor.credit("new", "E9", "z", range(0, 1), 100)
    successor.merge({"new": standing.layers()})
    assert successor.checked["new"] == {0: 100, 1: 16, 2: 32, 3: 32}
    big = Ledger()
    for i in range(MAX_STAGES + 10):
        big.credit(f"stage{i}", "E", f"s{i}", range(1), 1)
    assert len(big.checked) <= MAX_STAGES
