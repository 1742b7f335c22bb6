"""The node's tasks run supervised: no failure of one ends the node (DESIGN.md, "Supervision")."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

log = logging.getLogger(__name__)

RESTART_MIN_S, RESTART_MAX_S = 0.5, 30.0  # backoff before a failed long-lived task runs again


async def supervised(fn: Callable[..., Any], args: tuple[Any, ...], restart: bool, owner: str) -> None:
    """Run `fn(*args)` so that its failure never ends the nursery it runs in: each failure is logged once (the
    first with its traceback, naming `owner`); with `restart`, it runs again after a backoff doubling from
    RESTART_MIN_S to RESTART_MAX_S. Cancellation propagates."""
    name, delay, failures = getattr(fn, "__qualname__", repr(fn)), RESTART_MIN_S, 0
    while True:
        began = trio.current_time()
        error: BaseException | None = None
        try:
            await fn(*args)
            return
        except Exception as e:  # noqa: BLE001 - never trio.Cancelled (a BaseException)
            error = e
        except BaseExceptionGroup as group:
            cancelled, rest = group.split(trio.Cancelled)
            if cancelled is not None:  # being cancelled: the rest is logged, the cancellation goes on
                if rest is not None:
                    log.error("task %s of %s failed while cancelled", name, owner, exc_info=rest)
                raise cancelled from None
            error = rest
        failures += 1
        if failures == 1:
            log.error("task %s of %s failed", name, owner, exc_info=error)
        else:
            log.warning("task %s of %s failed again (%d times): %s: %s", name, owner, failures,
                        type(error).__name__, error)
        if not restart:
            return
        if trio.current_time() - began > RESTART_MAX_S:
            delay = RESTART_MIN_S  # it had run a good while: a fresh failure, not a loop
        await trio.sleep(delay)
        delay = min(2 * delay, RESTART_MAX_S)
