"""Stop strings over streamed text: cut at the first one, and never stream the start of one that may follow."""
from __future__ import annotations


class StopText:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""  # the tail that could still grow into a stop string
        self.hit = False

    def push(self, piece: str) -> str:
        """Add streamed text; return what is safe to send now. After a stop string, nothing more."""
        if self.hit:
            return ""
        text = self._held + piece
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit, self._held = True, ""
            return text[:min(found)]
        keep = max((n for s in self.stops for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if s.startswith(text[len(text) - n:])), default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """At the end without a stop string: the held-back tail was text after all."""
        rest, self._held = self._held, ""
        return "" if self.hit else rest
