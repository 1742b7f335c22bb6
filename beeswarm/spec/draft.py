"""The local draft model: a small causal LM with its own KV cache, proposing token trees.

It keeps the tokens it has read in its cache; each proposal reads what is new after their common
prefix with the asked-for sequence (the accepted path and the target's token, or a hypothetical path
when speculation is pipelined) in one step, then grows the tree a level per step, each level
attending to its ancestors through a windowed tree mask. Tree nodes past the read length are simply
overwritten next time: rolling back is a length.
"""
from __future__ import annotations

import itertools

import torch

from beeswarm.generation.sampling import Noise, SamplingParams
from beeswarm.shard import EntryModel, Span, SpanRuntime, checkpoint
from beeswarm.shard.errors import ShardError
from beeswarm.shard.loader import load_config
from beeswarm.spec.tree import ROOT, DraftTree, grow_tree
from beeswarm.spec.tuner import TreeShape


class DraftError(ShardError):
    """The draft cannot serve this target (missing, or another vocabulary)."""


def draft_ref(model: str, requested: str | None) -> str | None:
    """The draft to use: `requested`, else the model's paired draft; None when there is none or 'none'."""
    if requested is not None:
        return None if requested.lower() == "none" else requested
    return checkpoint.PAIRED_DRAFT.get(model)


class DraftModel:
    _ids = itertools.count()

    def __init__(self, ref: str, target_vocab: int, dtype="float32", device="cpu"):
        folder = checkpoint.resolve(ref)
        config = load_config(folder)
        if config.vocab_size != target_vocab:
            raise DraftError(f"draft {ref!r} has a vocabulary of {config.vocab_size} tokens, the target "
                             f"{target_vocab}: a draft must share the target's tokenizer")
        self.ref = ref
        self.entry = EntryModel(folder, dtype, device)
        self.span = SpanRuntime(folder, Span(0, config.num_hidden_layers), dtype, device)
        self.session: str | None = None
        self.read: list[int] = []  # the tokens in the cache, in order

    def reset(self, max_length: int) -> None:
        """Start over (a new generation, or after a failover)."""
        if self.session is not None:
            self.span.close(self.session)
        self.session = f"draft-{next(self._ids)}"
        limit = self.entry.config.max_position_embeddings
        self.span.open(self.session, min(max_length, limit))
        self.read = []

    def close(self) -> None:
        if self.session is not None:
            self.span.close(self.session)
            self.session = None

    def propose(self, committed: list[int], shape: TreeShape, params: SamplingParams,
                noise: Noise | None = None) -> DraftTree:
        """A tree after `committed` (the whole sequence; the draft reads what it has not read of it)."""
        return self.propose_many(committed, [[]], shape, params, noise)[0]

    @torch.inference_mode()
    def propose_many(self, committed: list[int], paths: list[list[int]], shape: TreeShape, params: SamplingParams,
                     noise: Noise | None = None) -> tuple[DraftTree, list[int]]:
        """Trees after `committed` + each of `paths`, grown together (one draft step per level for all).

        The tree returned starts with the paths' tokens (a trie; its nodes get no candidates), then holds a
        tree of `shape` under each path's last node; with it, each path's last node (ROOT for an empty one).
        """
        if self.session is None:
            raise DraftError("reset() the draft before proposing")
        same = 0
        for a, b in zip(self.read, committed):
            if a != b:
                break
            same += 1
        base = len(committed)
        tree = DraftTree()
        ends = [tree.insert(path) for path in paths]
        logits = {}
        if same < base or ROOT in ends:  # re-read at least the last token when its logits are a root's
            same = min(same, base - 1)
            hidden = self.span.step_one(self.session, self.entry.embed(torch.tensor(committed[same:])), same)
            logits[ROOT] = self.entry.logits(hidden[-1:])[0]
        self.read = list(committed)
        if len(tree):
            out = self.span.step_one(self.session, self.entry.embed(torch.tensor(tree.tokens)), base, tree.ancestors())
            read = [end for end in dict.fromkeys(ends) if end != ROOT]  # only the paths' ends are grown under
            logits.update(zip(read, self.entry.logits(out[read])))

        def level_logits(tree: DraftTree, nodes: list[int]) -> torch.Tensor:
            first = nodes[0]  # levels are contiguous: the step holds nodes first.., the window the whole tree
            mask = tree.ancestors(first, first + len(nodes))
            tokens = torch.tensor([tree.tokens[n] for n in nodes])
            out = self.span.step_one(self.session, self.entry.embed(tokens), base + first, mask)
            return self.entry.logits(out)

        room = self.span.sessions[self.session].max_length - base - len(tree)
        shape = TreeShape(shape.widths, min(shape.max_nodes, max(1, room)), shape.min_path_prob)
        grow_tree(tree, [(end, logits[end]) for end in dict.fromkeys(ends)], level_logits, shape, params, noise,
                  committed)
        return tree, ends
