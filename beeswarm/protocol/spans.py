"""Layers [start, end) of a model: the one layer-range type of planner, plans, membership and routes."""
from __future__ import annotations

import itertools

import msgspec


class Span(msgspec.Struct, frozen=True, order=True, array_like=True, forbid_unknown_fields=True):
    """Half-open; travels as [start, end]."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"span [{self.start}, {self.end}) is empty or negative")

    def __len__(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"


def even_splits(num_layers: int, stages: int) -> list[Span]:
    """`stages` contiguous spans covering [0, num_layers) as evenly as possible."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot cut {num_layers} layers into {stages} stages")
    bounds = [round(i * num_layers / stages) for i in range(stages + 1)]
    return [Span(a, b) for a, b in itertools.pairwise(bounds)]
