"""A trio loop in a thread of its own, driven from any other thread: what runs a node.

py-libp2p is trio-only while torch workers and Textual live elsewhere. `LoopThread.start(main)` runs
`main()` in trio in a daemon thread; `main` sets itself up, hands `use(nursery)` the nursery tasks
start in, then awaits `serve()`, which marks the loop ready (`start` returns) and returns once `stop()`
is asked. A loop that ends on its own after it was ready is a failure: `on_failure` callbacks run.
"""
from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from beeswarm.p2p.channel import reason
from beeswarm.p2p.errors import NodeError, NodeFailed
from beeswarm.p2p.supervisor import supervised

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 2.0


class LoopThread:
    """The loop of one node (`label`: its peer id, in thread names and logs). Nothing starts until `start()`."""

    def __init__(self, label: str):
        self.label = label
        # Set when the loop ended on an error after it was ready (nothing else stops it but `stop()`);
        # `on_failure` callbacks then run once, in the loop's thread: a process should exit non-zero.
        self.failure: BaseException | None = None
        self.on_failure: list[Callable[[BaseException], None]] = []
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None  # why it did not start
        self._stop: trio.Event | None = None
        self._nursery: trio.Nursery | None = None

    # lifecycle (any thread) -------------------------------------------------------------------
    def start(self, main: Callable[[], Awaitable[None]], timeout: float, on_exit: Callable[[], None]) -> None:
        """Run `main()` until it awaits `serve()` (at most `timeout` s); `on_exit()` runs in the thread at its end."""
        if self._thread is not None:
            raise NodeError("node already started")
        self._thread = threading.Thread(target=self._thread_main, args=(main, on_exit),
                                        name=f"p2p-{self.label[-6:]}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise NodeError(f"node did not start within {timeout} s")
        if self._error is not None:
            raise NodeError(f"node failed to start: {self._error}") from self._error

    def stop(self) -> None:
        """Ask `serve()` to return and wait for the thread to end (within about 2 s)."""
        if self._thread is None:
            return
        if self._token is not None and self._stop is not None:
            try:  # (not waiting for the loop to take it: a loop too busy to answer must not hold up the exit)
                self._token.run_sync_soon(self._stop.set)
            except trio.RunFinishedError:
                pass
        self._thread.join(STOP_TIMEOUT_S + 1)
        if self._thread.is_alive():
            log.warning("p2p thread of %s did not end in time", self.label)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._token is not None

    @property
    def running(self) -> bool:
        """Started, and neither stopped nor failed."""
        return self._thread is not None and self._thread.is_alive()

    def raise_if_failed(self) -> None:
        """Raise NodeFailed (one line: the root cause) if the loop ended on an error."""
        if self.failure is not None:
            raise NodeFailed(f"the p2p node stopped on an error: {reason(self.failure)}") from self.failure

    # in the loop ------------------------------------------------------------------------------
    def use(self, nursery: trio.Nursery) -> None:
        """Where `spawn` starts tasks from now on (`main`'s nursery)."""
        self._nursery = nursery

    async def serve(self) -> None:
        """The loop is ready: return once `stop()` is asked."""
        assert self._stop is not None
        self._ready.set()
        await self._stop.wait()

    # from any thread --------------------------------------------------------------------------
    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run async `fn` in the loop from another thread and return its result."""
        if self._token is None or not self._ready.is_set():
            raise NodeError("node is not running")
        try:
            return trio.from_thread.run(fn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            self.raise_if_failed()
            raise NodeError("node has stopped") from None
        except trio.Cancelled:  # the loop cancelled the call: it is stopping
            raise NodeError("node is stopping") from None
        except BaseExceptionGroup as e:
            if e.split(trio.Cancelled)[1] is None:  # nothing but cancellation: the node is stopping
                raise NodeError("node is stopping") from None
            raise

    def run_sync(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run sync `fn(*args)` in the loop now (from the loop, or any thread while it runs)."""
        if threading.current_thread() is self._thread or self._token is None:
            fn(*args)
        else:
            trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def spawn(self, fn: Callable[..., Any], args: tuple[Any, ...], restart: bool) -> None:
        """Start async `fn(*args)` in the loop (`supervisor.supervised`: logged if it raises, run again after a
        backoff if `restart`); nothing before `use` or once the loop is stopping."""
        if self._nursery is None:
            return
        start = functools.partial(self._nursery.start_soon, supervised, fn, args, restart, self.label,
                                  name=getattr(fn, "__qualname__", repr(fn)))
        try:
            self.run_sync(start)
        except trio.RunFinishedError:
            pass
        except RuntimeError as e:  # "Nursery is closed to new arrivals": the node is stopping, nothing to run
            log.debug("not starting %s: %s", getattr(fn, "__qualname__", fn), e)

    # the thread -------------------------------------------------------------------------------
    def _thread_main(self, main: Callable[[], Awaitable[None]], on_exit: Callable[[], None]) -> None:
        try:
            trio.run(self._run, main)
        except BaseException as e:  # noqa: BLE001 - report, never crash the process
            if not self._ready.is_set():
                self._error = e
            elif self._stopping:  # asked to stop: an untidy exit, not a failure
                log.warning("p2p node %s stopped with an error: %s", self.label, reason(e))
            else:
                self._failed(e)
        else:
            if self._ready.is_set() and not self._stopping:
                self._failed(NodeError("the node's loop ended without stop()"))
        finally:
            on_exit()
            self._ready.set()

    async def _run(self, main: Callable[[], Awaitable[None]]) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        await main()

    @property
    def _stopping(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    def _failed(self, error: BaseException) -> None:
        self.failure = error
        log.error("p2p node %s stopped on an error", self.label, exc_info=error)
        for callback in list(self.on_failure):
            try:
                callback(error)
            except Exception:  # noqa: BLE001
                log.exception("on_failure callback of %s failed", self.label)
