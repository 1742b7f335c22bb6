"""What every command shares: the user's error, the swarm secret, --join, whether there is a terminal."""
from __future__ import annotations

import os
import sys

SWARM_SECRET = "swarm-secret"
SWARM_SECRET_ENV = "BEESWARM_SWARM_SECRET"


class UserError(Exception):
    """A problem the user can fix; printed without a traceback, exit status 2."""


def swarm_secret(env_name: str | None) -> bytes | None:
    """The swarm secret: --swarm-secret-env NAME, else the stored one, else None (an open swarm)."""
    from beeswarm import secrets

    if env_name:
        value = os.environ.get(env_name)
        if not value:
            raise UserError(f"--swarm-secret-env {env_name}: that environment variable is empty or unset")
        return value.encode()
    try:
        stored = secrets.load(SWARM_SECRET, SWARM_SECRET_ENV)
    except secrets.SecretError as e:
        raise UserError(str(e)) from None
    return stored.value if stored else None


def required_join(join: list[str], what: str):
    """Bootstrap addresses (and the descriptor, if a URL was given) from --join, which must be given."""
    from beeswarm.p2p.descriptor import DescriptorError, resolve_join

    try:
        bootstrap, descriptor = resolve_join(join)
    except DescriptorError as e:
        raise UserError(str(e)) from None
    if not bootstrap:
        raise UserError(f"--join MULTIADDR|URL is required: {what}")
    return bootstrap, descriptor


def interactive() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()
