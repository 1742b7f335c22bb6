"""Where the swarm was last seen: the addresses of members heard lately, dialled again once they drop out of
this node's view.

A node knows the swarm through its bootstraps and the members it is linked to. Under churn all of them can
go: a newcomer whose bootstrap was killed just after it joined, or the whole of one side of a swarm that
split in two (each side electing its own coordinator), leaves the other side with no member that knows a
live address of it. The chaos benchmark split its swarm so within 4 minutes, and its chats, whose
bootstrap and neighbours were all replaced, lost every route. So every REDIAL_S a node dials one member it
heard of lately and no longer sees; a dial that connects lets gossip merge the two views (and the election
the two coordinators). An address that fails TRIES times in a row is forgotten.
"""
from __future__ import annotations

import random
from collections import OrderedDict

SIZE = 64  # members remembered, the most recently heard
REDIAL_S = 10.0  # one dial of a remembered member this often at most
ALONE_REDIAL_S = 2.0  # and this often while the node sees no member at all
TRIES = 3  # failed dials in a row before an address is forgotten


class AddressBook:
    def __init__(self, rng: random.Random | None = None):
        self._entries: OrderedDict[str, tuple[str, ...]] = OrderedDict()  # peer -> addresses, most recent last
        self._failures: dict[str, int] = {}
        self._next = 0.0
        self._rng = rng or random.Random()

    def __len__(self) -> int:
        return len(self._entries)

    def saw(self, peer: str, addrs: tuple[str, ...]) -> None:
        """`peer` was heard from, at `addrs` (its dialable ones)."""
        if not addrs:
            return
        self._entries[peer] = addrs
        self._entries.move_to_end(peer)
        self._failures.pop(peer, None)
        while len(self._entries) > SIZE:
            self._failures.pop(self._entries.popitem(last=False)[0], None)

    def due(self, now: float, seen: set[str], alone: bool) -> tuple[str, tuple[str, ...]] | None:
        """A remembered member outside `seen` (the view, the connected peers) to dial now, at most one per
        REDIAL_S (ALONE_REDIAL_S while the node is `alone`); the most recently heard are likelier alive, so
        they are drawn more often."""
        if now < self._next - (REDIAL_S - ALONE_REDIAL_S if alone else 0.0):
            return None
        lost = [p for p in self._entries if p not in seen]
        if not lost:
            return None
        self._next = now + REDIAL_S
        peer = lost[-1 - min(int(self._rng.expovariate(0.5)), len(lost) - 1)]
        return peer, self._entries[peer]

    def failed(self, peer: str) -> None:
        self._failures[peer] = self._failures.get(peer, 0) + 1
        if self._failures[peer] >= TRIES:
            self._entries.pop(peer, None)
            self._failures.pop(peer, None)
