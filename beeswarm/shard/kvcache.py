"""Per-session KV cache, preallocated and indexed by position so rollback is just a length."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SessionKV:
    """Keys and values of one session for the layers of a span: (layers, kv_heads, max_length, head_dim)."""

    keys: torch.Tensor
    values: torch.Tensor
    length: int = 0

    @classmethod
    def allocate(cls, layers: int, kv_heads: int, max_length: int, head_dim: int, dtype, device) -> SessionKV:
        shape = (layers, kv_heads, max_length, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def max_length(self) -> int:
        return self.keys.shape[2]

    def keep(self, start: int, indices: list[int]) -> None:
        """Compact to positions `start + indices` (the accepted tree path) moved to `start, start+1, ...`."""
        src = torch.tensor([start + i for i in indices], dtype=torch.long, device=self.keys.device)
        end = start + len(indices)
        self.keys[:, :, start:end] = self.keys.index_select(2, src)
        self.values[:, :, start:end] = self.values.index_select(2, src)
        self.length = end


class StepCache:
    """The `cache` object transformers' attention layers call during one batched step.

    Each row's new keys/values are written into its own session's buffer at its start position; the
    layer gets back every row's keys up to the longest row's end (zero-padded, masked out).
    """

    def __init__(self, sessions: list[SessionKV], starts: list[int], lengths: list[int], first_layer: int):
        self.sessions, self.starts, self.lengths, self.first_layer = sessions, starts, lengths, first_layer
        self.ends = [s + n for s, n in zip(starts, lengths, strict=True)]
        self.kv_length = max(self.ends)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, **_) -> tuple:
        local = layer_idx - self.first_layer
        for row, (kv, start, n) in enumerate(zip(self.sessions, self.starts, self.lengths, strict=True)):
            kv.keys[local, :, start:start + n] = key_states[row, :, :n]
            kv.values[local, :, start:start + n] = value_states[row, :, :n]
        if len(self.sessions) == 1:
            kv, end = self.sessions[0], self.ends[0]
            return kv.keys[local, None, :, :end], kv.values[local, None, :, :end]
        shape = (len(self.sessions), key_states.shape[1], self.kv_length, key_states.shape[3])
        keys = key_states.new_zeros(shape)
        values = value_states.new_zeros(shape)
        for row, (kv, end) in enumerate(zip(self.sessions, self.ends, strict=True)):
            keys[row, :, :end] = kv.keys[local, :, :end]
            values[row, :, :end] = kv.values[local, :, :end]
        return keys, values
