"""A dishonest stage, for tests and benchmarks only: `BEESWARM_TEST_FAULT=mode[:scale][@fraction]` in a
contributor's environment makes its stage misbehave on that fraction of steps (default all). No user
sets it; a contributor that has it logs a warning at start. Modes:

- noise: random hidden states of the output's scale
- identity: its input sent on unchanged (skips its layers to save power)
- bias: its output nudged by `scale` (default BIAS_SCALE, 5%) of its norm along one token's LM-head row
  (pushes that token's logit): below the per-token tolerance, a steady nudge only the direction test sees
- layer: one layer of its span (the middle one) computed with weights off by `scale` (default LAYER_SCALE) of
  their spread, on every step: a consistent liar whose replay repeats the lie, so its signed boundaries agree
  with its output and only a check of that very layer finds it
"""
from __future__ import annotations

import logging
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from beeswarm.shard import checkpoint

log = logging.getLogger(__name__)

ENV = "BEESWARM_TEST_FAULT"
MODES = ("noise", "identity", "bias", "layer")
BIAS_TOKEN = 1
BIAS_SCALE = 0.05
LAYER_SCALE = 0.1


@dataclass(frozen=True)
class Fault:
    mode: str
    fraction: float = 1.0
    direction: torch.Tensor | None = None  # bias: a unit vector
    scale: float = BIAS_SCALE  # bias: of the output's norm, per token

    @classmethod
    def from_env(cls, folder: Path, hidden_size: int) -> Fault | None:
        spec = os.environ.get(ENV, "").strip()
        if not spec:
            return None
        mode, _, fraction = spec.partition("@")
        mode, _, scale = mode.partition(":")
        if mode not in MODES:
            raise ValueError(f"{ENV}={spec!r}: the mode is one of {', '.join(MODES)}")
        direction = _token_direction(folder, hidden_size) if mode == "bias" else None
        default = LAYER_SCALE if mode == "layer" else BIAS_SCALE
        fault = cls(mode, float(fraction) if fraction else 1.0, direction, float(scale) if scale else default)
        log.warning("TEST FAULT ON: this stage returns wrong activations (%s on %.0f%% of steps)",
                    spec, 100 * fault.fraction)
        return fault

    def corrupt(self, layers: Sequence[torch.nn.Module], seed: int = 0) -> int | None:
        """`layer` mode: perturb the middle one of `layers` (a span's, as built) in place; its index, else None."""
        if self.mode != "layer" or not layers:
            return None
        at = len(layers) // 2
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in layers[at].parameters():
                if p.is_floating_point() and p.numel() > 1:
                    noise = torch.randn(p.shape, generator=generator).to(device=p.device, dtype=p.dtype)
                    p.add_(noise * p.float().std().to(p.dtype) * self.scale)
        return at

    def apply(self, given: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.mode == "layer" or random.random() >= self.fraction:  # layer: the lie is in the weights
            return out
        if self.mode == "noise":
            return torch.randn_like(out) * out.float().std().to(out.dtype)
        if self.mode == "identity":
            return given.to(device=out.device, dtype=out.dtype)
        assert self.direction is not None
        push = self.direction.to(device=out.device, dtype=out.dtype)
        return out + self.scale * out.norm(dim=-1, keepdim=True) * push


def _token_direction(folder: Path, hidden_size: int) -> torch.Tensor:
    """The LM head's row for BIAS_TOKEN (the embedding's when tied), or a fixed random direction when the
    stage's folder lacks both (a partial download)."""
    files = checkpoint.weight_map(folder)
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        if name in files and (folder / files[name]).exists():
            row = checkpoint.read_tensors(folder, files, [name])[name][BIAS_TOKEN].float()
            return row / row.norm()
    row = torch.randn(hidden_size, generator=torch.Generator().manual_seed(0))
    return row / row.norm()
