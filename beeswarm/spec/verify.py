"""Verification of a draft tree against the target's logits from one pass.

Greedy: follow the children that equal the target's argmax; the target's token after the last
accepted node comes free. Sampling: at each node try the drawn candidates in order, accepting x
with probability min(1, p(x)/q(x)) and otherwise replacing p by the residual norm(max(0, p - q));
when every candidate fails, draw from the residual (SpecInfer's multi-step speculative sampling).
The committed tokens are then distributed exactly as sampling the target token by token.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from beeswarm.generation.sampling import SamplingParams, probabilities
from beeswarm.spec.tree import ROOT, DraftTree

# node (ROOT: the last committed token) -> the target's logits for the token after it
TargetLogits = Callable[[int], torch.Tensor]


@dataclass
class Verdict:
    path: list[int]  # accepted nodes, root's child first
    bonus: int  # the target's own token after the path
    # (depth, candidate index, accepted) for every candidate tried: the tuner's acceptance counts
    trials: list[tuple[int, int, bool]] = field(default_factory=list)

    def tokens(self, tree: DraftTree) -> list[int]:
        return [tree.tokens[n] for n in self.path] + [self.bonus]


def verify(tree: DraftTree, target_logits: TargetLogits, params: SamplingParams,
           generator: torch.Generator | None = None) -> Verdict:
    """Walk the tree from the root, judging each reached node with the target's logits after it."""
    verdict, node, depth = Verdict([], 0), ROOT, 1
    while True:
        child, token = judge(tree, node, target_logits(node), params, generator, depth, verdict.trials)
        if child is None:
            verdict.bonus = token
            return verdict
        verdict.path.append(child)
        node, depth = child, depth + 1


def judge(tree: DraftTree, node: int, logits: torch.Tensor, params: SamplingParams,
          generator: torch.Generator | None = None, depth: int = 1,
          trials: list[tuple[int, int, bool]] | None = None) -> tuple[int | None, int]:
    """One node of the walk: (the accepted child, its token), or (None, the target's own token) when no
    candidate at `node` passes. `trials` gets (depth, candidate index, accepted) for each candidate tried."""
    trials = trials if trials is not None else []
    candidates = tree.candidates.get(node, [])
    if params.greedy:
        token = int(logits.argmax())
        for i, c in enumerate(candidates):
            trials.append((depth, i, c == token))
            if c == token:
                break
        return tree.child(node, token), token
    p = probabilities(logits, params)
    q = tree.dists.get(node)
    for i, x in enumerate(candidates):
        assert q is not None, "a node's candidates are drawn from its distribution: both are stored"
        u = float(torch.rand((), generator=generator))
        ok = u * float(q[x]) < float(p[x])
        trials.append((depth, i, ok))
        if ok:
            child = tree.child(node, x)
            assert child is not None, "every candidate is added to the tree as a child of its node"
            return child, x
        residual = (p - q).clamp_(min=0)
        total = float(residual.sum())
        if total <= 0:  # p == q up to rounding: a rejection had probability ~0; keep p
            continue
        p = residual / total
    return None, int(torch.multinomial(p, 1, generator=generator))
