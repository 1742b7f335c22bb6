"""A stage's batch window: waits decided from what its passes cost (pure, a clock of the test's own)."""
from __future__ import annotations

import pytest

from beeswarm.contributor.batching import MOST_S, PROBE_EVERY, Batching


def busy_stage(fixed: float, per_token: float, sessions: int = 8, window: bool = True, cycle: float = 0.1,
               now: float = 1.0) -> Batching:
    """A stage that ran back-to-back passes of 1 to 8 one-token steps, with `sessions` sessions each stepping
    through it every `cycle` s, the last of each at `now`."""
    b, t = Batching(window=window), 0.0
    for n in [1, 2, 4, 8] * 5:
        seconds = fixed + n * per_token
        b.ran(n, n, t, t + seconds)
        t += seconds + 0.0001
    for s in range(sessions):
        b.arrived(f"s{s}", now - cycle)
        b.arrived(f"s{s}", now)
    return b


IN_HAND = {"s0", "s1"}


def test_the_fixed_cost_of_a_pass_is_learnt_from_passes_of_different_sizes():
    b = busy_stage(fixed=0.020, per_token=0.001)
    assert b.fixed_s == pytest.approx(0.020, rel=0.05)
    assert b.busy > 0.8 and b.passes == 20 and b.steps == 75


def test_a_compute_bound_stage_waits_for_the_sessions_due_and_never_longer_than_most_s():
    """Sessions stepping every 100 ms, last seen 95 ms ago: due in 5 ms, within half the 20 ms fixed cost of a
    pass. The wait ends once they are in hand, or 10 ms from now at most."""
    b = busy_stage(fixed=0.020, per_token=0.001, now=1.0)
    wait = b.wait_for(IN_HAND, now=1.095)
    assert wait is not None and wait.sessions == {f"s{i}" for i in range(2, 8)}
    assert wait.until == pytest.approx(1.1025)  # their due time (1.1) and a quarter of the window
    assert b.wait_for({f"s{i}" for i in range(8)}, now=1.095) is None  # every session is in hand
    slow = busy_stage(fixed=0.500, per_token=0.001, cycle=1.0, now=1.0)
    assert slow.wait_for(IN_HAND, now=1.96).until == pytest.approx(1.96 + MOST_S)  # MOST_S at most


def test_a_session_due_long_after_the_window_is_not_waited_for():
    """Another wave of users, in another stage of the pipeline now: due in 60 ms, the window is 10 ms. Merging the
    waves would leave the other stage idle."""
    b = busy_stage(fixed=0.020, per_token=0.001, now=1.0)
    assert b.wait_for(IN_HAND, now=1.04) is None


def test_an_idle_stage_or_a_lone_session_never_waits():
    b = Batching()
    b.ran(1, 1, 0.0, 0.02)
    b.ran(1, 1, 1.0, 1.02)  # 2% busy
    for t in (0.9, 1.0):
        b.arrived("a", t)
        b.arrived("b", t)
    assert b.wait_for({"a"}, now=1.1) is None
    lone = busy_stage(fixed=0.020, per_token=0.001, sessions=1)
    assert lone.wait_for({"s0"}, now=1.095) is None
    assert busy_stage(fixed=0.020, per_token=0.001, window=False).wait_for(IN_HAND, now=1.095) is None


def test_sessions_that_stopped_stepping_are_not_waited_for():
    b = busy_stage(fixed=0.020, per_token=0.001)
    assert b.wait_for(IN_HAND, now=1.095) is not None
    assert b.wait_for(IN_HAND, now=1.2) is None  # overdue by more than the window: ended, or stalled


def test_waits_that_bring_nobody_stop_but_one_in_probe_every_still_looks():
    b = busy_stage(fixed=0.020, per_token=0.001)
    for _ in range(20):
        b.waited(0)
    waits = [b.wait_for(IN_HAND, now=1.095) is not None for _ in range(2 * PROBE_EVERY)]
    assert sum(waits) == 2  # a probe in each PROBE_EVERY
    for _ in range(5):
        b.waited(3)  # the probes bring steps again: waiting resumes
    assert b.wait_for(IN_HAND, now=1.095) is not None


def test_a_decode_step_is_not_padded_to_a_long_prompt_unless_a_pass_of_its_own_would_cost_more():
    """A pass pads every step to its longest: 8 one-token steps beside a 500-token prompt would compute 4,500
    tokens. Where a token costs much against a pass (a CPU), they run apart; where the pass's fixed cost dominates
    (a GPU's decode), short prompts ride along."""
    cpu = busy_stage(fixed=0.002, per_token=0.001)
    lengths = [1, 500, 1, 1, 1, 1, 1, 1, 1]
    assert cpu.passes_for(lengths) == [[1], [0, 2, 3, 4, 5, 6, 7, 8]]
    gpu = busy_stage(fixed=0.020, per_token=0.00001)
    assert gpu.passes_for([1, 16, 1, 1]) == [[1, 0, 2, 3]]  # 15 tokens of padding cost 0.15 ms, a pass 20 ms
    assert gpu.passes_for([1, 4000, 1]) == [[1], [0, 2]]  # 40 ms of padding: more than a pass
    assert Batching().passes_for([1, 16, 8, 12]) == [[1, 3, 2], [0]]  # no figures yet: padding up to its own size
