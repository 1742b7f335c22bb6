"""Load and run spans of decoder layers, and the entry's embedding + head (torch).

Names are imported lazily so light commands (`beeswarm identity`) do not pay torch's import time.
"""
import importlib

_EXPORTS = {
    "EntryModel": "beeswarm.shard.entry_model",
    "SessionError": "beeswarm.shard.errors",
    "ShardError": "beeswarm.shard.errors",
    "Span": "beeswarm.protocol.spans",
    "SpanRuntime": "beeswarm.shard.span",
    "StepInput": "beeswarm.shard.span",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'beeswarm.shard' has no attribute {name!r}")
