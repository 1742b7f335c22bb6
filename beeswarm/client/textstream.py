"""Turn a growing list of token ids into text deltas, holding back half-formed UTF-8 characters."""
from __future__ import annotations


def stop_ids(tokenizer) -> list[int]:
    """Token ids that end a generation: the tokenizer's end of sequence, when it has one."""
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


class TextStream:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.emitted = 0

    def push(self, token: int) -> str:
        """Add a token; return the text that is now complete and not yet returned."""
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a multi-byte character split across tokens: wait for the rest
            return ""
        delta, self.emitted = text[self.emitted:], len(text)
        return delta

    def flush(self) -> str:
        """At the end: the text not yet returned, including a character the generation never finished."""
        text = self.text
        delta, self.emitted = text[self.emitted:], len(text)
        return delta

    def rewind(self, keep: int) -> str:
        """Take back every token after the first `keep` (the swarm regenerates them); the text that stands,
        all of it counted as returned."""
        del self.tokens[keep:]
        text = self.text
        self.emitted = len(text)
        return text

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)
