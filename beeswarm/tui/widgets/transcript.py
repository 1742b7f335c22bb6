"""The conversation: user turns, replies growing token by token, notes and errors."""
from __future__ import annotations

from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static


class Transcript(VerticalScroll):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._reply: Static | None = None
        self._reply_text = ""

    def add_user(self, text: str) -> None:
        self._reply = None
        self.mount(Static(Text(text), classes="user"))
        self.scroll_end(animate=False)

    def append_reply(self, piece: str) -> None:
        if self._reply is None:
            self._reply_text = ""
            self._reply = Static("", classes="reply")
            self.mount(self._reply)
        self._reply_text += piece
        self._reply.update(Text(self._reply_text))
        self.scroll_end(animate=False)

    def replace_reply(self, text: str) -> None:
        """The reply so far is `text` (an audit took back what a caught stage computed)."""
        if self._reply is not None:
            self._reply_text = ""
        self.append_reply(text)

    def end_reply(self) -> None:
        self._reply = None

    def add_note(self, text: str, error: bool = False) -> None:
        self._reply = None
        self.mount(Static(Text(text), classes="error" if error else "note"))
        self.scroll_end(animate=False)

    @property
    def reply_text(self) -> str:
        return self._reply_text

    def clear(self) -> None:
        self._reply, self._reply_text = None, ""
        self.remove_children()
