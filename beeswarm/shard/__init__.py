"""Load and run spans of decoder layers, and the entry's embedding + head (torch)."""
from beeswarm.shard.entry import EntryModel
from beeswarm.shard.errors import SessionError, ShardError
from beeswarm.shard.span import Span, SpanRuntime, StepInput

__all__ = ["EntryModel", "SessionError", "ShardError", "Span", "SpanRuntime", "StepInput"]
