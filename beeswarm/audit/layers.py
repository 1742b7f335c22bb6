"""Audits by layer: a stage's signed layer boundaries, and checking one piece of its span against them.

A span too big for anyone else to hold is still checked: the audited stage replays its logged session and
signs `Boundaries` (its committed digests per step, and one digest per boundary inside its span); pieces of
its span are drawn only then, and each is checked alone by whoever holds (or can load) those layers. Boundary
`span.start` is the stage's committed input and boundary `span.end` its committed output; inside, the hidden
states of its replay. A stage that lied on the data path cannot sign a chain that recomputes right layer by
layer from its committed input to its committed output: some piece shows it.

Tolerance: a piece that ends inside the span compares the stage's replay with the checker's, both run alone, the
same steps in the same passes, so honest ones differ only where two machines round one layer differently:
PIECE_TOLERANCE per layer (measured: `benchmarks/audit_bench.py --sections tolerance`), times the piece's
layers. A piece that ends at the span's end compares with what the stage committed, computed batched with other
sessions: the span's tolerance (`replay.tolerance`). The pieces of one audit together must fit the span's budget:
their errors add up to at most the span's tolerance.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

import msgspec
import torch
from libp2p.crypto.keys import KeyPair

from beeswarm.audit import commitments
from beeswarm.audit.replay import tolerance
from beeswarm.audit.retention import LoggedStep
from beeswarm.p2p.signatures import sign_bytes, verify_bytes
from beeswarm.protocol.audit import (
    Boundaries,
    BoundaryStep,
    Revealed,
    RevealedStep,
    boundaries_body,
    boundary_digest,
    reveal_body,
)
from beeswarm.protocol.spans import Span
from beeswarm.protocol.step import Commit
from beeswarm.shard import tensors

# the relative error per token one layer's honest recomputation may show, by dtype: about 10x the largest measured
# between a layer run batched with 7 other sessions and alone (float32 3.9e-7, float16 5.3e-4, bfloat16 3.7e-3;
# tinycode on CPU, `audit_bench.py --sections layers --dtype D`)
PIECE_TOLERANCE = {torch.float32: 4e-6, torch.float16: 7e-3, torch.bfloat16: 5e-2}

Traced = Sequence[Sequence[torch.Tensor]]  # per step, the hidden states after each layer of the span (`replay.trace`)


def piece_tolerance(dtype: torch.dtype, piece: Span, span: Span) -> float:
    """What piece `piece` of `span` may differ from its recomputation: the span's tolerance for a piece ending at
    the span's end (compared with the committed output), else PIECE_TOLERANCE per layer, never above the span's."""
    whole = tolerance(dtype)
    if piece.end == span.end:
        return whole
    return min(whole, PIECE_TOLERANCE.get(dtype, PIECE_TOLERANCE[torch.bfloat16]) * len(piece))


def at_boundary(step: LoggedStep, traced: Sequence[torch.Tensor], layer: int, span: Span) -> torch.Tensor:
    """A step's hidden states at boundary `layer` of `span`: its input, its committed output, or its replay's."""
    if layer == span.start:
        return step.input
    if layer == span.end:
        return step.output
    return traced[layer - span.start - 1]


def sign_boundaries(key_pair: KeyPair, stage: str, entry: str, session: str, span: Span,
                    steps: Sequence[LoggedStep], traced: Traced) -> Boundaries:
    """The stage's signed boundaries of `steps` (as logged, with their committed digests) and their replay."""
    per_step = tuple(BoundaryStep(s.step, s.held, *_digests(s)) for s in steps)
    inner = tuple(boundary_digest([(s.step, commitments.digest(t[j])) for s, t in zip(steps, traced, strict=True)])
                  for j in range(len(span) - 1))
    unsigned = Boundaries(stage=stage, session=session, span=span, steps=per_step, inner=inner)
    return msgspec.structs.replace(unsigned, sig=sign_bytes(key_pair, boundaries_body(entry, unsigned)))


def boundaries_signed(b: Boundaries, entry: str) -> bool:
    return len(b.inner) == len(b.span) - 1 and verify_bytes(b.stage, boundaries_body(entry, b), b.sig)


def reveal_piece(key_pair: KeyPair, stage: str, entry: str, session: str, span: Span, piece: Span,
                 steps: Sequence[LoggedStep], traced: Traced) -> Revealed:
    """The stage's signed reveal of piece `piece`: each step's hidden states at the piece's two boundaries."""
    ends = [(at_boundary(s, t, piece.start, span), at_boundary(s, t, piece.end, span))
            for s, t in zip(steps, traced, strict=True)]
    unsigned = Revealed(stage=stage, session=session, piece=piece, steps=tuple(
        RevealedStep(s.step, s.start, s.mask, s.keep, tensors.encode(a), tensors.encode(b), s.held)
        for s, (a, b) in zip(steps, ends, strict=True)))
    digests = [(commitments.context(s.start, s.mask, s.keep), commitments.digest(a), commitments.digest(b))
               for s, (a, b) in zip(steps, ends, strict=True)]
    return msgspec.structs.replace(unsigned, sig=sign_bytes(key_pair, reveal_body(entry, unsigned, digests)))


def _digests(s: LoggedStep) -> tuple[bytes, bytes, bytes]:
    return s.digests or (commitments.context(s.start, s.mask, s.keep), commitments.digest(s.input),
                         commitments.digest(s.output))


def contradiction(commits: Sequence[Commit], steps: Sequence[tuple[int, tuple[bytes, bytes, bytes]]],
                  complete: bool = False, unobserved: Collection[int] = ()) -> str | None:
    """How `steps` ((step, (context, input, output) digests), as a stage revealed or signed them) contradict its
    `commits`, or None. `complete`: `commits` are all of them up to the last step (the entry holds them all), so a
    step without one was made up, unless it is one of the `unobserved` steps the entry sent and did not wait for."""
    by_step = {c.step: c for c in commits}
    ids = {step for step, _ in steps}
    for c in commits:
        if c.step not in ids:
            return f"the reveal leaves out step {c.step}, which it signed a commitment for"
    for step, (ctx, given, sent) in steps:
        found = by_step.get(step)
        if found is None:
            if complete and step not in unobserved:
                return f"the reveal has a step {step} it never committed to"
            continue
        for what, ours, theirs in (("arguments", ctx, found.context), ("input", given, found.input),
                                   ("output", sent, found.output)):
            if ours != theirs:
                return f"step {step}: the revealed {what} does not hash to its commitment"
    return None


def ends_of(b: Boundaries) -> list[tuple[int, tuple[bytes, bytes, bytes]]]:
    """The boundaries' steps as (step, committed digests), for `contradiction`."""
    return [(s.step, (s.context, s.input, s.output)) for s in b.steps]


def piece_contradiction(b: Boundaries, piece: Span, steps: Sequence[LoggedStep]) -> str | None:
    """How a reveal of `piece` (its `steps`, decoded) contradicts the stage's signed boundaries `b`, or None."""
    if not (b.span.start <= piece.start < piece.end <= b.span.end):
        return f"layers {piece} are not within its span {b.span}"
    if [(s.step, s.held) for s in steps] != [(s.step, s.held) for s in b.steps]:
        return "the piece's steps are not those its boundaries signed"
    for s, signed in zip(steps, b.steps, strict=True):
        if commitments.context(s.start, s.mask, s.keep) != signed.context:
            return f"step {s.step}: the revealed arguments are not those its boundaries signed"
    for layer, side in ((piece.start, "input"), (piece.end, "output")):
        tensors_at = [s.input if side == "input" else s.output for s in steps]
        inner = b.at(layer)
        if inner is not None:
            if boundary_digest([(s.step, commitments.digest(t)) for s, t in zip(steps, tensors_at, strict=True)]) \
                    != inner:
                return f"the hidden states at boundary {layer} are not those it signed"
            continue
        for s, t, signed in zip(steps, tensors_at, b.steps, strict=True):
            if commitments.digest(t) != (signed.input if layer == b.span.start else signed.output):
                return f"step {s.step}: the hidden states at boundary {layer} are not those it committed to"
    return None
