"""The generation loop over any forward function: prefill, then one token per step."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from beeswarm.generation.sampling import Noise, SamplingParams, Seen, new_noise, sample

# (new token ids (q,), start position) -> logits (q, vocab) for those tokens
Forward = Callable[[torch.Tensor, int], torch.Tensor]


class EndGeneration(Exception):  # noqa: N818 - a signal, not an error
    """Raised by an `on_token` callback to end the generation there, keeping the tokens so far (a stop
    string was seen); the caller gets its result as if a stop id had ended it."""


@dataclass
class Generation:
    tokens: list[int]
    prompt_tokens: int
    ttft_s: float
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


def generate(forward: Forward, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
             stop_ids: Iterable[int] = (), on_token: Callable[[int], None] | None = None,
             noise: Noise | None = None) -> Generation:
    """Generate up to `max_new_tokens` after `prompt_ids`, stopping early at a stop id (kept in the output).

    `noise`: the generation's sampling noise (keyed by position: resuming after a failover with the same noise
    draws what the generation would have drawn without it); None: `params`' own.
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    noise = noise if noise is not None else new_noise(params)
    stop = set(stop_ids)
    tokens: list[int] = []
    t0 = time.perf_counter()
    ttft = 0.0
    pending, start = torch.tensor(prompt_ids), 0
    penalised = params.repetition_penalty != 1.0
    seen = Seen(prompt_ids if penalised else ())  # the sequence so far, for the penalty (kept only if there is one)
    while len(tokens) < max_new_tokens:
        logits = forward(pending, start)
        token = sample(logits[-1], params, noise, len(prompt_ids) + len(tokens), seen)
        if not tokens:
            ttft = time.perf_counter() - t0
        tokens.append(token)
        if penalised:
            seen = seen.plus([token])
        if on_token:
            on_token(token)
        if token in stop:
            break
        start += len(pending)
        pending = torch.tensor([token])
    return Generation(tokens, len(prompt_ids), ttft, time.perf_counter() - t0)
