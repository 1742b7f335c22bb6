"""Recompute revealed steps through a span, and the tolerance a recomputed output must meet.

A replay runs the steps one by one, in the order the stage ran them, in a fresh session: the same
rollbacks, tree masks and kept paths, so the same KV cache. It need not run them batched as the stage
did (with other sessions, padded), so floating point may differ in the last bits: outputs are compared
by their relative error per token, ||a - b|| / ||b||, against TOLERANCE for the dtype. float32 on
CPU differs by at most 4.8e-7 between batched and alone (tinycode, 8 concurrent sessions, 768 steps:
`benchmarks/audit_bench.py --sections tolerance`), so 1e-4 leaves a 200x margin and still catches any
change a reader of the text would notice (the 5% bias of the test faults is 500x over it); half
precision kernels differ across batch shapes and GPUs by ~1e-3 (fp16) and ~1e-2 (bf16), hence looser
bounds there. Every replica of a span serves the same dtype and weight format, so these hold swarm-wide.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from beeswarm.audit.retention import LoggedStep
from beeswarm.shard import tensors
from beeswarm.shard.span import SpanRuntime, StepInput

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest per-token relative error (inf when the shapes differ)."""
    if got.shape != expected.shape:
        return float("inf")
    a, b = got.double(), expected.double()
    err = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)
    return float(err.max()) if err.numel() else 0.0


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])


@dataclass(frozen=True)
class Mismatch:
    step: int
    error: float
    tolerance: float


def replay(runtime: SpanRuntime, steps: Sequence[LoggedStep]) -> list[torch.Tensor]:
    """The span's outputs for `steps`, recomputed in order in a session of its own."""
    key = f"audit/{os.urandom(8).hex()}"
    max_length = max(s.start + s.input.shape[0] for s in steps)
    runtime.open(key, min(max_length, runtime.config.max_position_embeddings))
    try:
        outputs = []
        for s in steps:
            if s.keep is not None:
                runtime.keep(key, s.keep.start, list(s.keep.indices))
            mask = tensors.decode_mask(s.mask, s.input.shape[0], s.start)
            outputs.append(runtime.step([StepInput(key, s.input, s.start, mask)])[0].to("cpu"))
        return outputs
    finally:
        runtime.close(key)


def first_mismatch(runtime: SpanRuntime, steps: Sequence[LoggedStep], checked: set[int]) -> Mismatch | None:
    """Replay `steps`; the first step among `checked` whose revealed output the recomputation contradicts."""
    tol = tolerance(runtime.dtype)
    for s, out in zip(steps, replay(runtime, steps), strict=True):
        if s.step in checked:
            err = relative_error(s.output.to(out.dtype), out)
            if not err <= tol:
                return Mismatch(s.step, err, tol)
    return None
