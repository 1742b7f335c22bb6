"""The narrow face of a node that its parts use (the swarm-secret gate, requests, channels).

They are handed the node and call only this; none imports `node.py`, which imports them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from beeswarm.p2p.bans import BanList


class Admission(Protocol):
    async def admit(self, peer: str) -> bool:
        """Whether `peer` may be served (in a private swarm: it proved the secret)."""


class Host(Protocol):
    peer_id: str

    @property
    def bans(self) -> BanList: ...

    @property
    def gate(self) -> Admission: ...

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run async `fn` in the node's loop from another thread and return its result."""

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Start async `fn(*args)` in the node's loop."""

    def strike(self, peer: str, reason: str, severe: bool = False) -> None:
        """Count a misbehaviour of `peer`."""

    async def disconnect_async(self, peer: str) -> None: ...

    async def new_stream_when_ready(self, peer: str, protocol: str) -> Any: ...

    async def open_stream(self, peer: str, protocol: str) -> Any: ...
