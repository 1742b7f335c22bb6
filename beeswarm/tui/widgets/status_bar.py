"""One line of figures under the conversation."""
from __future__ import annotations

from dataclasses import dataclass

from textual.widgets import Static

from beeswarm.tui.widgets.units import num


@dataclass
class ChatFigures:
    tokens_per_s: float | None = None
    ttft_s: float | None = None
    accepted_per_round: float | None = None
    speculating: bool = False
    stages: int | None = None
    ring_ms: float | None = None
    state: str = "ready"
    audits: tuple[int, int, int] | None = None  # (run, passed, failed); None: audits off


def render_audits(audits: tuple[int, int, int] | None) -> str:
    if audits is None:
        return "audits off"
    run, passed, failed = audits
    return f"audits {passed}/{run} passed" + (f", {failed} FAILED" if failed else "")


def render_figures(f: ChatFigures) -> str:
    spec = f"spec on, {num(f.accepted_per_round, '.2f')} accepted/round" if f.speculating else "spec off"
    route = "-" if f.stages is None else f"{f.stages} stages"
    return (f"{f.state} | {num(f.tokens_per_s, '.1f')} tok/s | TTFT {num(f.ttft_s, '.2f')} s | {spec} | "
            f"route {route} | ring {num(f.ring_ms, '.0f')} ms | {render_audits(f.audits)}")


class StatusBar(Static):
    def show(self, figures: ChatFigures) -> None:
        self.update(render_figures(figures))
