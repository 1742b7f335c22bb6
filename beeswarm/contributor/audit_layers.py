"""The layers a contributor audits other stages with, and judges evidence with (`evidence.RuntimeFor`).

A span served here that holds the layers asked for lends a view of them (nothing to load). Else they are loaded,
when they fit in half the memory free now and within `--max-memory` beside what is held (MemoryError otherwise:
serving comes first), and the last AUDIT_SPANS loaded are kept: in a pipeline the other stages' spans come up
again and again. The oldest kept make room for a span that would fit without them (a spare checking a newcomer's
layers one at a time declined the fourth once three were kept).
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping

from beeswarm.coordinator.checkable import room_for
from beeswarm.protocol.membership import Quant
from beeswarm.protocol.spans import Span
from beeswarm.shard import benchmark
from beeswarm.shard.span import SpanRuntime

log = logging.getLogger(__name__)

AUDIT_SPANS = 4  # spans loaded to audit other stages with, kept


class AuditLayers:
    def __init__(self, model: str, dtype: str, device: str, quant: Quant, max_memory: int | None,
                 layer_bytes: Callable[[], int], served: Callable[[], Mapping[Span, SpanRuntime]]):
        """`layer_bytes()`: one layer's weights in this format; `served()`: the spans served here now."""
        self.model, self.dtype, self.device, self.quant, self.max_memory = model, dtype, device, quant, max_memory
        self.layer_bytes, self.served = layer_bytes, served
        self._lock = threading.Lock()
        self._loaded: OrderedDict[Span, SpanRuntime] = OrderedDict()  # newest last

    def __call__(self, span: Span) -> SpanRuntime:
        served = self.served()
        holder = next((r for s, r in served.items() if s.start <= span.start and span.end <= s.end), None)
        if holder is not None:
            return holder.view(span)
        with self._lock:
            if span in self._loaded:
                self._loaded.move_to_end(span)
                return self._loaded[span]
        from beeswarm.shard.device import resolve_device

        layer_bytes = self.layer_bytes()
        need = layer_bytes * len(span)

        def fits(held: int) -> bool:  # within --max-memory beside `held` layers
            return not self.max_memory or room_for(len(span), self.max_memory, held, layer_bytes)

        with self._lock:
            serving = sum(len(s) for s in served)
            if fits(serving):  # the spans kept for audits, oldest first, make room for this one
                while self._loaded and not fits(serving + sum(len(s) for s in self._loaded)):
                    self._loaded.popitem(last=False)
            held = serving + sum(len(s) for s in self._loaded)
        free = benchmark.free_bytes(resolve_device(self.device))
        if self.max_memory:
            free = min(free, max(0, self.max_memory - layer_bytes * held))
        if need > free // 2:
            raise MemoryError(f"layers {span} need {need / 2**20:.0f} MiB, {free / 2**20:.0f} MiB are free")
        log.info("loading layers %s to audit or check evidence with", span)
        loaded = SpanRuntime.load(self.model, span, self.dtype, self.device, quant=self.quant)
        with self._lock:
            self._loaded[span] = loaded
            while len(self._loaded) > AUDIT_SPANS:
                self._loaded.popitem(last=False)
        return loaded
