"""Probation (pure): how the chance of a whole-session audit falls as a stage passes audits, and the
coordinator's ledger of passes, which no single entry can fill and a new key starts from nothing in."""
from __future__ import annotations

from beeswarm.audit import DEFAULT_RATE
from beeswarm.audit.probation import (
    MAX_STAGES,
    PER_ENTRY,
    PROBATION_PASSES,
    PUBLISHED_UP_TO,
    Ledger,
    session_audit_chance,
)


def test_a_newcomer_is_audited_whole_until_it_has_passed_and_then_less_down_to_the_per_step_rate():
    chances = [session_audit_chance(n, DEFAULT_RATE) for n in range(20)]
    assert chances[:PROBATION_PASSES] == [1.0] * PROBATION_PASSES
    assert chances[PROBATION_PASSES] == 0.5 and chances[PROBATION_PASSES + 1] == 0.25
    assert all(a > b or a == b == 0.0 for a, b in zip(chances, chances[1:]) if a < 1.0)
    assert chances[-1] == 0.0  # below the per-step rate: that rate alone applies


def test_the_ledger_counts_each_session_once_and_no_entry_vouches_a_stage_out_of_probation_alone():
    ledger = Ledger()
    assert ledger.credit("S", "E1", "s1") and not ledger.credit("S", "E1", "s1")  # the same session: once
    assert not ledger.credit("S", "E2", "s1")  # nor through another entry
    for i in range(10):
        ledger.credit("S", "E1", f"more{i}")
    assert ledger.passed["S"] == PER_ENTRY < PROBATION_PASSES
    ledger.credit("S", "E2", "s2")
    assert ledger.passed["S"] == PER_ENTRY + 1
    ledger.forget("S")  # caught: it starts from nothing
    assert "S" not in ledger.passed and ledger.credit("S", "E1", "s3")


def test_the_ledger_travels_capped_in_plans_merges_into_a_successors_and_stays_bounded():
    ledger = Ledger()
    for entry in range(40):
        for k in range(PER_ENTRY):
            ledger.credit("old", f"E{entry}", f"s{entry}.{k}")
    ledger.credit("new", "E0", "x")
    assert ledger.published(["new", "old", "unknown"], most=8) == {"new": 1, "old": PUBLISHED_UP_TO}
    assert ledger.published(["new", "old"], most=1) == {"new": 1}  # the stages named first go first
    successor = Ledger()
    successor.credit("new", "E9", "y")
    successor.merge({"new": 1, "old": PUBLISHED_UP_TO})
    assert successor.passed == {"new": 1, "old": PUBLISHED_UP_TO}
    big = Ledger()
    for i in range(MAX_STAGES + 10):
        big.credit(f"stage{i}", "E", f"s{i}")
    assert len(big.passed) <= MAX_STAGES
