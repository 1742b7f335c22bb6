"""This node's shard: the layers it serves, how much is offloaded, memory used and free."""
from __future__ import annotations

from textual.widgets import Static

from beeswarm.contributor.status import ShardFigures
from beeswarm.tui.widgets.units import size, span


class ShardPanel(Static):
    def show(self, shard: ShardFigures | None) -> None:
        if shard is None:
            self.update("no shard yet")
            return
        free = max(0, shard.memory_budget - shard.memory_used)
        self.update(f"layers   {span(shard.layers)}\n"
                    f"offload  {100 * shard.offload_fraction:.0f}%\n"
                    f"memory   {size(shard.memory_used)} used, {size(free)} free")
