"""Speculative generation: draft a tree locally, verify it through the target in one pass per round."""
from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from beeswarm.decoding.generate import Generation
from beeswarm.decoding.sampling import SamplingParams, Seen, penalize, sample
from beeswarm.spec.draft import DraftModel
from beeswarm.spec.tree import ROOT
from beeswarm.spec.tuner import MAX_TREE_NODES, CostMeter, TreeShape, Tuner
from beeswarm.spec.verify import verify

# (token ids, start, tree mask or None, keep (start, indices) or None) -> logits for those ids
TargetForward = Callable[[torch.Tensor, int, torch.Tensor | None, tuple[int, list[int]] | None], torch.Tensor]


@dataclass
class SpecReport:
    rounds: int = 0
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted in each round
    tried: list[int] = field(default_factory=list)  # candidates verification tried in each round
    shapes: collections.Counter = field(default_factory=collections.Counter)
    acceptance_by_depth: list[float] = field(default_factory=list)

    def as_json(self) -> dict:
        widths = self.shapes.most_common(1)[0][0] if self.shapes else ()
        return {"rounds": self.rounds,
                "accepted_per_round": round(sum(self.accepted) / max(1, self.rounds), 3),
                "acceptance_by_depth": self.acceptance_by_depth,
                "spec": {"depth": len(widths), "widths": list(widths)}}


def speculative_generate(forward: TargetForward, draft: DraftModel, prompt_ids: list[int], max_new_tokens: int,
                         params: SamplingParams, tuner: Tuner | None = None, stop_ids: Iterable[int] = (),
                         on_token: Callable[[int], None] | None = None, generator: torch.Generator | None = None,
                         report: SpecReport | None = None, max_length: int | None = None) -> Generation:
    """Like `generate`, in rounds: each commits the accepted draft path plus one token of the target's.

    `max_length`: the target session's capacity; trees shrink to fit what is left of it.
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    tuner = tuner or Tuner()
    report = report if report is not None else SpecReport()
    meter = CostMeter(tuner.costs)
    stop = set(stop_ids)
    tokens: list[int] = []
    t0 = time.perf_counter()

    def commit(new: list[int]) -> bool:
        """Emit tokens until the budget or a stop id; False when generation is over."""
        for token in new:
            tokens.append(token)
            if on_token:
                on_token(token)
            if token in stop or len(tokens) >= max_new_tokens:
                return False
        return True

    logits = forward(torch.tensor(prompt_ids), 0, None, None)
    going = commit([sample(logits[-1], params, generator, prompt_ids)]) if max_new_tokens > 0 else False
    ttft = time.perf_counter() - t0
    draft.reset(len(prompt_ids) + max_new_tokens + MAX_TREE_NODES + 2)
    committed, length, pending, keep = list(prompt_ids) + tokens, len(prompt_ids), tokens[-1:], None
    while going:
        shape = tuner.choose()
        if max_length is not None:
            room = max_length - length - len(pending)
            shape = TreeShape(shape.widths, max(0, min(shape.max_nodes, room)), shape.min_path_prob)
        t_draft = time.perf_counter()
        tree = draft.propose(committed, shape, params, generator)
        t_pass = time.perf_counter()
        ids = torch.tensor(pending + tree.tokens)
        logits = forward(ids, length, tree.step_mask(len(pending)), keep)
        p = len(pending)
        seen = Seen(committed) if params.repetition_penalty != 1.0 else None

        def target_logits(node: int) -> torch.Tensor:
            """The target's logits after `node`, penalised by that node's own sequence (committed + its path)."""
            row = logits[p - 1 if node == ROOT else p + node]
            if seen is None:
                return row
            return penalize(row, seen.plus(tree.path_tokens(node)), params.repetition_penalty)

        verdict = verify(tree, target_logits, params, generator)
        for depth, candidate, ok in verdict.trials:
            tuner.stats.record(depth, candidate, ok)
        report.rounds += 1
        report.accepted.append(len(verdict.path))
        report.tried.append(len(verdict.trials))
        report.shapes[shape.widths] += 1
        keep = (length, list(range(p)) + [p + n for n in verdict.path])
        length += p + len(verdict.path)
        new = verdict.tokens(tree)
        pending = new[-1:]
        committed += new
        going = commit(new)
        # the round's time past the draft: the pass around the ring, verification and emitting
        meter.observe(t_pass - t_draft, shape.depth, len(ids), time.perf_counter() - t_pass)
    report.acceptance_by_depth = tuner.stats.by_depth()
    draft.close()
    return Generation(tokens, len(prompt_ids), ttft, time.perf_counter() - t0)
