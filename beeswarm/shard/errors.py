"""Errors the shard runtime raises with a message a user can act on."""


class ShardError(Exception):
    """A span cannot be loaded or a step cannot run; the message names the problem."""


class SessionError(ShardError):
    """A step or session request that does not fit the session (unknown id, bad position, no memory)."""
