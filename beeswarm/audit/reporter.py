"""What the entry tells the coordinator of its audits: evidence against a stage (the coordinator judges it and
answers with its verdict), and each pass (`Passed`: the stage's own signed commitment to the session, the layers
and steps checked), which the coordinator's probation ledger counts."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from beeswarm.audit import probation
from beeswarm.p2p.errors import NodeError
from beeswarm.p2p.node import Node
from beeswarm.protocol import RemoteError, Span
from beeswarm.protocol.audit import Evidence, Passed, Verdict
from beeswarm.protocol.rpcs import EVIDENCE, PASSED
from beeswarm.protocol.step import Commit

log = logging.getLogger(__name__)

VOUCH_DRAIN_S = 3.0
EVIDENCE_TIMEOUT_S = 120.0  # the coordinator recomputes before it answers
MAX_KNOWN = 4096  # (coordinator, stage) pairs whose passes from this entry are counted here


class CoordinatorReporter:
    def __init__(self, node: Node, coordinator: Callable[[], str | None]):
        """`coordinator()`: whom to tell (None: nobody leads now)."""
        self.node, self.coordinator = node, coordinator
        self._cond = threading.Condition()
        self._vouching = 0  # passes on their way to the coordinator
        self._vouched: dict[tuple[str, str], int] = {}  # (coordinator, stage) -> passes it took from this entry

    def report(self, evidence: Evidence) -> Verdict | None:
        """Send signed evidence to the coordinator; its verdict, or None (nobody to tell, or no answer)."""
        coordinator = self.coordinator()
        if coordinator is None:
            log.warning("no coordinator to send the evidence against %s to", evidence.accused)
            return None
        try:
            verdict = self.node.request(coordinator, EVIDENCE, evidence, timeout=EVIDENCE_TIMEOUT_S)
        except (RemoteError, NodeError, TimeoutError) as e:
            log.warning("the coordinator did not take the evidence against %s: %s", evidence.accused, e)
            return None
        return verdict

    def vouch(self, session: str, commit: Commit, layers: Sequence[Span], steps: int) -> None:
        """Tell the coordinator, in the node's loop: the generation waiting on this audit does not wait for it."""
        coordinator = self.coordinator()
        if coordinator is None or coordinator == self.node.peer_id:
            return
        with self._cond:
            if self._vouched.get((coordinator, commit.stage), 0) >= probation.PER_ENTRY:
                return  # its ledger counts no more of this stage's passes from this entry
            self._vouching += 1
        passed = Passed(session=session, commit=commit, layers=tuple(layers), steps=steps)
        self.node.spawn(self._vouch_async, coordinator, commit.stage, passed)

    async def _vouch_async(self, coordinator: str, stage: str, passed: Passed) -> None:
        try:
            await self.node.requests.request(coordinator, PASSED, passed, timeout=VOUCH_DRAIN_S)
            with self._cond:
                if len(self._vouched) >= MAX_KNOWN:
                    self._vouched.clear()
                self._vouched[coordinator, stage] = self._vouched.get((coordinator, stage), 0) + 1
        except (RemoteError, NodeError, TimeoutError) as e:
            log.debug("the coordinator did not take a pass: %s", e)
        finally:
            with self._cond:
                self._vouching -= 1
                self._cond.notify_all()

    def drain(self, timeout: float = VOUCH_DRAIN_S) -> None:
        """Wait up to `timeout` for the passes still on their way (a chat that ends with its generation would
        otherwise lose the last ones)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._vouching, timeout)
