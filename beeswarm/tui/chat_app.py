"""`beeswarm chat` on a terminal: a conversation through the swarm, streamed as tokens arrive."""
from __future__ import annotations

from collections.abc import Callable

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Header, Input

from beeswarm.client.chat import ChatSession, Reply
from beeswarm.client.dataplane import StageFailed
from beeswarm.client.swarm import NoRoute
from beeswarm.tui.widgets.status_bar import ChatFigures, StatusBar
from beeswarm.tui.widgets.swarm_panel import SwarmPanel
from beeswarm.tui.widgets.transcript import Transcript

HELP = """commands:
  /reset       forget the conversation
  /temp X      sampling temperature (0: greedy)
  /spec on|off speculative decoding with the local draft
  /route       the stages the last reply went through
  /help        this text
Ctrl-C stops a reply; Ctrl-Q leaves."""


class ChatApp(App):
    CSS_PATH = "chat.tcss"
    TITLE = "beeswarm chat"
    BINDINGS = [Binding("ctrl+c", "stop_reply", "Stop reply", priority=True),
                Binding("ctrl+q", "quit", "Quit", priority=True)]

    def __init__(self, session: ChatSession, swarm_rows: Callable[[], list[tuple[str, str, str, str]]] | None = None,
                 ring_ms: Callable[[], float | None] | None = None):
        super().__init__()
        self.session, self.swarm_rows, self.ring_ms = session, swarm_rows, ring_ms
        self.figures = ChatFigures(speculating=session.speculating, audits=session.audits())
        self.last_reply: Reply | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="conversation"):
                yield Transcript()
                yield Input(placeholder="Say something, or /help", id="prompt")
            if self.swarm_rows:
                yield SwarmPanel()
        yield StatusBar()
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(StatusBar).show(self.figures)
        self.query_one(Input).focus()
        if self.swarm_rows:
            self._refresh_swarm()
            self.set_interval(2.0, self._refresh_swarm)

    def _refresh_swarm(self) -> None:
        assert self.swarm_rows is not None, "scheduled by on_mount only when there is a swarm panel"
        self.query_one(SwarmPanel).show(self.swarm_rows())

    # input -----------------------------------------------------------------------------------------
    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        event.input.value = ""
        if not text:
            return
        if text.startswith("/"):
            self.command(text)
        elif self.session.busy:
            self.notify("A reply is still coming: Ctrl-C stops it.")
        else:
            self.query_one(Transcript).add_user(text)
            self._set(state="generating")
            self.reply(text)

    def command(self, text: str) -> None:
        transcript = self.query_one(Transcript)
        name, _, arg = text.partition(" ")
        arg = arg.strip()
        try:
            if name == "/reset":
                self.session.reset()
                transcript.clear()
                transcript.add_note("(conversation reset)")
            elif name == "/temp":
                self.session.set_temperature(float(arg))
                transcript.add_note(f"(temperature {self.session.params.temperature})")
            elif name == "/spec" and arg in ("on", "off"):
                self.session.set_speculation(arg == "on")
                self._set(speculating=self.session.speculating, accepted_per_round=None)
                transcript.add_note(f"(speculative decoding {arg})")
            elif name == "/route":
                route = self.last_reply.route if self.last_reply else ()
                transcript.add_note("\n".join(f"layers {s.span} on {s.node}" for s in route)
                                    or "(no reply yet)")
            elif name == "/help":
                transcript.add_note(HELP)
            elif name == "/quit":
                self.exit()
            else:
                transcript.add_note(f"unknown command {text!r}; /help lists them", error=True)
        except ValueError as e:
            transcript.add_note(f"{name}: {e}", error=True)

    def action_stop_reply(self) -> None:
        if self.session.busy:
            self.session.stop()

    # the reply, in a worker thread -----------------------------------------------------------------
    @work(thread=True, exclusive=True, group="reply")
    def reply(self, text: str) -> None:
        transcript = self.query_one(Transcript)
        try:
            reply = self.session.send(text, lambda piece: self._ui(transcript.append_reply, piece),
                                      lambda kept: self._ui(transcript.replace_reply, kept))
        except NoRoute as e:
            self._ui(self._failed, f"{e}. Is the swarm up? Check the address you joined.")
        except StageFailed as e:
            self._ui(self._failed, f"the swarm kept failing ({e}); try again in a moment.")
        except ValueError as e:
            self._ui(self._failed, str(e))
        else:
            self._ui(self._replied, reply)

    def _ui(self, fn, *args) -> None:
        """Run `fn` in the app's loop from the worker; nothing to show once the app has closed."""
        if self.is_running:
            try:
                self.call_from_thread(fn, *args)
            except RuntimeError:  # closed between the check and the call
                pass

    def _replied(self, reply: Reply) -> None:
        self.last_reply = reply
        transcript = self.query_one(Transcript)
        transcript.end_reply()
        if reply.stopped:
            transcript.add_note(f"(stopped after {reply.tokens} tokens)")
        self._set(state="stopped" if reply.stopped else "ready", tokens_per_s=reply.tokens_per_s,
                  ttft_s=reply.ttft_s or self.figures.ttft_s, accepted_per_round=reply.accepted_per_round,
                  stages=len(reply.route) or self.figures.stages,
                  ring_ms=self.ring_ms() if self.ring_ms else None, audits=self.session.audits())

    def _failed(self, message: str) -> None:
        self.query_one(Transcript).add_note(message, error=True)
        self._set(state="error")

    def _set(self, **changes) -> None:
        for key, value in changes.items():
            setattr(self.figures, key, value)
        self.query_one(StatusBar).show(self.figures)

    def on_unmount(self) -> None:
        self.session.stop()  # a reply in flight ends at its next token; the worker thread then returns
