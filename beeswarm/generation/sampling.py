"""Token sampling: repetition penalty, greedy, temperature and nucleus (top-p), as pure tensor functions, and the
position-keyed noise that sampling draws with."""
from __future__ import annotations

import collections
import json
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (argmax); top_p 1 keeps the whole distribution; repetition_penalty 1 is none
    (above 1 makes every token already in the sequence, prompt included, less likely: CTRL's penalty, applied
    before the rest exactly as transformers' `repetition_penalty` does)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class ModelDefaults:
    """What a model's generation_config.json asks sampling to use when the user does not say (None: it does not
    say; the caller's own default applies)."""

    temperature: float | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None

    @classmethod
    def read(cls, folder: Path) -> ModelDefaults:
        """From `folder`/generation_config.json (transformers' names); missing or unreadable: nothing said."""
        try:
            config = json.loads((Path(folder) / "generation_config.json").read_text())
        except (OSError, ValueError):
            return cls()
        if not isinstance(config, dict):
            return cls()
        valid = {"temperature": lambda v: 0 <= v <= 100, "top_p": lambda v: 0 < v <= 1,
                 "repetition_penalty": lambda v: 0 < v <= 100}
        if config.get("do_sample") is False:  # transformers decodes greedily then: its temperature means nothing
            del valid["temperature"], valid["top_p"]
        return cls(**{k: float(v) for k, ok in valid.items()
                      if isinstance(v := config.get(k), int | float) and not isinstance(v, bool) and ok(v)})

    def sampling(self, temperature: float | None, top_p: float | None, repetition_penalty: float | None,
                 seed: int | None, fallback: tuple[float, float]) -> SamplingParams:
        """What is given, else this model's, else `fallback` (temperature, top_p; no penalty); top_p is 1 when
        greedy. Raises ValueError for values out of range."""
        t = next(v for v in (temperature, self.temperature, fallback[0]) if v is not None)
        p = next(v for v in (top_p, self.top_p, fallback[1]) if v is not None)
        r = next(v for v in (repetition_penalty, self.repetition_penalty, 1.0) if v is not None)
        return SamplingParams(t, 1.0 if t == 0 else p, seed, r)


def penalize(logits: torch.Tensor, seen: Iterable[int] | Seen, penalty: float) -> torch.Tensor:
    """`logits` (vocab,) with every token of `seen` penalised: a positive logit divided by `penalty`, a
    negative one multiplied (transformers' RepetitionPenaltyLogitsProcessor)."""
    if penalty == 1.0:
        return logits
    index = (seen if isinstance(seen, Seen) else Seen(seen)).index.to(logits.device)
    if not len(index):
        return logits
    picked = logits.gather(-1, index)
    return logits.scatter(-1, index, torch.where(picked < 0, picked * penalty, picked / penalty))


class Seen:
    """The distinct tokens of a sequence, for penalising many continuations of it (a draft tree's nodes) without
    going over the whole sequence for each."""

    def __init__(self, tokens: Iterable[int]):
        self.ids = set(tokens)
        self.index = torch.tensor(sorted(self.ids), dtype=torch.long)

    def plus(self, tokens: list[int]) -> Seen:
        """This sequence continued by `tokens`."""
        more = {t for t in tokens if t not in self.ids}
        if not more:
            return self
        out = Seen(())
        out.ids, out.index = self.ids | more, torch.cat([self.index, torch.tensor(sorted(more), dtype=torch.long)])
        return out


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: softmax(logits / T), cut to the top-p nucleus, renormalised."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


_MASK64 = (1 << 64) - 1


def _mix(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): a seed per position, unrelated to its neighbours'."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class Noise:
    """The randomness of one sampled generation, keyed by position: the token at position t is
    argmax(log p + G_t), with G_t Gumbel noise drawn from (seed, t) alone. That is exactly a draw from p (the
    Gumbel-max trick; G_t is independent of every earlier position, so of the context p was computed from), and
    it is the same draw whoever computes p, in whatever order and however often: speculative or plain, pipelined
    or serial, alone on the swarm or among many users, before or after a failover. A seeded generation is
    therefore one answer, reproducible token for token. A draft ranks its candidates by the same noise
    (log q + G_t), so it proposes the token the target is likely to draw (drafter-invariant speculative
    decoding: Daliri et al., 2025)."""

    KEPT = 64  # positions' noise kept (a speculative tree looks at a few dozen positions at once)

    def __init__(self, seed: int):
        self.seed = seed
        self._kept: collections.OrderedDict[tuple[int, int], torch.Tensor] = collections.OrderedDict()

    @classmethod
    def fresh(cls) -> Noise:
        return cls(secrets.randbits(63))

    def gumbel(self, position: int, vocab: int) -> torch.Tensor:
        """G_position: (vocab,) float64 standard Gumbel noise, on the host."""
        key = (position, vocab)
        noise = self._kept.get(key)
        if noise is None:
            generator = torch.Generator().manual_seed(_mix(self.seed, position))
            u = torch.rand(vocab, dtype=torch.float64, generator=generator)
            noise = -torch.log(-torch.log(u.clamp_(min=1e-300)))
            self._kept[key] = noise
            if len(self._kept) > self.KEPT:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(key)
        return noise

    def scores(self, probs: torch.Tensor, position: int) -> torch.Tensor:
        """log p + G_position (float64, on the host): the token drawn at `position` is their argmax; the k likeliest
        to be drawn there, as far as `probs` knows, their top k."""
        return probs.detach().to("cpu", torch.float64).log() + self.gumbel(position, probs.shape[-1])

    def draw(self, probs: torch.Tensor, position: int) -> int:
        """The token at `position`, drawn from `probs` (vocab,)."""
        return int(self.scores(probs, position).argmax())


@dataclass(frozen=True)
class Sampling:
    """How one generation samples: its parameters and its noise (None: greedy)."""
    params: SamplingParams
    noise: Noise | None


def new_noise(params: SamplingParams) -> Noise | None:
    """The noise a generation samples with: keyed by `params.seed` when given, by a fresh seed otherwise; None
    when greedy (nothing random)."""
    if params.greedy:
        return None
    return Noise(params.seed) if params.seed is not None else Noise.fresh()


def sample(logits: torch.Tensor, params: SamplingParams, noise: Noise | None, position: int,
           seen: Iterable[int] | Seen = ()) -> int:
    """The token at `position` from a (vocab,) logits vector; `seen`: the sequence so far (for the repetition
    penalty); `noise`: the generation's (None: a fresh one, for a one-off draw)."""
    logits = penalize(logits, seen, params.repetition_penalty)
    if params.greedy:
        return int(logits.argmax())
    return (noise or Noise.fresh()).draw(probabilities(logits, params), position)
