"""One API request's generation through the swarm: prompt, limits, stop strings, the outcome.

Runs in a worker thread (SwarmClient.generate blocks); the HTTP layer streams what `on_text` gets.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from beeswarm.api.schema import ApiError, ChatMessage
from beeswarm.api.stops import StopText
from beeswarm.client.chat import template_ids
from beeswarm.client.dataplane import Route, StageBusy, StageFailed
from beeswarm.client.swarm import NoRoute, SwarmClient
from beeswarm.client.textstream import TextStream, stop_ids
from beeswarm.generation.generate import EndGeneration
from beeswarm.generation.sampling import ModelDefaults, SamplingParams

ROUTE_WAIT_S = 5.0  # a request waits for a route at least this long before a 503 (longer while the swarm moves
# towards one: `SwarmClient.route`, the same rule `chat` follows, mid-stream failovers included)


def no_route(e: NoRoute) -> ApiError:
    return ApiError(503, f"the swarm has no route right now: {e}", code="no_route", retry_after=int(ROUTE_WAIT_S))


@dataclass(frozen=True)
class Rewind:
    """An audit caught a stage that computed part of the text: only `text` stands; the rest is regenerated."""

    text: str


class Cancelled(Exception):
    """The HTTP client went away: end the generation and free its sessions."""


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    stops: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class Outcome:
    completion_tokens: int
    finish_reason: str  # stop | length
    route: Route
    recoveries: int
    accepted_per_round: float | None
    ttft_s: float = 0.0
    tokens_per_s: float = 0.0
    audits: dict[str, int] = field(default_factory=dict)  # settled while it ran (concurrent requests' too)

    def extras(self) -> dict[str, Any]:
        """The `beeswarm` object of a response: clients that do not know it ignore it."""
        return {"route": [{"peer": s.node, "start": s.span.start, "end": s.span.end} for s in self.route],
                "recoveries": self.recoveries, "accepted_per_round": self.accepted_per_round,
                "ttft_s": round(self.ttft_s, 3), "tokens_per_s": round(self.tokens_per_s, 2), "audits": self.audits}


def chat_prompt(tokenizer: Any, messages: list[ChatMessage]) -> list[int]:
    """Token ids of `messages` through the model's chat template; a model without one (tinycode) gets the
    last user message as plain text."""
    turns = [{"role": m.role, "content": m.text(f"messages[{i}]")} for i, m in enumerate(messages)]
    if getattr(tokenizer, "chat_template", None):
        try:
            return template_ids(tokenizer, turns)
        except Exception as e:  # noqa: BLE001 - a template's own checks (roles that must alternate, ...)
            raise ApiError(400, f"the model's chat template refused these messages: {e}", "messages") from None
    users = [t["content"] for t in turns if t["role"] == "user"]
    if not users:
        raise ApiError(400, "this model has no chat template: send at least one user message", "messages")
    return text_prompt(tokenizer, users[-1])


def text_prompt(tokenizer: Any, prompt: str | list[str | int]) -> list[int]:
    """Token ids of a legacy prompt: a string, one string in a list, or token ids (checked by the schema)."""
    if isinstance(prompt, list) and isinstance(prompt[0], int):
        ids = [int(t) for t in prompt]
        vocab = len(tokenizer)
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"token ids must be in [0, {vocab})", "prompt")
        return ids
    text = prompt if isinstance(prompt, str) else str(prompt[0])
    ids = list(tokenizer.encode(text))
    if not ids:
        raise ApiError(400, "the prompt is empty", "prompt")
    return ids


class Completer:
    def __init__(self, client: SwarmClient, tokenizer: Any, model_id: str):
        self.client, self.tokenizer, self.model_id = client, tokenizer, model_id
        self.context = client.entry.config.max_position_embeddings
        self.defaults = ModelDefaults.read(client.entry.folder)  # for the fields a request leaves out

    def job(self, prompt_ids: list[int], limit: int | None, temperature: float | None, top_p: float | None,
            seed: int | None, stops: list[str], param: str, ignore_eos: bool = False,
            repetition_penalty: float | None = None) -> Job:
        """A checked job: the prompt fits the context with room for at least one token. Sampling fields left out
        take the model's generation config, else OpenAI's defaults (temperature and top_p 1)."""
        room = self.context - len(prompt_ids)
        if room < 1 or limit is not None and limit > room:
            asked = f" + max_tokens {limit}" if limit is not None else ""
            raise ApiError(400, f"this model's context is {self.context} tokens; the prompt has {len(prompt_ids)}"
                                f"{asked}", param, "context_length_exceeded")
        params = self.defaults.sampling(temperature, top_p, repetition_penalty, seed, fallback=(1.0, 1.0))
        return Job(prompt_ids, limit if limit is not None else room, params, stops, ignore_eos)

    def wait_for_route(self) -> None:
        try:
            self.client.route(ROUTE_WAIT_S)
        except NoRoute as e:
            raise no_route(e) from None

    def run(self, job: Job, on_text: Callable[[str | Rewind], None]) -> Outcome:
        """Generate `job`, passing text to `on_text` as it becomes final (stop strings held back, and the text of
        tokens whose audits have not settled: a stage on probation), or a `Rewind` when an audit took back text
        already passed."""
        stream, stop = TextStream(self.tokenizer), StopText(job.stops)
        eos = set() if job.ignore_eos else set(stop_ids(self.tokenizer))
        audits_before = self.client.audits.as_json()
        held: list[tuple[int, str]] = []  # (token index, its text) not final yet
        passed = 0  # tokens whose text went to on_text

        def on_settled(n: int) -> None:
            nonlocal held, passed
            for _, text in (h for h in held if h[0] < n):
                on_text(text)
            held, passed = [h for h in held if h[0] >= n], max(passed, n)

        def on_rewind(keep: int) -> None:
            nonlocal stream, stop, held, passed
            tokens = stream.tokens[:keep]
            stream, stop = TextStream(self.tokenizer), StopText(job.stops)
            texts = [stop.push(stream.push(t)) for t in tokens]
            if keep < passed:
                on_text(Rewind("".join(texts)))
            passed = min(passed, keep)
            held = [(i, text) for i, text in enumerate(texts) if i >= passed and text]

        def on_token(token: int) -> None:
            if job.cancelled.is_set():
                raise Cancelled
            text = stop.push(stream.push(token))
            if text:
                held.append((len(stream.tokens) - 1, text))
            if stop.hit:
                raise EndGeneration

        try:
            result = self.client.generate(job.prompt_ids, job.max_tokens, job.params, list(eos), on_token,
                                          route_timeout=ROUTE_WAIT_S, on_rewind=on_rewind, on_settled=on_settled)
        except NoRoute as e:
            raise no_route(e) from None
        except StageBusy as e:
            raise ApiError(503, f"the swarm is full: {e}", code="swarm_busy", retry_after=int(ROUTE_WAIT_S)) from None
        except StageFailed as e:
            raise ApiError(503, f"the swarm kept failing: {e}", code="swarm_failed",
                           retry_after=int(ROUTE_WAIT_S)) from None
        on_settled(len(stream.tokens))  # it returned: its audits settled
        rest = stop.push(stream.flush()) + stop.flush()
        if rest:
            on_text(rest)
        gen = result.generation
        finished = stop.hit or bool(gen.tokens) and gen.tokens[-1] in eos
        spec = result.spec.as_json()["accepted_per_round"] if result.spec else None
        audits = {k: v - audits_before[k] for k, v in self.client.audits.as_json().items()}
        return Outcome(len(gen.tokens), "stop" if finished else "length", result.route, result.recoveries, spec,
                       gen.ttft_s, gen.tokens_per_s, audits)
