"""Who this node is and which swarm it is in: peer id, swarm, coordinator, term/epoch, private or open."""
from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from beeswarm.contributor.status import ContributorStatus


class IdentityPanel(Static):
    def show(self, s: ContributorStatus) -> None:
        coordinator = "-" if s.coordinator is None else ("this node" if s.coordinator == s.peer else s.coordinator)
        rows = [("peer", s.peer), ("swarm", f"{s.swarm} ({'private' if s.private else 'open'}), model {s.model}"),
                ("coordinator", coordinator), ("term/epoch", f"{s.term}/{s.epoch}"), ("state", s.state)]
        if s.addrs:
            rows.append(("address", s.addrs[0]))
        text = Text()
        for i, (name, value) in enumerate(rows):
            text.append(f"{name:<12}", style="bold")  # "coordinator" + a space
            text.append(value + ("\n" if i < len(rows) - 1 else ""))
        self.update(text)
