"""Which pieces of a stage's span an audit checks, and who may check each. Pure: no torch, no network.

- Cover (`cover`): the span cut into runs of layers members already serve (each checked by one of them with the
  layers it has loaded: nothing to load, no memory taken), and single layers nobody else serves (spot checks).
  An audit on probation checks them all: every layer of every step.
- Spot (`spot`): SPOT_LAYERS layers drawn at random, each checked alone by a member serving it, else by any with
  room for one layer (it loads that layer), else by the entry. An established stage's drawn audits check those: a
  lie in one layer of an L-layer span is found with probability at least SPOT_LAYERS / L per audit.
The layers are drawn after the stage has signed its boundaries (`audit.layers`), from the OS's random source.
"""
from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

from beeswarm.protocol.spans import Span

SPOT_LAYERS = 2  # layers a spot check of an established stage draws


@dataclass(frozen=True)
class Piece:
    layers: Span
    holders: tuple[str, ...]  # members serving every layer of it (none: a spot check, someone loads them)


def cover(span: Span, holders: Mapping[str, Span]) -> list[Piece]:
    """`span` cut into pieces, in order: from each layer, the longest run one member serves (with every member
    that serves all of it), or that single layer when nobody does."""
    pieces: list[Piece] = []
    at = span.start
    while at < span.end:
        serving = {peer: s for peer, s in holders.items() if s.start <= at < s.end}
        end = min(span.end, max((s.end for s in serving.values()), default=at + 1))
        pieces.append(Piece(Span(at, end), tuple(sorted(p for p, s in serving.items() if s.end >= end))))
        at = end
    return pieces


def spot(span: Span, holders: Mapping[str, Span], rng: random.Random, layers: int = SPOT_LAYERS) -> list[Piece]:
    """`layers` single layers of `span` drawn at random (all of them when it has no more), in order."""
    drawn = sorted(rng.sample(range(span.start, span.end), min(layers, len(span))))
    return [Piece(Span(layer, layer + 1), tuple(sorted(p for p, s in holders.items() if s.start <= layer < s.end)))
            for layer in drawn]


def detection(checked: int, span_layers: int) -> float:
    """The least chance a check of `checked` layers drawn at random finds a lie told in one of `span_layers`."""
    return min(1.0, checked / span_layers)
