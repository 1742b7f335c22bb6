"""The contribute dashboard driven by Textual's pilot, its contributor real and joined by real processes."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import pytest_asyncio
from textual.pilot import Pilot
from textual.widgets import Sparkline
from transformers import AutoTokenizer

from beeswarm.client.swarm import SwarmClient
from beeswarm.contributor.contributor import Contributor, ContributorOptions
from beeswarm.contributor.lifecycle import Phase
from beeswarm.contributor.local_swarm import budgets
from beeswarm.generation.sampling import SamplingParams
from beeswarm.p2p.identity import ephemeral
from beeswarm.protocol.coordinator import stages_of
from beeswarm.shard import EntryModel
from beeswarm.tui.dashboard_app import DashboardApp
from beeswarm.tui.widgets.log_panel import LogPanel
from beeswarm.tui.widgets.peers_table import COLUMNS, PeersTable
from beeswarm.tui.widgets.phase_bars import PhaseRow
from helpers import (
    LOCAL,
    in_terminal,
    lines_of,
    read_until,
    reference_greedy,
    start_contributors,
    threads_left,
    until,
    wait_for,
)

pytestmark = pytest.mark.slow  # starts beeswarm processes: not in `make test-fast`


STATE = COLUMNS.index("state")


def table(app) -> dict[str, list[str]]:
    """The peers table as the user sees it: short id -> the row's cells."""
    t = app.query_one(PeersTable)
    rows = [[str(c) for c in t.get_row_at(i)] for i in range(t.row_count)]
    return {row[0].removeprefix("* "): row for row in rows}


def spawn(tiny_llama, budget: int, join: str, folder) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "BEESWARM_CONFIG_DIR": str(folder), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("BEESWARM_IDENTITY", None)
    folder.mkdir(parents=True)
    with open(folder / "stderr.log", "w") as log:  # read by an assertion's message when the child fails
        proc = subprocess.Popen([sys.executable, "-m", "beeswarm", "--log-level", "INFO", "contribute", "--headless",
                                 "--model", str(tiny_llama), "--listen", LOCAL[0], "--max-memory", str(budget),
                                 "--heartbeat", "1", "--join", join], stdout=subprocess.PIPE, stderr=log, text=True,
                                env=env)
    return proc, read_until(lines_of(proc), "peer ", 60)[0].split()[1]


def in_plan(contributor: Contributor, peer: str) -> bool:
    return bool(stages_of(contributor.coordinator.state.target, peer))


@dataclass
class Scenario:
    """One contributor and its dashboard, through the steps of `TestDashboard`."""

    model: Path
    folder: Path
    half: int  # a memory budget for half the model
    contributor: Contributor
    app: DashboardApp
    pilot: Pilot
    before: set  # the threads that were running before the contributor started
    children: dict[str, tuple[subprocess.Popen, str]] = field(default_factory=dict)  # name -> (process, peer)

    @property
    def me(self) -> str:
        return self.contributor.node.peer_id

    def spawn(self, name: str) -> str:
        """Start another contributor, holding half the model, that joins this one; returns its peer id."""
        proc, peer = spawn(self.model, self.half, self.contributor.node.addrs[0], self.folder / name)
        self.children[name] = (proc, peer)
        return peer

    def stop_children(self) -> None:
        for proc, _ in self.children.values():
            proc.terminate()
            proc.wait(20)


@pytest_asyncio.fixture
async def scenario(tiny_llama, tmp_path_factory):
    """A real contributor (benchmark, p2p node, coordinator) in a running DashboardApp."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)  # what `contribute` logs on its dashboard
    half = budgets(str(tiny_llama), 2)[0]
    before = set(threading.enumerate())
    contributor = Contributor.create(ephemeral(), ContributorOptions(model=str(tiny_llama), listen=LOCAL, device="cpu",
                                                             dtype="float32", max_memory=half, interval=1.0),
                                     say=lambda event: logging.getLogger("test").info("%s", event.text))
    app = DashboardApp(contributor)
    state = None
    try:
        async with app.run_test(size=(140, 50)) as pilot:
            state = Scenario(tiny_llama, tmp_path_factory.mktemp("dashboard"), half, contributor, app, pilot, before)
            yield state
    finally:
        contributor.stop()
        if state is not None:
            state.stop_children()
        root.setLevel(level)


async def step_the_node_starts_benchmarks_and_shows_its_identity(dash: Scenario) -> None:
    app, pilot = dash.app, dash.pilot
    await until(pilot, lambda: dash.contributor.ready, what="the node to start")
    await until(pilot, lambda: any(r.progress.key == "bench" and r.progress.finished
                                   for r in app.query(PhaseRow)), what="the benchmark's finished bar")
    assert dash.me in str(app.query_one("#identity").render())

async def step_a_second_node_is_planned_in_and_shown_serving_with_its_rtt(dash: Scenario) -> None:
    # A second node holding half the model: the plan needs both; the table shows both serving.
    app, pilot, me = dash.app, dash.pilot, dash.me
    peer_b = dash.spawn("b")
    await until(pilot, lambda: len(table(app)) == 2 and all(r[STATE] == "serving" for r in table(app).values()),
                what="both nodes serving")
    assert table(app)[me[-8:]][2] != "-" and table(app)[peer_b[-8:]][2] != "-"  # layers shown
    await until(pilot, lambda: any(k.startswith("probe ") and p.finished for k, p in
                                   ((r.progress.key, r.progress) for r in app.query(PhaseRow))),
                what="a finished link probe bar")
    await until(pilot, lambda: table(app)[peer_b[-8:]][5] != "-", what="the RTT to the other node")

async def step_traffic_shows_in_the_serving_figures(dash: Scenario) -> None:
    # Traffic through the swarm shows in the serving figures (generated beside the app's loop).
    app, pilot, contributor = dash.app, dash.pilot, dash.contributor

    def generate() -> None:
        client = SwarmClient.create(EntryModel(dash.model, "float32", "cpu"), [contributor.node.addrs[0]],
                                    interval=1.0, listen=LOCAL).start()
        try:
            client.generate([3, 14, 15, 92], 12, SamplingParams())
        finally:
            client.close()

    await asyncio.to_thread(generate)
    served = contributor.status().serving
    assert served.tokens >= 12 and served.raw_out > 0 and served.wire_out > 0
    await until(pilot, lambda: f"tokens {served.tokens}" in str(app.query_one("#serving-figures").render()),
                what="the served tokens on screen")
    assert "compression" in str(app.query_one("#serving-figures").render())
    assert any("loading layers" in line for line in app.query_one(LogPanel).lines)
    await until(pilot, lambda: max(app.query_one(Sparkline).data, default=0) > 0,
                what="tokens/s in the sparkline")

async def step_p_pauses_the_node_out_of_the_plan_and_resumes_it(dash: Scenario) -> None:
    # p: paused; the coordinator plans a third node in instead of this one.
    app, pilot, contributor, me = dash.app, dash.pilot, dash.contributor, dash.me
    peer_c = dash.spawn("c")
    await until(pilot, lambda: peer_c[-8:] in table(app), what="the third node")
    await pilot.press("p")
    await until(pilot, lambda: table(app)[me[-8:]][STATE] == "paused", what="the paused state")
    await until(pilot, lambda: contributor.coordinator.state.target and not in_plan(contributor, me)
                and in_plan(contributor, peer_c), what="a plan around the paused node")
    await until(pilot, lambda: table(app)[me[-8:]][2] == "-", what="the span given up")
    await pilot.press("p")
    await until(pilot, lambda: table(app)[me[-8:]][STATE] in ("idle", "loading", "serving"), what="resuming")

async def step_a_node_leaving_disappears_from_the_table(dash: Scenario) -> None:
    b, peer_b = dash.children["b"]
    b.terminate()
    assert b.wait(20) == 0, (dash.folder / "b" / "stderr.log").read_text()[-3000:]
    await until(dash.pilot, lambda: peer_b[-8:] not in table(dash.app), what="the departed node's row to go")

async def step_b_measures_the_device_again(dash: Scenario) -> None:
    # b measures the device again and publishes the new figures.
    app, pilot = dash.app, dash.pilot
    pressed = time.monotonic()
    await pilot.press("b")
    await until(pilot, lambda: any("re-benchmarked" in line for line in app.query_one(LogPanel).lines),
                what="the second benchmark")
    bench = next(p for p in dash.contributor.status().progress if p.key == "bench")
    assert bench.started >= pressed and bench.finished  # measured again, not read from the cache

async def step_help_then_q_leaves_the_swarm_and_ends_the_app(dash: Scenario) -> None:
    # ? shows help; q leaves the swarm and the app ends by itself once the contributor is gone.
    app, pilot = dash.app, dash.pilot
    await pilot.press("question_mark")
    assert "leave the swarm" in str(app.screen.query_one("#help").query("Static").first().render())
    await pilot.press("escape")
    await pilot.press("q")
    await until(pilot, lambda: not app.is_running, timeout=20, what="the app to quit")
    assert dash.contributor.phase is Phase.STOPPED and app.failure is None
    dash.stop_children()  # their output readers are the test's threads, not the app's
    # polled off the loop, which the app's own shutdown still needs
    assert not (left := await asyncio.to_thread(threads_left, dash.before)), f"threads left behind: {left}"


async def test_the_dashboard_follows_its_node_serving_pausing_a_node_leaving_a_rebench_and_leaving(scenario):
    """One scenario, its steps in order (each builds on the ones before), in one test."""
    for step in (step_the_node_starts_benchmarks_and_shows_its_identity,
                 step_a_second_node_is_planned_in_and_shown_serving_with_its_rtt,
                 step_traffic_shows_in_the_serving_figures,
                 step_p_pauses_the_node_out_of_the_plan_and_resumes_it,
                 step_a_node_leaving_disappears_from_the_table,
                 step_b_measures_the_device_again,
                 step_help_then_q_leaves_the_swarm_and_ends_the_app):
        await step(scenario)


@pytest.fixture
def cli_env(tmp_path):
    env = {**os.environ, "BEESWARM_CONFIG_DIR": str(tmp_path / "config"), "PYTHONUNBUFFERED": "1"}
    env.pop("BEESWARM_IDENTITY", None)
    return env


def test_contribute_opens_the_dashboard_on_a_terminal_and_q_leaves(tiny_llama, cli_env):
    argv = [sys.executable, "-m", "beeswarm", "contribute", "--model", str(tiny_llama), "--listen", LOCAL[0]]
    code, screen = in_terminal(argv, cli_env, b"Re-benchmark", b"q", timeout=120)
    assert code == 0 and b"start-up" in screen and b"Traceback" not in screen


def test_contribute_without_a_terminal_runs_headless(tiny_llama, cli_env):
    proc = subprocess.Popen([sys.executable, "-m", "beeswarm", "contribute", "--model", str(tiny_llama),
                             "--listen", LOCAL[0]], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, text=True, env=cli_env)
    try:
        read_until(lines_of(proc), "peer ", 60)  # today's log lines, not a screen
    finally:
        proc.terminate()
    assert proc.wait(20) == 0


def test_contribute_with_a_missing_model_says_so_before_any_screen(cli_env, tmp_path):
    argv = [sys.executable, "-m", "beeswarm", "contribute", "--model", str(tmp_path / "nowhere")]
    code, screen = in_terminal(argv, cli_env, b"", b"", timeout=60)
    assert code == 2 and b"beeswarm: error: model" in screen
    assert b"\x1b[?1049h" not in screen  # the dashboard's alternate screen never opened


def test_a_terminal_that_stops_reading_never_freezes_the_node(tiny_llama, cli_env, tmp_path):
    """Ctrl-S, a slow SSH link: the dashboard's terminal stops reading for 30 s while a newcomer joins (the swarm
    re-plans, and the node logs under its locks) and users chat through the node (sessions open and close, each
    logged). The node keeps beating and serving: the swarm never drops it, and every chat returns transformers'
    greedy text. Then the terminal reads again, and `q` leaves as ever."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    from beeswarm.client.status import SwarmObserver

    budget = budgets(str(tiny_llama), 2)[0]
    procs: list = []
    pid = fd = observer = None

    def members(serving: bool = False) -> dict[str, float]:  # contributors the swarm sees: peer -> heartbeat age
        return {m.peer: m.heartbeat_age_s for m in observer.report().members
                if m.role == "contributor" and (m.spans or not serving)}

    def read(seconds: float, until: bytes | None = None) -> bytes:
        """What the terminal shows in `seconds`, or until `until` is shown."""
        seen, deadline = b"", time.monotonic() + seconds
        while time.monotonic() < deadline and (until is None or until not in seen):
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    seen += os.read(fd, 65536)
                except OSError:
                    break
        return seen

    try:
        peers, boot = start_contributors(procs, tiny_llama, 1, budget, cli_env, tmp_path)
        argv = [sys.executable, "-m", "beeswarm", "contribute", "--model", str(tiny_llama), "--listen", LOCAL[0],
                "--max-memory", str(budget), "--heartbeat", "1", "--join", boot]
        pid, fd = pty.fork()
        if pid == 0:  # the child: the dashboard on a wide terminal (more to draw, so a full buffer comes sooner)
            try:
                fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 240, 0, 0))
                os.execve(argv[0], argv, {**cli_env, "TERM": "xterm-256color",
                                          "BEESWARM_CONFIG_DIR": str(tmp_path / "d")})
            finally:
                os._exit(127)
        assert b"Re-benchmark" in read(60, b"Re-benchmark")
        observer = SwarmObserver.create([boot], interval=1.0, listen=LOCAL).start()  # a swarm-wide view
        # the terminal reads on until the dashboard's node serves layers
        dashboard = wait_for(lambda: read(0.5) is not None and next(iter(set(members(serving=True)) - set(peers)),
                                                                    None), 90, "the dashboard node to serve")
        # the terminal stops reading (its buffer fills within seconds); a newcomer joins: a re-plan, and log lines
        # on the dashboard's node
        start_contributors(procs, tiny_llama, 1, budget, cli_env, tmp_path, join=boot)
        chats = [subprocess.Popen([sys.executable, "-m", "beeswarm", "chat", "--join", boot, "--model", str(tiny_llama),
                                   "--greedy", "--no-spec", "--json", "--max-new-tokens", "8", "--heartbeat", "1",
                                   "--prompt", "def f(x):"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True, env={**cli_env, "BEESWARM_CONFIG_DIR": str(tmp_path / f"chat{i}")})
                 for i in range(2)]
        procs += chats
        stalled = time.monotonic() + 30
        while time.monotonic() < stalled:
            ages = members()
            assert dashboard in ages and ages[dashboard] < 3, f"the stalled dashboard's node was dropped: {ages}"
            time.sleep(0.5)  # looked at every 0.5 s for 30 s: it is never dropped
        expected = reference_greedy(tiny_llama, AutoTokenizer.from_pretrained(tiny_llama).encode("def f(x):"), 8)
        for chat in chats:
            out, _ = chat.communicate(timeout=120)
            assert chat.returncode == 0 and json.loads(out)["tokens"] == expected
        read(2)  # the terminal reads again
        os.write(fd, b"q")
        read(30)
        _, status = os.waitpid(pid, 0)
        pid = None
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        if observer is not None:
            observer.close()
        if pid is not None:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        if fd is not None:
            os.close(fd)
        for p in procs:
            p.kill()
