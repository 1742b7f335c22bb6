"""Where a speculation's tree nodes sit in the stages' KV cache, and the compaction ("keep") each step carries.

The stages hold the committed tokens compacted at the front (`base` of them), then the nodes sent since, each
at its slot. Before the next step, the committed nodes move to the front and the still-live ones follow; the
rest are dropped. The entry computes this layout alone: each stage applies the same keep to its own cache, so
what it holds is what this layout says (steps name the cache state they expect, `protocol.step.CacheState`).
Pure: no torch.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

Keep = tuple[int, list[int]]  # (start, offsets past it kept, in their new order)


@dataclass
class KVLayout:
    base: int  # committed tokens compacted at the front of the stages' KV
    capacity: int | None = None  # the target session's length (None: unbounded)
    spine: set[int] = field(default_factory=set)  # committed nodes not compacted yet
    slots: dict[int, int] = field(default_factory=dict)  # node -> its position, for nodes sent past `base`
    end: int = -1  # the stages' KV length once every step sent has run (-1: `base`)

    def __post_init__(self) -> None:
        if self.end < 0:
            self.end = self.base

    def place(self, rows: list[int]) -> int:
        """Nodes sent in one step, at the end of the KV; the position of the first."""
        start = self.end
        for i, node in enumerate(rows):
            self.slots[node] = start + i
        self.end = start + len(rows)
        return start

    def compact(self, at: int, alive: Callable[[int], bool]) -> tuple[Keep | None, list[int], list[int]]:
        """Compact for the next step: the committed nodes to `base`, then the `alive` ones; `at` (the walk's node)
        is the spine from here. Returns the keep (None: nothing moves), the live nodes in their new order (the
        next step's window), and the sent nodes it no longer places (compacted into `base`, or dropped)."""
        sent = sorted(self.slots, key=self.slots.__getitem__)
        committed = [n for n in sent if n in self.spine]
        live = [n for n in sent if n not in self.spine and alive(n)]
        offsets = [self.slots[n] - self.base for n in committed + live]
        keep = None if offsets == list(range(self.end - self.base)) else (self.base, offsets)
        kept = set(live) | {at}
        forgotten = [n for n in sent if n not in kept]
        self.slots.clear()
        self.base += len(committed)
        self.spine, self.end = {at}, self.base
        self.place(live)
        return keep, live, forgotten
