"""The HTTP side of `beeswarm serve`: OpenAI's routes and shapes over a `Completer`.

Starlette (routing, requests, responses) with sse-starlette for the event stream, on any ASGI server
(uvicorn in `beeswarm serve`). Generation blocks, so each request's runs in a worker thread and hands
its text to the event loop through an anyio memory stream; the node keeps its own trio thread. A
client that goes away cancels the stream, which tells the worker to stop: its sessions on every stage
are closed before the next token.
"""
from __future__ import annotations

import hmac
import json
import logging
import math
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from beeswarm.api import schema
from beeswarm.api.engine import Cancelled, Completer, Job, Outcome, Rewind, chat_prompt, text_prompt
from beeswarm.api.schema import ApiError, ChatRequest, CompletionRequest
from beeswarm.api.webapp import WebApp

log = logging.getLogger(__name__)
_END = object()


class Admission:
    """At most `limit` generations at once (a cancelled one counts until its worker has ended)."""

    def __init__(self, limit: int):
        self.limit, self.active = limit, 0
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            if self.active >= self.limit:
                raise ApiError(429, f"{self.active} requests are being served (the limit is {self.limit}): "
                                    "try again shortly", code="too_many_requests", retry_after=1)
            self.active += 1

    def leave(self) -> None:
        with self._lock:
            self.active -= 1


def error_response(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
    return JSONResponse(e.body(), e.status, headers=headers)


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Api:
    def __init__(self, completer: Completer, api_key: str | None = None, max_concurrent: int = 8):
        self.completer, self.api_key = completer, api_key
        self.admission = Admission(max_concurrent)
        self.created = int(time.time())

    def app(self) -> Starlette:
        web = WebApp(self.completer, self.api_key is not None, self._refusal)
        routes = [Route("/health", self.health), Route("/v1/models", self.models),
                  Route("/v1/models/{model:path}", self.model),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]), *web.routes()]
        return Starlette(routes=routes, exception_handlers={HTTPException: self._http_error, Exception: self._bug})

    # errors ----------------------------------------------------------------------------------------
    async def _http_error(self, request: Request, e: Exception) -> Response:
        assert isinstance(e, HTTPException)
        return error_response(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}"))

    async def _bug(self, request: Request, e: Exception) -> Response:
        log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        return error_response(ApiError(500, "internal error (see the server's log)"))

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "a valid API key is required: Authorization: Bearer KEY", code="invalid_api_key")

    def _refusal(self, request: Request) -> Response | None:
        try:
            self._authorize(request)
        except ApiError as e:
            return error_response(e)
        return None

    def _check_model(self, model: str) -> None:
        if model != self.completer.model_id:
            raise ApiError(404, f"the model `{model}` does not exist: this swarm serves `{self.completer.model_id}`",
                           "model", "model_not_found")

    # routes ----------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        client = self.completer.client
        route = client.find_route()
        view = client.members.view()
        stages = [{"peer": s.node, "start": s.span.start, "end": s.span.end,
                   "sessions": view[s.node].sessions if s.node in view else None,
                   "reach": view[s.node].reach if s.node in view else "unknown",
                   "on_probation": client.on_probation(s)}
                  for s in (route.stages if route else ())]
        return JSONResponse({"status": "ok" if route else "no_route", "model": self.completer.model_id,
                             "route": stages, "members": len(view), "plan_epoch": client.coordinator.state.epoch,
                             "coordinator": client.coordinator.state.coordinator or None,
                             "reach": client.node.reachability.reach,
                             "active_requests": self.admission.active},
                            200 if route else 503)

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.completer.model_id, "object": "model", "created": self.created, "owned_by": "beeswarm"}

    async def models(self, request: Request) -> Response:
        if refused := self._refusal(request):
            return refused
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        try:
            self._authorize(request)
            self._check_model(request.path_params["model"])
        except ApiError as e:
            return error_response(e)
        return JSONResponse(self._model_card())

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, ChatRequest)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, CompletionRequest)

    async def _complete(self, request: Request, kind: type[ChatRequest] | type[CompletionRequest]) -> Response:
        try:
            self._authorize(request)
            body = schema.parse(await request.body(), kind)
            self._check_model(body.model)
            tokenizer = self.completer.tokenizer
            if isinstance(body, ChatRequest):
                ids, param = chat_prompt(tokenizer, body.messages), "messages"
            else:
                ids, param = text_prompt(tokenizer, body.prompt), "prompt"
            job = self.completer.job(ids, body.limit, body.temperature, body.top_p, body.seed, body.stops, param,
                                     bool(body.ignore_eos), body.repetition_penalty)
            self.admission.enter()
        except ApiError as e:
            return error_response(e)
        try:
            await anyio.to_thread.run_sync(self.completer.wait_for_route)
        except ApiError as e:
            self.admission.leave()
            return error_response(e)
        chat = isinstance(body, ChatRequest)
        shape = Shape(chat, self.completer.model_id, len(ids))
        worker = Worker(lambda push: self.completer.run(job, push), job, self.admission.leave).start()
        if body.stream:
            # (comments every KEEP_ALIVE_S while nothing comes: a failover waiting for a re-plan loses no client)
            return EventSourceResponse(shape.stream(worker, body.include_usage), sep="\n", ping=KEEP_ALIVE_S)
        return await shape.whole(worker)


KEEP_ALIVE_S = 10


class Worker:
    """One generation in a thread of its own (`start()`), its output handed to the event loop as it comes: text
    pieces, then the Outcome or an ApiError. `cancel()` ends it before its next token."""

    def __init__(self, work: Callable[[Callable[[object], None]], Outcome], job: Job, done: Callable[[], None]):
        self.work, self.job, self.done = work, job, done
        self._send, self._receive = anyio.create_memory_object_stream[object](math.inf)
        self._token = anyio.lowlevel.current_token()

    def start(self) -> Worker:
        threading.Thread(target=self._run, daemon=True, name="api-generation").start()
        return self

    def _push(self, item: object) -> None:
        try:
            anyio.from_thread.run_sync(self._send.send_nowait, item, token=self._token)
        except Exception:  # noqa: BLE001 - the response is gone (the client left, the server is stopping)
            self.job.cancelled.set()

    def _run(self) -> None:
        try:
            self._push(self.work(self._push))
        except Cancelled:
            pass
        except ApiError as e:
            self._push(e)
        except Exception:  # noqa: BLE001 - a bug: the client gets a 500-shaped error, the server goes on
            log.exception("generation failed")
            self._push(ApiError(500, "internal error (see the server's log)"))
        finally:
            self.done()
            self._push(_END)

    def cancel(self) -> None:
        self.job.cancelled.set()

    async def events(self) -> AsyncIterator[Any]:
        async with self._receive:
            async for item in self._receive:
                if item is _END:
                    return
                yield item


class Shape:
    """OpenAI's response shapes for one request: chat (`chat.completion`) or legacy (`text_completion`)."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int):
        self.chat, self.model, self.prompt_tokens = chat, model, prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    async def whole(self, worker: Worker) -> Response:
        try:
            return await self._whole(worker)
        finally:
            worker.cancel()  # a no-op once it has ended; stops it if this request was cancelled

    async def _whole(self, worker: Worker) -> Response:
        pieces: list[str] = []
        async for item in worker.events():
            if isinstance(item, ApiError):
                return error_response(item)
            if isinstance(item, str):
                pieces.append(item)
                continue
            if isinstance(item, Rewind):
                pieces = [item.text]
                continue
            text = "".join(pieces)
            if self.chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                          "logprobs": None, "finish_reason": item.finish_reason}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": item.finish_reason}
            body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
            return JSONResponse({**body, "usage": usage(self.prompt_tokens, item.completion_tokens),
                                 "beeswarm": item.extras()})
        return error_response(ApiError(500, "the generation ended without a result"))

    def _chunk(self, delta: dict[str, Any] | str, finish: str | None, with_usage: bool) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            body = self._envelope("text_completion", [{"index": 0, "text": delta, "logprobs": None,
                                                       "finish_reason": finish}])
        return {**body, "usage": None} if with_usage else body

    async def stream(self, worker: Worker, with_usage: bool) -> AsyncIterator[dict[str, str]]:
        """Server-sent events as OpenAI sends them: (chat: the role first), text deltas, the finish chunk,
        the usage chunk if asked, then [DONE]. An error after the stream began is an `error` event. The
        client leaving cancels this generator, and with it the generation."""
        try:
            async for event in self._stream(worker, with_usage):
                yield event
        finally:
            worker.cancel()

    async def _stream(self, worker: Worker, with_usage: bool) -> AsyncIterator[dict[str, str]]:
        def data(obj: dict[str, Any]) -> dict[str, str]:
            return {"data": json.dumps(obj, ensure_ascii=False, separators=(",", ":"))}

        if self.chat:
            yield data(self._chunk({"role": "assistant", "content": ""}, None, with_usage))
        sent = ""
        async for item in worker.events():
            if isinstance(item, ApiError):
                yield data(item.body())
                return
            if isinstance(item, Rewind):
                if item.text == sent:
                    continue  # nothing streamed was taken back
                # A stream cannot take text back: end it with an error the client can act on (retry).
                yield data(ApiError(502, "a contributor was caught by an audit returning wrong activations; "
                                         "text streamed so far is unreliable: retry the request",
                                    code="audit_failed").body())
                return
            if isinstance(item, str):
                sent += item
                yield data(self._chunk({"content": item} if self.chat else item, None, with_usage))
                continue
            yield data({**self._chunk({} if self.chat else "", item.finish_reason, with_usage),
                        "beeswarm": item.extras()})
            if with_usage:
                yield data({**self._envelope(self._chunk({}, None, False)["object"], []),
                            "usage": usage(self.prompt_tokens, item.completion_tokens)})
        yield {"data": "[DONE]"}
