"""Recompute revealed steps through a span, and the tolerance a recomputed output must meet.

A replay runs the steps one by one, in the order the stage ran them, in a fresh session: the same
rollbacks, tree masks and kept paths, so the same KV cache. It need not run them batched as the stage
did (with other sessions, padded), so floating point may differ in the last bits: outputs are compared
by their relative error per token, ||a - b|| / ||b||, against TOLERANCE for the dtype. float32 on
CPU differs by at most 8.6e-7 between batched and alone (tinycode, 8 concurrent sessions, 768 steps:
`benchmarks/audit_bench.py --sections tolerance`), so 1e-4 leaves a 100x margin and still catches any
change a reader of the text would notice (the 5% bias of the test faults is 500x over it); half
precision differs by 8.8e-4 (fp16) and 4.1e-3 (bf16) on CPU, more across batch shapes and GPUs, hence
looser bounds there. Every replica of a span serves the same dtype and weight format, so these hold swarm-wide.

A per-token bound misses a steady nudge below it (a bias of 2-3% the same way on every token, in bf16). So the
errors of an audit's tokens are also added up as vectors: honest rounding points every which way, and the mean of
n of its error vectors has a norm of about rms / sqrt(n) (in d dimensions, within a few sqrt(2 / d) of it); a mean
DIRECTION_Z times that, and over DRIFT_FRACTION of the tolerance, is one direction held, and caught.
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
DIRECTION_MIN_TOKENS = 8  # fewer tokens than this: no direction test (one step's worth tells nothing)
DIRECTION_Z = 4.0  # the mean's norm over its honest size, rms / sqrt(n), that counts as a direction held
DRIFT_FRACTION = 0.1  # ... and over this much of the per-token tolerance (float32's honest errors are ~5e-7)
MERGE_TOKENS = 256  # consecutive plain steps replayed as one pass (bounds its activations)


def error_vectors(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Each token's error relative to its expected norm, (got - expected) / ||expected||: (tokens, hidden)."""
    a, b = got.double(), expected.double()
    return ((a - b) / b.norm(dim=-1, keepdim=True).clamp_min(1e-12)).reshape(-1, a.shape[-1])


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest per-token relative error (inf when the shapes differ)."""
    if got.shape != expected.shape:
        return float("inf")
    err = error_vectors(got, expected).norm(dim=-1)
    return float(err.max()) if err.numel() else 0.0


def drift(errors: torch.Tensor) -> tuple[float, float]:
    """(the norm of the tokens' mean error vector, that norm over its honest size rms / sqrt(n)) for `errors`
    (tokens, hidden); (0, 0) with fewer than DIRECTION_MIN_TOKENS tokens or no error at all."""
    n = errors.shape[0]
    rms = float(errors.pow(2).sum(dim=-1).mean().sqrt()) if n else 0.0
    if n < DIRECTION_MIN_TOKENS or rms == 0.0:
        return 0.0, 0.0
    mean = float(errors.mean(dim=0).norm())
    return mean, mean * n ** 0.5 / rms


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])


@dataclass(frozen=True)
class Mismatch:
    step: int  # the step contradicted (a direction: the last step checked)
    error: float
    tolerance: float
    tokens: int = 0  # > 0: a direction held over this many tokens, not one token's error

    def __str__(self) -> str:
        if self.tokens:
            return (f"over {self.tokens} tokens up to step {self.step}, its outputs drift {self.error:.1e} one way "
                    f"from the recomputation (honest drift below {self.tolerance:.0e})")
        return f"step {self.step}: its output is {self.error:.1e} away from the recomputation " \
               f"(tolerance {self.tolerance:.0e})"


def replay(runtime: SpanRuntime, steps: Sequence[LoggedStep]) -> list[torch.Tensor]:
    """The span's outputs for `steps`, recomputed in order in a session of its own. Consecutive plain steps
    (no tree mask, no kept path, each starting where the last ended: decoding one token at a time) run as one
    pass of up to MERGE_TOKENS tokens, as a prefill of them would: the same attention over the same cache, one
    forward instead of one per token (most of an audit's time was the per-pass overhead)."""
    return [after[-1] for after in _replay(runtime, steps, trace=False)]


def trace(runtime: SpanRuntime, steps: Sequence[LoggedStep]) -> list[list[torch.Tensor]]:
    """`replay` keeping every layer's output: per step, len(span) tensors on the host (empty ones for a held step),
    the hidden states at each layer boundary after its input. What an audited stage signs (`Boundaries`)."""
    return _replay(runtime, steps, trace=True)


def _replay(runtime: SpanRuntime, steps: Sequence[LoggedStep], trace: bool) -> list[list[torch.Tensor]]:
    key = f"audit/{os.urandom(8).hex()}"
    max_length = max(s.start + max(s.held, s.input.shape[0]) for s in steps)
    runtime.open(key, min(max_length, runtime.config.max_position_embeddings))
    layers = len(runtime.span) if trace else 1
    try:
        outputs: list[list[torch.Tensor]] = []
        for group in _runs(steps):
            first = group[0]
            if first.keep is not None:
                runtime.keep(key, first.keep.start, list(first.keep.indices))
            if first.held:  # cancelled at the stage: its keep applied and its positions held, nothing computed
                runtime.hold(key, first.start, first.held)
                outputs.append([first.output] * layers)
                continue
            mask = tensors.decode_mask(first.mask, first.input.shape[0], first.start)
            hidden = first.input if len(group) == 1 else torch.cat([s.input for s in group])
            x = StepInput(key, hidden, first.start, mask)
            after = runtime.trace(x) if trace else runtime.step([x])
            split = [h.to("cpu").split([s.input.shape[0] for s in group]) for h in after]
            outputs.extend([list(per_layer) for per_layer in zip(*split, strict=True)])
        return outputs
    finally:
        runtime.close(key)


def _runs(steps: Sequence[LoggedStep]) -> list[list[LoggedStep]]:
    """`steps` in the groups a replay runs as one pass each: a step with a tree mask, or held, alone; a plain one
    with the plain steps after it that start where it ends and bring no kept path (MERGE_TOKENS at most)."""
    runs: list[list[LoggedStep]] = []
    for s in steps:
        last = runs[-1] if runs else None
        if last is not None and last[0].mask is None and s.mask is None and s.keep is None and \
                not last[0].held and not s.held and \
                s.start == last[-1].start + last[-1].input.shape[0] and \
                s.start + s.input.shape[0] - last[0].start <= MERGE_TOKENS:
            last.append(s)
        else:
            runs.append([s])
    return runs


@dataclass(frozen=True)
class Comparison:
    mismatch: Mismatch | None
    error: float  # the largest relative error per token of the steps compared


def compare(runtime: SpanRuntime, steps: Sequence[LoggedStep], checked: set[int],
            tol: float | None = None) -> Comparison:
    """Replay `steps` and compare the outputs of those among `checked` with the recomputation: the first that differs
    by more than `tol` (the span's tolerance for its dtype by default) is a mismatch, and so are the checked steps'
    outputs as a whole when they drift one way (`drift`)."""
    tol = tolerance(runtime.dtype) if tol is None else tol
    errors, last, largest = [], 0, 0.0
    for s, out in zip(steps, replay(runtime, steps), strict=True):
        if s.step in checked and not s.held:
            err = relative_error(s.output.to(out.dtype), out)
            if not err <= tol:
                return Comparison(Mismatch(s.step, err, tol), err)
            largest = max(largest, err)
            errors.append(error_vectors(s.output.to(out.dtype), out))
            last = s.step
    mean, z = drift(torch.cat(errors)) if errors else (0.0, 0.0)
    if z > DIRECTION_Z and mean > DRIFT_FRACTION * tol:
        return Comparison(Mismatch(last, mean, DRIFT_FRACTION * tol, sum(e.shape[0] for e in errors)), largest)
    return Comparison(None, largest)
