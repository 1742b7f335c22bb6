"""A whole model as entry + spans in one process: the demo until the local swarm, and the test oracle."""
from __future__ import annotations

import itertools

import torch

from beeswarm.protocol.spans import even_splits
from beeswarm.shard import EntryModel, SpanRuntime, checkpoint


class LocalPipeline:
    """Entry (embedding + head) and `stages` spans, chained in-process through the shard API."""

    def __init__(self, ref: str, stages: int = 3, dtype="auto", device="auto"):
        folder = checkpoint.resolve(ref)
        self.entry = EntryModel(folder, dtype, device)
        layers = self.entry.config.num_hidden_layers
        self.spans = [SpanRuntime(folder, span, dtype, device) for span in even_splits(layers, min(stages, layers))]
        self.folder = folder
        self._sessions = itertools.count()

    @property
    def max_length(self) -> int:
        return self.entry.config.max_position_embeddings

    def open(self, max_length: int) -> str:
        session = f"local-{next(self._sessions)}"
        for span in self.spans:
            span.open(session, max_length)
        return session

    def close(self, session: str) -> None:
        for span in self.spans:
            span.close(session)

    def forward(self, session: str, token_ids: torch.Tensor, start: int, tree_mask: torch.Tensor | None = None,
                keep: tuple[int, list[int]] | None = None) -> torch.Tensor:
        hidden = self.entry.embed(token_ids)
        for span in self.spans:
            if keep is not None:
                span.keep(session, *keep)
            hidden = span.step_one(session, hidden, start, tree_mask)
        return self.entry.logits(hidden)
