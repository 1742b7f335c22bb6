"""Live serving figures and a sparkline of tokens/s."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.markup import escape
from textual.widgets import Sparkline, Static

from beeswarm.contributor.status import ServingFigures
from beeswarm.tui.widgets.units import size


class ServingPanel(Vertical):
    def compose(self) -> ComposeResult:
        yield Static(id="serving-figures")
        yield Sparkline([], id="serving-sparkline")

    def show(self, f: ServingFigures) -> None:
        self.query_one(Sparkline).data = list(f.history)
        self.query_one("#serving-figures", Static).update(
            f"{f.tokens_per_s:.1f} tok/s   sessions {f.sessions}\n"
            f"steps {f.steps}   tokens {f.tokens}\n"
            f"in   {size(f.raw_in)} raw, {size(f.wire_in)} wire\n"
            f"out  {size(f.raw_out)} raw, {size(f.wire_out)} wire\n"
            f"compression {f.compression_ratio:.2f}x\n"
            f"audits: {f.reveals} answered, {size(f.kept_bytes)} kept"
            + (f"\ncredit {f.credit or 0:,} layer-tokens   receipts {f.receipts}"
               + (f" ({f.receipts_waiting} to hand in)" if f.receipts_waiting else "")
               if f.credit is not None or f.receipts else "")
            + (f"\n[red]excluded from plans: {escape(f.excluded)}[/]" if f.excluded else ""))
