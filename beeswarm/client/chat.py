"""A chat conversation through the swarm: turns, commands' effects, and stopping a reply midway.

What a chat front end (the Textual app, or a script) drives; it owns the history and the figures a
status bar shows, and none of the rendering.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from beeswarm.client.attempts import SwarmGeneration
from beeswarm.client.dataplane import Route
from beeswarm.client.swarm import SwarmClient
from beeswarm.client.textstream import TextStream, stop_ids
from beeswarm.generation.sampling import SamplingParams


def template_ids(tokenizer, turns: list[dict[str, str]]) -> list[int]:
    """Token ids of `turns` through the tokenizer's chat template, ready for the assistant's reply."""
    ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


class Stopped(Exception):
    """The user stopped the reply (it keeps what was generated so far)."""


@dataclass
class Reply:
    text: str
    tokens: int
    stopped: bool
    tokens_per_s: float
    ttft_s: float
    accepted_per_round: float | None
    route: Route = ()


class ChatSession:
    def __init__(self, client: SwarmClient, tokenizer, params: SamplingParams, max_new_tokens: int = 256):
        self.client, self.tokenizer, self.params = client, tokenizer, params
        self.max_new_tokens = max_new_tokens
        self.context: list[int] = []  # every token so far: prompts and replies
        self.turns: list[dict[str, str]] = []
        self._stop = threading.Event()
        self.busy = False

    @property
    def speculating(self) -> bool:
        return self.client.speculate

    @property
    def can_speculate(self) -> bool:
        return self.client.drafting is not None

    def set_speculation(self, on: bool) -> None:
        if on and self.client.drafting is None:
            raise ValueError("this model has no draft: start with --draft REF to speculate")
        self.client.speculate = on

    def set_temperature(self, temperature: float) -> None:
        self.params = replace(self.params, temperature=temperature, top_p=self.params.top_p if temperature > 0 else 1.0)

    def reset(self) -> None:
        self.context, self.turns = [], []

    def stop(self) -> None:
        """Stop the reply being generated (from any thread)."""
        self._stop.set()

    def _prompt_ids(self, text: str) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None):
            return template_ids(self.tokenizer, self.turns + [{"role": "user", "content": text}])
        return self.context + self.tokenizer.encode(text)  # no template: plain continuation

    def send(self, text: str, on_text: Callable[[str], None],
             on_rewind: Callable[[str], None] = lambda text: None) -> Reply:
        """Generate a reply to `text`, streaming its text to `on_text`; stop() ends it early. `on_rewind(text)`:
        a stage that computed part of the reply was caught by an audit; only `text` stands, the rest follows."""
        ids = self._prompt_ids(text)
        limit = self.client.entry.config.max_position_embeddings
        if len(ids) + self.max_new_tokens > limit:
            raise ValueError(f"the conversation ({len(ids)} tokens) is too long for the model's {limit}-token "
                             f"context: /reset to start over")
        stream = TextStream(self.tokenizer)
        self._stop.clear()
        self.busy = True

        def on_token(token: int) -> None:
            piece = stream.push(token)
            if piece:
                on_text(piece)
            if self._stop.is_set():
                raise Stopped

        t0, stopped, result = time.perf_counter(), False, None
        try:
            result = self.client.generate(ids, self.max_new_tokens, self.params, stop_ids(self.tokenizer), on_token,
                                          on_rewind=lambda keep: on_rewind(stream.rewind(keep)))
        except Stopped:
            stopped = True
        finally:
            self.busy = False
        rest = stream.flush()
        if rest:
            on_text(rest)
        self.context = ids + stream.tokens
        self.turns += [{"role": "user", "content": text}, {"role": "assistant", "content": stream.text}]
        return self._reply(stream.text, stream.tokens, stopped, result, time.perf_counter() - t0)

    def audits(self) -> tuple[int, int, int] | None:
        """(run, passed, failed) of this client's audits so far; None when it does not audit."""
        if self.client.auditor is None:
            return None
        c = self.client.audits
        return c.run, c.passed, c.failed

    def ring_ms(self, route: Route) -> float | None:
        """One-way latency around the route (entry -> stages -> entry) from the stages' link probes."""
        view = self.client.members.view()
        me = self.client.node.peer_id
        hops = [me] + [stage.node for stage in route] + [me]
        total = 0.0
        for a, b in zip(hops, hops[1:]):
            link = (view[b].links.get(a) if b in view else None) or (view[a].links.get(b) if a in view else None)
            if not link:
                return None
            total += link[0] / 2
        return total

    def swarm_rows(self) -> list[tuple[str, str, str, str]]:
        """(node, role, layers, state) for every member the client sees."""
        rows: list[tuple[str, str, str, str]] = []
        for peer, info in sorted(self.client.members.view().items(),
                                 key=lambda kv: (kv[1].layers is None, kv[1].layers or 0)):
            layers = str(info.layers) if info.layers else "-"
            rows.append((peer[-8:], info.role, layers, info.state))
        return rows

    @staticmethod
    def _reply(text: str, tokens: list[int], stopped: bool, result: SwarmGeneration | None, seconds: float) -> Reply:
        if result is None:  # stopped: the figures of what did arrive
            return Reply(text, len(tokens), True, len(tokens) / seconds if seconds else 0.0, 0.0, None)
        g, spec = result.generation, result.spec
        return Reply(text, len(tokens), stopped, g.tokens_per_s, g.ttft_s,
                     spec.as_json()["accepted_per_round"] if spec else None,
                     result.route)
