"""The swarm's members as this node sees them (links measured from here)."""
from __future__ import annotations

from textual.widgets import DataTable

from beeswarm.contributor.status import PeerRow
from beeswarm.tui.widgets.units import num, span

COLUMNS = ("peer", "role", "layers", "device", "tok/s", "RTT ms", "up Mbit/s", "state", "reach")


def cells(row: PeerRow) -> tuple[str, ...]:
    return (("* " if row.me else "") + row.peer[-8:], row.role, span(row.layers), row.device,
            f"{row.tokens_per_s:.1f}", num(row.rtt_ms, ".1f"), num(row.up_mbps, ".0f"), row.state, row.reach)


class PeersTable(DataTable):
    def on_mount(self) -> None:
        self.add_columns(*COLUMNS)
        self.cursor_type = "none"

    def show(self, rows: tuple[PeerRow, ...]) -> None:
        self.clear()
        for row in rows:
            self.add_row(*cells(row), key=row.peer)
