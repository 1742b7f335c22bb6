"""The log, fed by Python's logging from any thread."""
from __future__ import annotations

import logging
import threading

from textual.app import App
from textual.widgets import Log


class LogPanel(Log):
    pass


class PanelHandler(logging.Handler):
    """Sends records to a LogPanel in its app's loop; drops them once the app has closed.

    Create it in the app's thread (on mount): records from that thread are written directly."""

    def __init__(self, app: App, panel: LogPanel, level: int = logging.INFO):
        super().__init__(level)
        self.app, self.panel, self.loop_thread = app, panel, threading.get_ident()
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        if not self.app.is_running:
            return
        line = self.format(record)
        try:
            if threading.get_ident() == self.loop_thread:
                self.panel.write_line(line)
            else:
                self.app.call_from_thread(self.panel.write_line, line)
        except RuntimeError:  # the app closed meanwhile
            pass
