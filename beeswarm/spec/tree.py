"""Draft token trees: growing one level at a time, and the attention masks that run it in one pass.

Nodes are numbered in breadth-first order (each level contiguous); node -1 is the root, the last
committed token. A node's children are its draft's top-w tokens: greedy, by the draft's probability;
sampling, by the draft's probability perturbed with the generation's noise at the children's position
(log q + G), the same noise the target's token there is drawn with (`verify`), so the first candidate
is the draft's own draw and the likeliest to be the target's.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from beeswarm.generation.sampling import Noise, SamplingParams, Seen, penalize, probabilities
from beeswarm.spec.tuner import TreeShape

ROOT = -1
MAX_CANDIDATES = 8  # at one node, widening included


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)  # 1 for the root's children
    # per expanded node (ROOT included): the draft distribution and the candidates taken from it, in the order
    # verification tries them (its top-w, by probability when greedy, by probability and noise when sampling)
    dists: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: dict[int, list[int]] = field(default_factory=dict)
    # per expanded node: the MAX_CANDIDATES + 1 tokens it ranks first (as its candidates) and their probabilities
    ranked: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    _children: dict[int, dict[int, int]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int) -> int:
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent == ROOT else self.depths[parent] + 1)
        self._children.setdefault(parent, {})[token] = node
        return node

    def child(self, node: int, token: int) -> int | None:
        return self._children.get(node, {}).get(token)

    def children(self, node: int) -> list[int]:
        return list(self._children.get(node, {}).values())

    def insert(self, tokens: list[int]) -> int:
        """The node after the root for `tokens`, adding the nodes it lacks (ROOT for none)."""
        node = ROOT
        for token in tokens:
            found = self.child(node, token)
            node = found if found is not None else self.add(node, token)
        return node

    def untried(self, node: int) -> tuple[int, float] | None:
        """The draft's likeliest token at an expanded `node` that is no child of it yet, and its probability."""
        tokens, probs = self.ranked[node]
        return next(((t, q) for t, q in zip(tokens, probs, strict=True) if self.child(node, t) is None), None)

    def path(self, node: int) -> list[int]:
        """Nodes from the root's child down to `node`."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        """The tokens from the root's child down to `node` (none for the root)."""
        return [self.tokens[n] for n in self.path(node)]

    def ancestors(self, first: int = 0, end: int | None = None) -> torch.Tensor:
        """(end - first, end) bool for nodes first..end-1 (all by default): [i, j] when node j is node
        first + i or one of its ancestors. Built from index lists: one tensor write, not one per node."""
        end = len(self.tokens) if end is None else end
        rows: list[int] = []
        cols: list[int] = []
        for i in range(first, end):
            node = i
            while node != ROOT:
                rows.append(i - first)
                cols.append(node)
                node = self.parents[node]
        anc = torch.zeros(end - first, end, dtype=torch.bool)
        anc[rows, cols] = True
        return anc



# (tree, nodes of the newest level) -> draft logits (len(nodes), vocab) predicting each node's children
LevelLogits = Callable[[DraftTree, list[int]], torch.Tensor]


def grow_tree(tree: DraftTree, roots: list[tuple[int, torch.Tensor]], level_logits: LevelLogits, shape: TreeShape,
              params: SamplingParams, noise: Noise | None, seen: list[int]) -> None:
    """Grow `tree` under each of `roots` (node, the draft's logits after it), a level at a time, to `shape`:
    `shape.max_nodes` new nodes in all, likelier paths first. `seen`: the committed sequence (the root's children
    come at its length: the noise's position), for the repetition penalty too (each node's proposal is penalised
    by its own sequence, as the target's will be)."""
    if not params.greedy and noise is None:
        raise ValueError("sampling trees need the generation's noise")
    committed = Seen(seen) if params.repetition_penalty != 1.0 else None
    frontier = [(node, logits, 1.0) for node, logits in roots]  # node, logits for its children, path probability
    added = 0
    for depth, width in enumerate(shape.widths, start=1):
        # the nodes this level may expand (each adds a node at least), their distributions in one batch
        frontier = [f for f in sorted(frontier, key=lambda f: -f[2])
                    if depth == 1 or f[2] >= shape.min_path_prob][:max(0, shape.max_nodes - added)]
        if not frontier:
            break
        rows = [logits if committed is None else
                penalize(logits, committed.plus(tree.path_tokens(node)), params.repetition_penalty)
                for node, logits, _ in frontier]
        dists = draft_distribution(torch.stack(rows), params)
        k = min(dists.shape[-1], max(width, MAX_CANDIDATES + 1))
        if params.greedy or noise is None:
            ranks = dists.topk(k).indices.tolist()
        else:  # each row's children come at its own position (roots may hang at several depths)
            scores = torch.stack([noise.scores(dist, len(seen) + (tree.depths[node] if node != ROOT else 0))
                                  for (node, _, _), dist in zip(frontier, dists, strict=True)])
            top = scores.topk(k)  # tokens outside the draft's nucleus (score -inf) are no candidates
            ranks = [[t for t, v in zip(row, values) if v > float("-inf")]
                     for row, values in zip(top.indices.tolist(), top.values.tolist(), strict=True)]
        level: list[tuple[int, float]] = []
        for (node, _, path_prob), dist, tokens in zip(frontier, dists, ranks, strict=True):
            draws = min(width, shape.max_nodes - added)
            if draws <= 0:
                break
            candidates = tokens[:draws]
            tree.dists[node], tree.candidates[node] = dist, candidates
            tree.ranked[node] = tokens, dist[tokens].tolist()
            for token in candidates:
                level.append((tree.add(node, token), path_prob * float(dist[token])))
                added += 1
        if not level or depth == shape.depth:
            break
        logits = level_logits(tree, [node for node, _ in level])
        frontier = [(node, logits[i], p) for i, (node, p) in enumerate(level)]


def draft_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What the draft proposes from: the sampling distribution, or plain softmax for greedy trees."""
    if params.greedy:
        return torch.softmax(logits.float(), dim=-1)
    return probabilities(logits, params)
