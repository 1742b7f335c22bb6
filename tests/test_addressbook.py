"""The address book (pure): members heard lately, one dialled now and then once out of view."""
from __future__ import annotations

import random

from beeswarm.p2p.addressbook import ALONE_REDIAL_S, REDIAL_S, SIZE, TRIES, AddressBook


def test_one_member_out_of_view_is_due_per_period_sooner_when_alone_and_a_dead_one_is_forgotten():
    book = AddressBook(random.Random(1))
    book.saw("a", ("/ip4/192.0.2.1/tcp/1/p2p/a",))
    book.saw("b", ("/ip4/192.0.2.2/tcp/1/p2p/b",))
    assert book.due(0.0, {"a", "b"}, alone=False) is None  # both in view: nothing to dial
    assert book.due(0.0, {"a"}, alone=False) == ("b", ("/ip4/192.0.2.2/tcp/1/p2p/b",))
    assert book.due(REDIAL_S - 1, set(), alone=False) is None
    assert book.due(ALONE_REDIAL_S, set(), alone=True) is not None  # a node that sees no one tries harder
    for _ in range(TRIES):
        book.failed("b")
    assert len(book) == 1 and book.due(100.0, {"a"}, alone=True) is None


def test_the_book_keeps_the_most_recently_heard():
    book = AddressBook()
    for i in range(SIZE + 10):
        book.saw(f"p{i}", (f"/ip4/192.0.2.1/tcp/{i + 1}/p2p/p{i}",))
    book.saw("p0", ("/ip4/192.0.2.1/tcp/1/p2p/p0",))  # heard again: kept, the oldest others go
    assert len(book) == SIZE
    assert book.due(0.0, {f"p{i}" for i in range(1, SIZE + 10)}, alone=False)[0] == "p0"
    assert book.due(REDIAL_S, {"p0"}, alone=False)[0] not in {f"p{i}" for i in range(1, 11)}
