"""Small helpers shared by the tests."""
from __future__ import annotations

import time

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
INTERVAL = 1.0  # membership and election heartbeat in tests


def wait_for(cond, timeout: float, what: str):
    """Poll `cond` until it returns something truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
