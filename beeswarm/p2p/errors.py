"""What the p2p layer raises: every part of it and every caller import these from here."""
from __future__ import annotations


class NodeError(Exception):
    """The node cannot do what was asked (not started, bad address, peer unreachable)."""


class PeerUnavailable(NodeError):
    """The peer could not be reached, or the stream to it broke."""


class ChannelClosed(NodeError):
    """The channel was closed by either side or its connection broke."""


class NodeFailed(NodeError):
    """The node's loop ended on an error (`Node.failure`): the process should exit non-zero (the CLI exits 1)."""
