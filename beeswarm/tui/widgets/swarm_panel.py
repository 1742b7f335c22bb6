"""The swarm's nodes and the layers each serves (the demo's side panel)."""
from __future__ import annotations

from textual.widgets import DataTable


class SwarmPanel(DataTable):
    def on_mount(self) -> None:
        self.add_columns("node", "role", "layers", "state")
        self.cursor_type = "none"

    def show(self, rows: list[tuple[str, str, str, str]]) -> None:
        self.clear()
        for row in rows:
            self.add_row(*row)
