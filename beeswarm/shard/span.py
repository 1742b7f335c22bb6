"""Run a span of decoder layers for many sessions: batched steps, rollback, tree masks, keep."""
from __future__ import annotations

import copy
import logging
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from beeswarm.protocol.spans import Span
from beeswarm.shard import checkpoint, loader
from beeswarm.shard.device import resolve_device, resolve_dtype
from beeswarm.shard.errors import SessionError, ShardError
from beeswarm.shard.families import Rotary, head_dim, kv_bytes_per_token_layer, sliding_window
from beeswarm.shard.kvcache import SessionKV, StepCache
from beeswarm.shard.offload import OffloadedLayers
from beeswarm.shard.quant import check as check_quant

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepInput:
    """One session's part of a batched step.

    hidden: (q, hidden_size). start: position of the first token; the cache is truncated to it first.
    tree_mask: optional (q, w) bool with w >= q: the last q columns are this step's tokens, the first
    w - q the cached positions just before `start` (0 for a whole tree in one step, more when a tree
    grows level by level). Row j may attend to the columns of its ancestors and itself, and to every
    position before the window; its position is (start - (w - q)) + ancestors. Without a mask the q
    tokens are a causal chain.
    """

    session_id: str
    hidden: torch.Tensor
    start: int
    tree_mask: torch.Tensor | None = None

    @property
    def window_start(self) -> int:
        """The first position the tree mask covers; everything before it is visible to every row."""
        if self.tree_mask is None:
            return self.start
        return self.start - (self.tree_mask.shape[1] - self.tree_mask.shape[0])

    def positions(self, device) -> torch.Tensor:
        if self.tree_mask is None:
            return self.start + torch.arange(self.hidden.shape[0], device=device)
        return self.window_start + tree_positions(self.tree_mask.to(device))


def tree_positions(tree_mask: torch.Tensor) -> torch.Tensor:
    """Depth of every tree node: the number of its ancestors."""
    return tree_mask.sum(dim=1) - 1


def attention_mask(inputs: list[StepInput], kv_length: int, window: int | None, dtype, device) -> torch.Tensor:
    """Additive mask (rows, 1, q_max, kv_length): 0 where a query may attend, the dtype's minimum elsewhere."""
    q_max = max(x.hidden.shape[0] for x in inputs)
    allowed = torch.zeros(len(inputs), q_max, kv_length, dtype=torch.bool, device=device)
    for row, x in enumerate(inputs):
        q, w0 = x.hidden.shape[0], x.window_start
        allowed[row, :q, :w0] = True
        own = x.tree_mask.to(device) if x.tree_mask is not None else \
            torch.ones(q, q, dtype=torch.bool, device=device).tril()
        allowed[row, :q, w0:x.start + q] = own
        if window is not None:
            query_pos = x.positions(device)
            key_pos = torch.arange(kv_length, device=device)
            allowed[row, :q] &= key_pos[None, :] > query_pos[:, None] - window
        allowed[row, q:, 0] = True  # padding rows: attend somewhere so softmax stays finite
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


class SpanRuntime:
    """Layers [start, end) of a checkpoint, with per-session KV caches. Thread-safe."""

    def __init__(self, folder: Path, span: Span, dtype="auto", device="auto", offload_fraction: float = 0.0,
                 on_layer: Callable[[int, int], None] = lambda done, total: None, quant: str = "none"):
        """`offload_fraction` a: the last ceil(a * layers) layers stay in host memory and stream in per pass;
        `on_layer(done, total)` after each layer is built; `quant`: the weights' format (`shard.quant`)."""
        if not 0.0 <= offload_fraction <= 1.0:
            raise ShardError(f"offload_fraction {offload_fraction} is outside [0, 1]")
        self.folder = Path(folder)
        self.config = loader.load_config(self.folder)
        self.span = span
        self.quant = check_quant(quant)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        offloaded = math.ceil(offload_fraction * len(span))
        resident_end = span.end - offloaded
        resident = resident_end - span.start
        self.layers: nn.ModuleList | list[nn.Module] = loader.build_layers(
            self.folder, self.config, span.start, resident_end, self.dtype, self.device, quant,
            lambda n: on_layer(n, len(span))) if resident else []
        host: nn.ModuleList | list[nn.Module] = loader.build_layers(
            self.folder, self.config, resident_end, span.end, self.dtype, torch.device("cpu"), quant,
            lambda n: on_layer(resident + n, len(span))) if offloaded else []
        self.offloaded = OffloadedLayers(list(host), self.device)
        self.rotary = Rotary(self.config, range(span.start, span.end), self.device)
        self.head_dim = head_dim(self.config)
        self.windows = [sliding_window(self.config, i) for i in range(span.start, span.end)]
        self.sessions: dict[str, SessionKV] = {}
        self._lock = threading.Lock()  # one pass at a time through the layers
        self._table = threading.Lock()  # `sessions`: never held across a pass (opening one never waits for it)
        self._local = range(len(span))  # the layers this runtime runs, as indices into those built (`view`)

    @classmethod
    def load(cls, ref: str, span: Span, dtype="auto", device="auto", offload_fraction: float = 0.0,
             on_bytes: checkpoint.OnBytes | None = None,
             on_layer: Callable[[int, int], None] = lambda done, total: None, quant: str = "none") -> SpanRuntime:
        """`on_bytes(file, done, total)` while a hub download runs; `on_layer(done, total)` while building."""
        folder = checkpoint.resolve(ref, checkpoint.Parts(span.start, span.end), on_bytes=on_bytes)
        return cls(folder, span, dtype, device, offload_fraction, on_layer, quant)

    def view(self, piece: Span) -> SpanRuntime:
        """Layers `piece` (within this span) as a runtime of their own: the same weights and one pass at a time
        with this one, sessions (and their KV, for those layers only) of its own. An audit checks a piece of
        another stage's span with the layers this one serves, loading nothing."""
        if not (self.span.start <= piece.start and piece.end <= self.span.end):
            raise ShardError(f"layers {piece} are not within {self.span}")
        if piece == self.span:
            return self
        view = copy.copy(self)
        lo = self._local.start + piece.start - self.span.start
        view.span, view._local = piece, range(lo, lo + len(piece))
        view.windows = self.windows[piece.start - self.span.start:piece.end - self.span.start]
        view.rotary = Rotary(self.config, range(piece.start, piece.end), self.device)
        view.sessions, view._table = {}, threading.Lock()
        return view

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def kv_bytes(self, max_length: int) -> int:
        return len(self.span) * max_length * kv_bytes_per_token_layer(self.config, self.dtype)

    # sessions -------------------------------------------------------------------------------------
    def open(self, session_id: str, max_length: int) -> None:
        limit = self.config.max_position_embeddings
        if not 0 < max_length <= limit:
            raise SessionError(f"max_length {max_length} is outside 1..{limit} (the model's context)")
        if session_id in self.sessions:
            raise SessionError(f"session {session_id!r} is already open")
        try:  # (outside the locks: a long session's cache takes a while to allocate)
            kv = SessionKV.allocate(len(self.span), self.config.num_key_value_heads, max_length, self.head_dim,
                                    self.dtype, self.device)
        except (RuntimeError, MemoryError) as e:  # torch raises OutOfMemoryError (a RuntimeError)
            raise SessionError(f"no memory for a session of {max_length} tokens "
                               f"({self.kv_bytes(max_length)} bytes)") from e
        with self._table:
            if session_id in self.sessions:
                raise SessionError(f"session {session_id!r} is already open")
            self.sessions[session_id] = kv

    def close(self, session_id: str) -> None:
        with self._table:
            self.sessions.pop(session_id, None)

    def keep(self, session_id: str, start: int, indices: list[int]) -> None:
        """After verification: keep tree nodes `indices` (relative to `start`) as positions start, start+1, ..."""
        kv = self._session(session_id)
        if not 0 <= start <= kv.length or any(not 0 <= i < kv.length - start for i in indices):
            raise SessionError(f"keep: indices {indices} from {start} fall outside the cached {kv.length} tokens")
        kv.keep(start, indices)

    def hold(self, session_id: str, start: int, positions: int) -> None:
        """A step not computed (cancelled): its `positions` from `start` are held as if it had run, so later keeps
        index the same positions on every stage. Their KV is stale and never read: the step that cancelled it
        keeps none of them."""
        kv = self._session(session_id)
        if not 0 <= start <= kv.length or start + positions > kv.max_length:
            raise SessionError(f"hold: positions {start}..{start + positions} fall outside the cached {kv.length} "
                               f"tokens or past max_length {kv.max_length}")
        kv.length = start + positions

    def length(self, session_id: str) -> int:
        return self._session(session_id).length

    def _session(self, session_id: str) -> SessionKV:
        with self._table:
            kv = self.sessions.get(session_id)
        if kv is None:
            raise SessionError(f"unknown session {session_id!r}")
        return kv

    # compute --------------------------------------------------------------------------------------
    def _check(self, x: StepInput, kv: SessionKV) -> None:
        q = x.hidden.shape[0] if x.hidden.dim() == 2 else -1
        if x.hidden.dim() != 2 or x.hidden.shape[1] != self.hidden_size or q < 1:
            raise SessionError(f"hidden: shape {tuple(x.hidden.shape)}, expected (tokens>=1, {self.hidden_size})")
        if not 0 <= x.start <= kv.length:
            raise SessionError(f"start {x.start} is past the {kv.length} cached tokens of {x.session_id!r}")
        if x.start + q > kv.max_length:
            raise SessionError(f"step reaches position {x.start + q}, past max_length {kv.max_length}")
        if x.tree_mask is not None:
            m = x.tree_mask
            if m.dim() != 2 or m.shape[0] != q or not q <= m.shape[1] <= q + x.start or m.dtype != torch.bool:
                raise SessionError(f"tree_mask: expected a ({q}, {q}..{q + x.start}) bool mask, "
                                   f"got {tuple(m.shape)} {m.dtype}")
            own = m[:, -q:]
            if not bool(own.diagonal().all()) or bool(own.triu(1).any()):
                raise SessionError("tree_mask: the step's own columns must be lower-triangular with a true diagonal")

    @torch.inference_mode()
    def step(self, inputs: list[StepInput]) -> list[torch.Tensor]:
        """Run one batched step; returns each input's output hidden states (q, hidden_size)."""
        if not inputs:
            return []
        if len({x.session_id for x in inputs}) != len(inputs):
            raise SessionError("a session appears twice in one step")
        with self._lock:
            sessions = [self._session(x.session_id) for x in inputs]
            for x, kv in zip(inputs, sessions, strict=True):
                self._check(x, kv)
            return self._run(inputs, sessions)

    def step_one(self, session_id: str, hidden: torch.Tensor, start: int,
                 tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.step([StepInput(session_id, hidden, start, tree_mask)])[0]

    @torch.inference_mode()
    def trace(self, x: StepInput) -> list[torch.Tensor]:
        """One session's step, keeping the hidden states after each layer: len(span) tensors (q, hidden_size), the
        last of them its output (an audited stage signs its layer boundaries from them)."""
        with self._lock:
            kv = self._session(x.session_id)
            self._check(x, kv)
            after: list[torch.Tensor] = []
            self._run([x], [kv], after)
            return [h[0] for h in after]

    def _modules(self) -> Iterator[nn.Module]:
        """The layer modules this runtime runs, in order (offloaded ones streamed in as they come)."""
        resident = len(self.layers)
        yield from self.layers[self._local.start:min(self._local.stop, resident)]
        if self._local.stop > resident:
            for j, layer in enumerate(self.offloaded.layers(), start=resident):
                if j >= self._local.stop:
                    break
                if j >= self._local.start:
                    yield layer

    def _run(self, inputs: list[StepInput], sessions: list[SessionKV],
             after: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        lengths = [x.hidden.shape[0] for x in inputs]
        q_max = max(lengths)
        hidden = torch.zeros(len(inputs), q_max, self.hidden_size, dtype=self.dtype, device=self.device)
        positions = torch.zeros(len(inputs), q_max, dtype=torch.long, device=self.device)
        for row, x in enumerate(inputs):
            q = lengths[row]
            hidden[row, :q] = x.hidden.to(device=self.device, dtype=self.dtype)
            positions[row, :q] = x.positions(self.device)
        for kv, x in zip(sessions, inputs, strict=True):
            kv.length = x.start  # rollback: whatever lay past start is overwritten
        cache = StepCache(sessions, [x.start for x in inputs], lengths, self.span.start)
        masks = {w: attention_mask(inputs, cache.kv_length, w, self.dtype, self.device) for w in set(self.windows)}
        rotary = self.rotary(hidden, positions)
        for layer, window, rope in zip(self._modules(), self.windows, rotary, strict=True):
            hidden = layer(hidden, attention_mask=masks[window], position_ids=positions, cache=cache,
                           position_embeddings=rope)
            if after is not None:
                after.append(hidden)
        for kv, end in zip(sessions, cache.ends, strict=True):
            kv.length = end
        return [hidden[row, :q] for row, q in enumerate(lengths)]
