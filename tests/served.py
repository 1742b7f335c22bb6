"""A `beeswarm serve` process as the official `openai` client sees it: for tests that drive the API."""
from __future__ import annotations

import httpx
import openai
from transformers import AutoTokenizer

from helpers import reference_greedy

KEY = "test-key-0123"


class Served:
    def __init__(self, url: str, model: str, peers: dict):
        self.url, self.model, self.peers = url, model, peers
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120)
        self.http = httpx.Client(base_url=url.removesuffix("/v1"), timeout=120,
                                 headers={"Authorization": f"Bearer {KEY}"})
        self._references: dict[tuple[str, int, float], str] = {}

    def health(self) -> dict:
        return self.http.get("/health").json()

    def reference(self, prompt: str, n: int, repetition_penalty: float = 1.0) -> str:
        """transformers' greedy text for `prompt` (what `chat --greedy` returns), ended at EOS as serving does."""
        key = (prompt, n, repetition_penalty)
        if key not in self._references:
            tokens = reference_greedy(self.model, self.tokenizer.encode(prompt), n,
                                      repetition_penalty=repetition_penalty)
            eos = self.tokenizer.eos_token_id
            if eos in tokens:
                tokens = tokens[:tokens.index(eos) + 1]
            self._references[key] = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return self._references[key]
