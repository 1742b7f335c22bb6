"""Verification of a draft tree against the target's logits from one pass.

At each node the target's token is taken as plain decoding would take it: greedy, its argmax; sampling, the
draw at that position of the generation's `Noise` (argmax of log p + G: exactly a sample of p). The walk follows
the child holding that token, and the target's token after the last accepted node comes free. So the committed
tokens are, token for token, those plain decoding gives with the same noise: whatever the tree, the timing, the
stages or the other users. The draft ranks its candidates by the same noise, which is what makes them likely.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from beeswarm.generation.sampling import Noise, SamplingParams, probabilities
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


def verify(tree: DraftTree, target_logits: TargetLogits, params: SamplingParams, noise: Noise | None = None,
           position: int = 0) -> Verdict:
    """Walk the tree from the root, judging each reached node with the target's logits after it; `position`: the
    sequence position of the root's children."""
    verdict, node, depth = Verdict([], 0), ROOT, 1
    while True:
        child, token = judge(tree, node, target_logits(node), params, noise, position + depth - 1, depth,
                             verdict.trials)
        if child is None:
            verdict.bonus = token
            return verdict
        verdict.path.append(child)
        node, depth = child, depth + 1


def target_token(logits: torch.Tensor, params: SamplingParams, noise: Noise | None, position: int) -> int:
    """The token plain decoding takes at `position` from the target's (penalised) logits."""
    if params.greedy:
        return int(logits.argmax())
    if noise is None:
        raise ValueError("sampling needs the generation's noise")
    return noise.draw(probabilities(logits, params), position)


def judge(tree: DraftTree, node: int, logits: torch.Tensor, params: SamplingParams, noise: Noise | None,
          position: int, depth: int = 1, trials: list[tuple[int, int, bool]] | None = None) -> tuple[int | None, int]:
    """One node of the walk: (the child holding the target's token at `position`, that token), or (None, the
    token) when no candidate at `node` is it. `trials` gets (depth, candidate index, taken) for each candidate
    tried, in the order the draft ranked them."""
    trials = trials if trials is not None else []
    token = target_token(logits, params, noise, position)
    for i, c in enumerate(tree.candidates.get(node, [])):
        trials.append((depth, i, c == token))
        if c == token:
            break
    return tree.child(node, token), token
