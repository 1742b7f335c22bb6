"""Start-up progress: one bar per phase (device benchmark, link probes, downloads, span loading)."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, ProgressBar

from beeswarm.contributor.status import Progress
from beeswarm.tui.widgets.units import size


def detail(p: Progress) -> str:
    if p.error:
        return f"failed: {p.error[:60]}"
    if p.unit == "B":
        total = f" of {size(p.total)}" if p.total else ""
        rate = f", {size(p.rate)}/s" if p.rate and not p.finished else ""
        return f"{size(p.done)}{total}{rate}"
    if p.total is None:
        return "waiting"
    return "done" if p.finished else f"{p.done:.0f}/{p.total:.0f}"


class PhaseRow(Horizontal):
    def __init__(self, progress: Progress):
        super().__init__(classes="phase")
        self.progress = progress

    def compose(self) -> ComposeResult:
        yield Label(self.progress.label, classes="phase-label")
        yield ProgressBar(show_eta=False, show_percentage=False)
        yield Label("", classes="phase-detail")

    def on_mount(self) -> None:
        self.show(self.progress)

    def show(self, p: Progress) -> None:
        self.progress = p
        self.query_one(".phase-label", Label).update(p.label)
        bar = self.query_one(ProgressBar)
        bar.update(total=p.total if p.total else None, progress=p.done)
        self.query_one(".phase-detail", Label).update(detail(p))
        self.set_class(p.error is not None, "failed")


class PhaseBars(Vertical):
    """One bar per phase; the oldest finished bars leave once newer work needs the room."""

    MAX_ROWS = 6

    def show(self, progress: tuple[Progress, ...]) -> None:
        # running work first (oldest on top), then what finished, newest first
        live = sorted(progress, key=lambda p: (p.finished, -p.started if p.finished else p.started))[: self.MAX_ROWS]
        rows = list(self.query(PhaseRow))
        if [row.progress.key for row in rows] == [p.key for p in live]:
            for row, p in zip(rows, live):
                row.show(p)
        else:  # the order changed: lay the rows out again
            self.remove_children()
            self.mount_all(PhaseRow(p) for p in live)
