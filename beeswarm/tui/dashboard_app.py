"""`beeswarm contribute` on a terminal: start-up progress, the swarm, this node's shard and what it serves.

The app renders `Contributor.status()` twice a second and sends the keys' commands; the contributor
runs in a worker thread and owns all networking and model work.
"""
from __future__ import annotations

import logging

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Header

from beeswarm.contributor.contributor import LEAVE_GRACE_S, Contributor
from beeswarm.contributor.lifecycle import Phase
from beeswarm.contributor.status import ContributorStatus
from beeswarm.tui.widgets.help_screen import HelpScreen
from beeswarm.tui.widgets.identity_panel import IdentityPanel
from beeswarm.tui.widgets.log_panel import LogPanel, PanelHandler
from beeswarm.tui.widgets.peers_table import PeersTable
from beeswarm.tui.widgets.phase_bars import PhaseBars
from beeswarm.tui.widgets.serving_panel import ServingPanel
from beeswarm.tui.widgets.shard_panel import ShardPanel

HELP = f"""keys:
  q   leave the swarm gracefully (in-flight steps get up to {LEAVE_GRACE_S:.0f} s) and quit
  p   pause serving / resume: the coordinator plans around a paused node
  b   benchmark the device again and publish the new figures
  ?   this help

Panels: this node and its swarm; start-up progress; this node's shard; what it serves \
(tokens/s over the last seconds, bytes raw and on the wire); the peers (RTT and upload measured \
from this node); the log."""

REFRESH_S = 0.5
LOG_S = 0.2  # the log panel is written this often
PANEL_TITLES = {"identity": "node", "phases": "start-up", "shard": "my shard", "serving": "serving",
                "peers": "peers", "log": "log"}
log = logging.getLogger(__name__)


class DashboardApp(App):
    CSS_PATH = "dashboard.tcss"
    TITLE = "beeswarm contribute"
    BINDINGS = [Binding("q", "leave", "Leave"), Binding("p", "pause", "Pause/resume"),
                Binding("b", "rebench", "Re-benchmark"), Binding("question_mark", "help", "Help", key_display="?"),
                Binding("ctrl+c", "leave", "Leave", show=False, priority=True)]

    def __init__(self, contributor: Contributor, start: bool = True):
        """`start=False`: render `contributor.status()` without running it (for a contributor run elsewhere)."""
        super().__init__()
        self.contributor, self.start_backend = contributor, start
        self.failure: BaseException | None = None
        self._handler: PanelHandler | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="top"):
            with Vertical(id="left"):
                yield IdentityPanel(id="identity")
                yield PhaseBars(id="phases")
            with Vertical(id="right"):
                yield ShardPanel(id="shard")
                yield ServingPanel(id="serving")
        yield PeersTable(id="peers")
        yield LogPanel(id="log", max_lines=2000)
        yield Footer()

    def on_mount(self) -> None:
        for panel, title in PANEL_TITLES.items():
            self.query_one(f"#{panel}").border_title = title
        self._handler = PanelHandler()
        logging.getLogger().addHandler(self._handler)
        self.refresh_status()
        self.set_interval(REFRESH_S, self.refresh_status)
        self.set_interval(LOG_S, self.write_log)
        if self.start_backend:
            self.serve()

    def refresh_status(self) -> None:
        try:
            status = self.contributor.status()
        except Exception:  # noqa: BLE001 - a figure that could not be read this time: log it, keep the app
            log.exception("could not read the contributor's status")
            return
        self.show(status)

    def write_log(self) -> None:
        if self._handler is not None and (lines := self._handler.lines()):
            self.query_one(LogPanel).write_lines(lines)

    def show(self, s: ContributorStatus) -> None:
        self.sub_title = f"{s.state}, {s.serving.tokens_per_s:.1f} tok/s"
        self.query_one(IdentityPanel).show(s)
        self.query_one(PhaseBars).show(s.progress)
        self.query_one(ShardPanel).show(s.shard)
        self.query_one(ServingPanel).show(s.serving)
        self.query_one(PeersTable).show(s.peers)

    @work(thread=True, exclusive=True, group="contributor")
    def serve(self) -> None:
        try:
            self.contributor.run()
        except BaseException as e:  # noqa: BLE001 - shown in the app; the command exits non-zero
            self.failure = e
            log.error("the contributor stopped: %s", e)
        if self.is_running:
            self.call_from_thread(self.exit)

    def action_leave(self) -> None:
        if self.contributor.stopping.is_set() or not self.start_backend:
            self.exit()
            return
        self.notify(f"Leaving the swarm (up to {LEAVE_GRACE_S:.0f} s for in-flight steps)...")
        self.contributor.stop()  # the worker exits the app once the contributor has left

    def action_pause(self) -> None:
        if not self.contributor.ready:
            self.notify("Not in the swarm yet.", severity="warning")
        elif self.contributor.phase is Phase.PAUSED:
            self.contributor.resume()
            self.notify("Serving again: the coordinator will plan this node back in.")
        else:
            self.contributor.pause()
            self.notify("Paused: the coordinator re-plans around this node.")

    def action_rebench(self) -> None:
        if self.contributor.rebench():
            self.notify("Benchmarking the device again...")
        else:
            self.notify("Not now: a benchmark is running or the node is still starting.", severity="warning")

    def action_help(self) -> None:
        self.push_screen(HelpScreen(HELP))

    def on_unmount(self) -> None:
        if self._handler is not None:
            logging.getLogger().removeHandler(self._handler)
        self.contributor.stop()
