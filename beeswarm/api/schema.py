"""Request bodies of the OpenAI API, as typed structs: a malformed body is a 400 naming the field.

Fields that OpenAI documents and beeswarm cannot honour exactly are accepted at their neutral value and
refused otherwise (`unsupported`), so a client never gets an answer that silently ignored what it asked.
Fields nobody here knows are ignored, as OpenAI's own clients expect of a server.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

Temperature = Annotated[float, msgspec.Meta(ge=0, le=2)]
TopP = Annotated[float, msgspec.Meta(gt=0, le=1)]
Count = Annotated[int, msgspec.Meta(ge=1)]
Stop = str | Annotated[list[str], msgspec.Meta(max_length=4)] | None


class ApiError(Exception):
    """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_error", 502: "api_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self, at: str) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for i, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"content parts of type {part.type!r} are not supported: text only",
                               f"{at}.content[{i}].type")
            parts.append(part.text)
        return "".join(parts)


class Sampling(msgspec.Struct, kw_only=True):
    """The fields chat and legacy completions share."""

    model: str
    max_tokens: Count | None = None
    # null is accepted wherever a field is optional (clients send it for "the default")
    temperature: Temperature | None = None  # OpenAI's default: 1
    top_p: TopP | None = None
    seed: int | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0)] | None = None  # vLLM's extension (transformers')
    stop: Stop = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool | None = None  # vLLM's extension: generate max_tokens whatever (benchmarks use it)

    def check(self) -> None:
        unsupported(self.n not in (None, 1), "n", "only n=1 is supported")
        unsupported(self.presence_penalty not in (None, 0), "presence_penalty", "presence_penalty is not supported")
        unsupported(self.frequency_penalty not in (None, 0), "frequency_penalty",
                    "frequency_penalty is not supported")
        unsupported(bool(self.logit_bias), "logit_bias", "logit_bias is not supported")
        unsupported(self.stream_options is not None and not self.stream, "stream_options",
                    "stream_options is only allowed with stream=true")

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def check(self) -> None:
        super().check()
        unsupported(bool(self.logprobs) or self.top_logprobs is not None, "logprobs", "logprobs are not supported")

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(Sampling, kw_only=True):
    prompt: str | Annotated[list[str | int], msgspec.Meta(min_length=1)]  # text, [text] or token ids
    max_tokens: Count | None = 16  # the legacy endpoint's documented default
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        super().check()
        unsupported(self.logprobs is not None, "logprobs", "logprobs are not supported")
        unsupported(bool(self.echo), "echo", "echo is not supported")
        unsupported(bool(self.suffix), "suffix", "suffix is not supported")
        unsupported(self.best_of not in (None, 1), "best_of", "only best_of=1 is supported")
        if isinstance(self.prompt, list):
            texts = sum(isinstance(p, str) for p in self.prompt)
            if texts == len(self.prompt) > 1:
                raise ApiError(400, "one prompt per request is supported", "prompt", "unsupported_parameter")
            if 0 < texts < len(self.prompt):
                raise ApiError(400, "a prompt is a string, one string in a list, or a list of token ids", "prompt")

    @property
    def limit(self) -> int | None:
        return self.max_tokens


def unsupported(condition: bool, param: str, message: str) -> None:
    if condition:
        raise ApiError(400, message, param, "unsupported_parameter")


_AT = re.compile(r" - at `\$\.?([^`]*)`$")


def parse(body: bytes, kind: type[ChatRequest] | type[CompletionRequest]) -> ChatRequest | CompletionRequest:
    """The request in `body`, checked; ApiError 400 naming the field otherwise."""
    try:
        request = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        text = str(e)
        match = _AT.search(text)
        param = match.group(1) if match else None
        missing = re.match(r"Object missing required field `([^`]+)`", text)
        if missing:
            param = f"{param}.{missing.group(1)}" if param else missing.group(1)
        raise ApiError(400, f"invalid request: {_AT.sub('', text)}" + (f" (at {param})" if param else ""),
                       param) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    request.check()
    return request
