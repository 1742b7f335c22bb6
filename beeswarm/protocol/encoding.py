"""Messages as msgpack maps with a type tag `t` and a version `v`, decoded straight into typed structs.

Nothing a peer sends is executed or unpickled: msgpack yields only plain data (extension types are
refused), every message is size-checked before it is parsed, and decoding validates every field's
type and bounds before any handler sees it. Errors name the field path (`$.info.spans[0]`).
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Generic, TypeVar

import msgspec

CONTROL_LIMIT = 64 * 1024
TENSOR_LIMIT = 256 * 1024 * 1024
VERSION = 1


class ProtocolError(Exception):
    """A peer sent something malformed, oversized or unexpected."""


class RemoteError(Exception):
    """The peer answered a request with an error reply (`busy`: it has no room now, no fault of its own)."""

    def __init__(self, message: str, busy: bool = False, room: int = 0, queued: bool = False):
        super().__init__(message)
        self.busy, self.room, self.queued = busy, room, queued


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="t"):
    """Base of every message; subclasses set `tag=` (the wire name of their type)."""

    v: int = VERSION

    def __post_init__(self) -> None:
        if self.v != VERSION:
            raise ValueError(f"version {self.v} is not spoken here (only {VERSION})")


class ErrorReply(Message, frozen=True, tag="error"):
    """The reply to a request that failed; `error` says why. `busy`: the peer is healthy but cannot take this
    now (no memory or session slot left, or not serving that span yet or any more): try later or elsewhere,
    and hold nothing against it."""

    error: str = ""
    busy: bool = False
    room: Annotated[int, msgspec.Meta(ge=0)] = 0  # busy for memory: the longest session it could take now (tokens)
    queued: bool = False  # busy for memory: the asker has a place in the peer's queue, kept while it asks again

    def __post_init__(self) -> None:
        Message.__post_init__(self)
        if len(self.error) > 1000:
            object.__setattr__(self, "error", self.error[:1000])  # a bound on what a peer makes us log


_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def _no_ext(code: int, data: memoryview) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not accepted")


M = TypeVar("M", bound=msgspec.Struct)


class Decoder(Generic[M]):
    """Decodes messages of the given types (a tagged union); anything else is a ProtocolError.

    For several types, annotate the union: `replies: Decoder[Result | StepError] = Decoder(Result, StepError)`
    (left to itself, mypy infers the types' common base).
    """

    _cache: ClassVar[dict[tuple[type, ...], msgspec.msgpack.Decoder[Any]]] = {}

    def __init__(self, *types: type[M], limit: int = CONTROL_LIMIT):
        self.limit = limit
        self.names = "/".join(str(t.__struct_config__.tag or t.__name__) for t in types)
        if types not in self._cache:
            self._cache[types] = msgspec.msgpack.Decoder(
                types[0] if len(types) == 1 else Union_of(types), ext_hook=_no_ext)
        self._decoder = self._cache[types]

    def decode(self, data: bytes | memoryview) -> M:
        if len(data) > self.limit:
            raise ProtocolError(f"message of {len(data)} bytes exceeds the {self.limit}-byte limit")
        try:
            msg: M = self._decoder.decode(data)  # msgspec validated it against `types`
            return msg
        except ProtocolError:
            raise
        except msgspec.ValidationError as e:
            raise ProtocolError(f"not a valid {self.names} message: {e}") from None
        except Exception as e:  # noqa: BLE001 - msgspec raises DecodeError and others on garbage
            raise ProtocolError(f"undecodable message ({type(e).__name__}: {e})") from None


def Union_of(types: tuple[type, ...]) -> Any:  # noqa: N802 - builds a typing.Union at run time
    union: Any = types[0]
    for t in types[1:]:
        union = union | t
    return union
