"""The entry's part of the model: token ids -> embeddings, and hidden -> final norm -> logits."""
from __future__ import annotations

from pathlib import Path

import torch

from beeswarm.shard import checkpoint, loader
from beeswarm.shard.device import resolve_device, resolve_dtype
from beeswarm.shard.families import embedding_scale, final_softcap


class EntryModel:
    def __init__(self, folder: Path, dtype="auto", device="auto", ref: str | None = None):
        """`ref`: the model as the user named it (a folder or hub id), for loading other parts of it later."""
        self.folder = Path(folder)
        self.ref = ref or str(folder)
        self.config = loader.load_config(self.folder)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.embedding, self.norm, self.lm_head = loader.build_entry_parts(self.folder, self.config, self.dtype,
                                                                          self.device)
        # what a family does at the ends of the model lives here, not in stages (Gemma: both)
        self.embed_scale, self.softcap = embedding_scale(self.config), final_softcap(self.config)

    @classmethod
    def load(cls, ref: str, dtype="auto", device="auto") -> EntryModel:
        return cls(checkpoint.resolve(ref, checkpoint.Parts(embed=True, head=True)), dtype, device, ref)

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding(token_ids.to(self.device))
        if self.embed_scale != 1.0:  # as transformers does it: the scale rounded to the weights' dtype first
            hidden = hidden * torch.tensor(self.embed_scale).to(hidden.dtype)
        return hidden

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden.to(device=self.device, dtype=self.dtype)))
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()
