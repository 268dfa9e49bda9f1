"""OpenAI-compatible endpoints: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

Request and response shapes follow OpenAI's API, so the ``openai`` package and
tools built on it work unchanged. ``stream: true`` answers with server-sent
events (``data: {chunk}`` lines, then ``data: [DONE]``); with
``stream_options: {"include_usage": true}`` a last chunk carries ``usage``, as
OpenAI does. Non-streamed answers always carry ``usage``.

Errors use OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``
with the HTTP status of the inferbus error (400, 401, 403, 404, 429 with
``Retry-After``, 503, 504). An error that happens after a stream started is
sent as one ``data: {"error": ...}`` event before ``[DONE]``. The first chunk is
awaited before the response starts, so an overloaded worker's refusal is a real
429, not an event inside a 200 stream.

A client that closes its connection cancels its request in the worker (and so
in vLLM) whenever it leaves: while its request waits for the first chunk,
while a non-streamed answer is collected, or mid-stream.

What a request may ask for is `inferbus_gateway.rest.openai_request`'s audit:
every field is served (content parts, ``n``, ``stop``, ``seed``, ``logprobs`` /
``top_logprobs``, ``response_format`` ``json_object``/``json_schema`` through
vLLM's structured outputs, ``stream_options.include_usage`` ...), inert at the
value given, or refused with 400 naming it in ``error.param``. Logprobs come
back in OpenAI's shape per endpoint (chat: ``{"content": [...]}``; completions:
``tokens``/``token_logprobs``/``top_logprobs``/``text_offset``); ``n`` > 1
streams each choice's chunks with their ``index``.

Extensions: ``ignore_eos``, ``top_k``, ``min_p``, ``repetition_penalty``
(vLLM's), the ``inferbus-timeout-ms`` header (the request's deadline, as for
V2) and ``x-request-id`` (the request id).

Every completion request gets what a V2 request gets from `RequestScope`: one
access-log line (protocol ``openai``; written when the answer ends, so a
stream's line carries its real length and outcome, ``CANCELLED`` when the
client left) and, when tracing samples it, a server span whose context the
request carries to the worker. ``/v1/models`` lists only the models the
caller's tenant may call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from inferbus_common.errors import (
    InferbusError,
    InvalidArgument,
    ResourceExhausted,
    StatusCode,
    Unauthenticated,
    status_of,
)
from inferbus_common.generation import GenerationChunk, TokenLogprob
from inferbus_gateway.admission import BreakerOpen
from inferbus_gateway.generation import GenerationCall, GenerationService
from inferbus_gateway.observation.access import RequestScope
from inferbus_gateway.rest.openai_request import InvalidField, parse_openai

log = logging.getLogger(__name__)

T = TypeVar("T")

TIMEOUT_HEADER = "inferbus-timeout-ms"
REQUEST_ID_HEADER = "x-request-id"
MAX_BODY_BYTES = 4 << 20
PROTOCOL = "openai"
"""The ``protocol`` of these requests in access-log lines and spans."""

_ERROR_TYPES = {
    StatusCode.INVALID_ARGUMENT: "invalid_request_error",
    StatusCode.FAILED_PRECONDITION: "invalid_request_error",
    StatusCode.NOT_FOUND: "not_found_error",
    StatusCode.UNAUTHENTICATED: "authentication_error",
    StatusCode.PERMISSION_DENIED: "permission_error",
    StatusCode.RESOURCE_EXHAUSTED: "rate_limit_error",
    StatusCode.DEADLINE_EXCEEDED: "timeout_error",
    StatusCode.UNAVAILABLE: "service_unavailable_error",
}


def error_body(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(HTTP status, OpenAI error JSON, headers) for an exception."""
    code, message = status_of(exc)
    headers: dict[str, str] = {}
    err_code: str | None = code.name.lower()
    if isinstance(exc, ResourceExhausted):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
        if exc.reason:
            headers["X-Inferbus-Reason"] = exc.reason
            err_code = exc.reason
    elif isinstance(exc, BreakerOpen):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    elif isinstance(exc, Unauthenticated):
        headers["WWW-Authenticate"] = "Bearer"
    body = {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(code, "server_error"),
            "param": exc.param if isinstance(exc, InvalidField) else None,
            "code": err_code,
        }
    }
    return code.http_status, body, headers


def _error(exc: BaseException) -> Response:
    status, body, headers = error_body(exc)
    return JSONResponse(body, status_code=status, headers=headers)


@dataclass(slots=True)
class _Exchange:
    """What `RequestScope` reads of a request and its answer (id, tenant, version)."""

    id: str
    tenant: str = ""
    version: str = ""
    degraded: bool = False
    timings_ms: dict[str, float] = field(default_factory=dict)


class _Ending:
    """Finishes a request's `RequestScope` exactly once, whichever path ends it."""

    __slots__ = ("done", "scope")

    def __init__(self, scope: RequestScope) -> None:
        self.scope = scope
        self.done = False

    def finish(self, exc: BaseException | None) -> None:
        """Finish the scope (span and access-log line) unless already done."""
        if not self.done:
            self.done = True
            self.scope.finish(exc)


def _answered(scope: RequestScope, call: GenerationCall) -> None:
    """Tell `scope` who asked and which version answered (before it finishes)."""
    # Duck-typed: the access log reads only the id, tenant and version of each.
    scope.request = _Exchange(call.request_id, call.tenant)  # type: ignore[assignment]
    scope.response = _Exchange(call.request_id, call.tenant, call.version)  # type: ignore[assignment]


def _usage(call: GenerationCall) -> dict[str, int]:
    return {
        "prompt_tokens": call.prompt_tokens,
        "completion_tokens": call.completion_tokens,
        "total_tokens": call.prompt_tokens + call.completion_tokens,
    }


def _finish(reason: str | None) -> str | None:
    # OpenAI has no "abort"; a stream stopped by the platform reads as "length"-less stop.
    return None if reason is None else ("stop" if reason == "abort" else reason)


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def _chat_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": _token_bytes(lp.token),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": _token_bytes(t)} for t, v in lp.top
                ],
            }
            for lp in logprobs
        ]
    }


def _completion_logprobs(logprobs: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """OpenAI's completions ``logprobs`` (parallel lists); `offset`: characters before."""
    offsets = []
    for lp in logprobs:
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [dict(lp.top) for lp in logprobs],
        "text_offset": offsets,
    }


class _Choices:
    """Shapes a call's chunks into OpenAI choices, one per index (``n`` of them).

    Streamed, each chunk becomes one choice of one event (the first of each index
    with ``role`` in chat); collected, the chunks of each index add up to one choice.
    """

    def __init__(self, call: GenerationCall, kind: str, logprobs: bool) -> None:
        self.call = call
        self.kind = kind
        self.logprobs = logprobs
        self._texts: dict[int, list[str]] = {}
        self._logprobs: dict[int, list[TokenLogprob]] = {}
        self._finish: dict[int, str | None] = {}
        self._offsets: dict[int, int] = {}
        """Characters of each completion streamed so far (completions' ``text_offset``)."""

    @property
    def prefix(self) -> str:
        """The answer id's prefix, as OpenAI's (``chatcmpl-`` / ``cmpl-``)."""
        return "chatcmpl-" if self.kind == "chat" else "cmpl-"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        call = self.call
        return {
            "id": self.prefix + call.request_id,
            "object": obj,
            "created": call.created,
            "model": call.model,
            "choices": choices,
        }

    def _logprobs_of(self, index: int, logprobs: list[TokenLogprob] | None) -> Any:
        if not self.logprobs:
            return None
        logprobs = logprobs or []
        if self.kind == "chat":
            return _chat_logprobs(logprobs)
        out = _completion_logprobs(logprobs, self._offsets.get(index, 0))
        self._offsets[index] = self._offsets.get(index, 0) + sum(len(lp.token) for lp in logprobs)
        return out

    def event(self, chunk: GenerationChunk) -> bytes:
        """One streamed chunk as an SSE ``data:`` line."""
        choice: dict[str, Any] = {"index": chunk.index}
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": chunk.text}
            if chunk.index not in self._texts:
                self._texts[chunk.index] = []
                delta["role"] = "assistant"
            choice["delta"] = delta
            obj = "chat.completion.chunk"
        else:
            choice["text"] = chunk.text
            obj = "text_completion"
        choice["logprobs"] = self._logprobs_of(chunk.index, chunk.logprobs)
        choice["finish_reason"] = _finish(chunk.finish_reason)
        return b"data: " + orjson.dumps(self._envelope(obj, [choice])) + b"\n\n"

    def usage_event(self) -> bytes:
        """The last chunk of a stream with ``include_usage``: no choices, the usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = self._envelope(obj, []) | {"usage": _usage(self.call)}
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def add(self, chunk: GenerationChunk) -> None:
        """Collect a chunk for `answer`."""
        self._texts.setdefault(chunk.index, []).append(chunk.text)
        if chunk.logprobs:
            self._logprobs.setdefault(chunk.index, []).extend(chunk.logprobs)
        if chunk.finish_reason is not None or chunk.index not in self._finish:
            self._finish[chunk.index] = chunk.finish_reason

    def answer(self) -> dict[str, Any]:
        """The non-streamed answer: every completion, in index order, and the usage."""
        choices = []
        for index in sorted(self._texts):
            text = "".join(self._texts[index])
            choice: dict[str, Any] = {"index": index}
            if self.kind == "chat":
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice["logprobs"] = self._logprobs_of(index, self._logprobs.get(index))
            choice["finish_reason"] = _finish(self._finish.get(index))
            choices.append(choice)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, choices) | {"usage": _usage(self.call)}


async def _disconnected(receive: Receive) -> None:
    """Return once the client has closed the connection (the body is read by then)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """A streaming response that notices a client leaving and closes its events.

    Starlette (ASGI 2.4 servers) learns that the client is gone only from a send
    that fails, so a client leaving while no chunk comes (queued in the engine,
    a long prefill, a worker that stalls) went unnoticed until the next chunk or
    the deadline, and the engine kept generating for nobody. Here the stream
    ends as soon as ``http.disconnect`` arrives, and closing the events runs
    `GenerationCall.chunks`' cleanup at once, which publishes the cancel that
    aborts the request in vLLM.
    """

    def __init__(
        self, events: AsyncGenerator[bytes, None], headers: dict[str, str], ending: _Ending
    ) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events = events
        self._ending = ending

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(super().__call__(scope, receive, send))
        watcher = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not stream.done():
                stream.cancel()
            await asyncio.wait({stream})
            await self._events.aclose()
            # A stream closed before its first line never ran its own cleanup.
            self._ending.finish(asyncio.CancelledError())
        if not stream.cancelled() and (error := stream.exception()) is not None:
            raise error


async def _events(
    choices: _Choices,
    first: GenerationChunk | None,
    rest: AsyncGenerator[GenerationChunk, None],
    include_usage: bool,
    ending: _Ending,
) -> AsyncGenerator[bytes, None]:
    """SSE lines: the first chunk (already received), the rest, usage, [DONE].

    The request's scope ends with the stream: with the error it carried, or
    with the `GeneratorExit` of a client that left (logged ``CANCELLED``).
    """
    call = choices.call
    outcome: BaseException | None = None
    try:
        if first is not None:
            yield choices.event(first)
            async for chunk in rest:
                yield choices.event(chunk)
        if include_usage:
            yield choices.usage_event()
    except InferbusError as exc:
        outcome = exc
        _, body, _ = error_body(exc)
        yield b"data: " + orjson.dumps(body) + b"\n\n"
    except BaseException as exc:  # GeneratorExit / CancelledError: the client left
        outcome = exc
        raise
    finally:
        await rest.aclose()
        _answered(ending.scope, call)
        if outcome is not None:
            ending.scope.response = None
        ending.finish(outcome)
    yield b"data: [DONE]\n\n"


class _ClientGone(asyncio.CancelledError):
    """The client closed the connection before a non-streamed answer was ready."""


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first.

    Used from the moment a request is published: for the wait for the first
    chunk (a request may wait in the engine behind running ones) and for the
    whole of a non-streamed answer. Once a stream has started, Starlette
    watches for ``http.disconnect`` instead. Cancelling the chunk iteration
    publishes the cancel, so vLLM frees the sequence's KV cache at once.

    Raises:
        _ClientGone: the client left first.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # its cleanup publishes the cancel
    if task.cancelled():
        raise _ClientGone()
    return task.result()


def openai_routes(service: GenerationService) -> list[Route]:
    """The OpenAI-compatible routes around a `GenerationService`."""

    async def list_models(request: Request) -> Response:
        try:
            visible = await service.visible_models(request.headers)
        except InferbusError as exc:
            return _error(exc)
        data = [
            {
                "id": dv.model,
                "object": "model",
                "created": dv.created_unix_ms // 1000,
                "owned_by": "inferbus",
                "root": dv.model,
                "parent": None,
                "version": dv.version,
            }
            for dv in visible
        ]
        return JSONResponse({"object": "list", "data": data})

    async def read_body(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise InvalidArgument(f"request body exceeds {MAX_BODY_BYTES} bytes")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise InvalidArgument(f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise InvalidArgument("the body must be a JSON object")
        return body

    async def generate(request: Request, kind: str) -> Response:
        t0 = time.monotonic()
        traceparent = request.headers.get("traceparent", "")
        try:
            body = await read_body(request)
        except InferbusError as exc:
            RequestScope(PROTOCOL, "", traceparent, service.access_log).start().finish(exc)
            return _error(exc)
        model = body.get("model")
        scope = RequestScope(
            PROTOCOL, model if isinstance(model, str) else "", traceparent, service.access_log
        )
        ending = _Ending(scope.start())
        try:
            return await _generate(request, body, kind, ending, t0)
        except BaseException as exc:
            ending.finish(exc)
            raise

    async def _generate(
        request: Request, body: dict[str, Any], kind: str, ending: _Ending, t0: float
    ) -> Response:
        """`generate` once the body is read: every return has finished `ending`
        or handed it to the event stream."""
        scope = ending.scope
        try:
            parsed = parse_openai(body, kind)
            model, gen_request, stream = parsed.model, parsed.request, parsed.stream
            timeout = request.headers.get(TIMEOUT_HEADER)
            try:
                timeout_s = float(timeout) / 1000.0 if timeout is not None else None
            except ValueError:
                raise InvalidArgument(f"{TIMEOUT_HEADER} must be a number") from None
            call = await service.open(
                model,
                gen_request,
                request.headers,
                timeout_s=timeout_s,
                request_id=request.headers.get(REQUEST_ID_HEADER, ""),
                traceparent=scope.traceparent,
            )
        except InferbusError as exc:
            ending.finish(exc)
            return _error(exc)
        _answered(scope, call)
        chunks = call.chunks()
        choices = _Choices(call, kind, gen_request.logprobs is not None)

        async def first_chunk() -> GenerationChunk | None:
            # Waited for before a stream starts: a refusal (429 from a full worker)
            # or an error is then a proper HTTP status, not an event in a 200 stream.
            try:
                return await anext(chunks)
            except StopAsyncIteration:
                return None

        async def collect() -> None:
            # To the end (the stream ends right after the final chunk), so the call
            # counts as answered rather than cancelled.
            try:
                async for chunk in chunks:
                    choices.add(chunk)
            finally:
                await chunks.aclose()

        # The client is watched from here on, not from the first chunk: a request
        # queued in the engine behind running ones, or a slow first token, would
        # otherwise be generated on for a client that left (and only cancelled
        # once its first chunk came, seconds or minutes later).
        first: GenerationChunk | None = None
        try:
            if stream:
                first = await _unless_disconnected(request, first_chunk())
            else:
                await _unless_disconnected(request, collect())
        except InferbusError as exc:
            scope.response = None
            ending.finish(exc)
            return _error(exc)
        except _ClientGone as exc:
            scope.response = None
            ending.finish(exc)
            return Response(status_code=499)  # nobody reads it; uvicorn drops it
        headers = {REQUEST_ID_HEADER: call.request_id}
        if stream:
            headers["Cache-Control"] = "no-cache"
            events = _events(choices, first, chunks, parsed.include_usage, ending)
            return _EventStream(events, headers, ending)
        _answered(scope, call)
        ending.finish(None)
        headers["Server-Timing"] = f"total;dur={(time.monotonic() - t0) * 1000.0:.3f}"
        return JSONResponse(choices.answer(), headers=headers)

    async def chat(request: Request) -> Response:
        return await generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    return [
        Route("/v1/models", list_models),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
