"""Starlette application serving the KServe V2 REST API.

Every error answer is JSON ``{"error": message}`` (OpenAI's error shape
under ``/v1``), also for paths no route matches (404), methods a route does
not take (405) and failures outside the handlers (500), so Triton's and
KServe's clients can read it. The infer endpoint takes and gives
gzip/deflate bodies (`inferbus_gateway.rest.compression`); a body over the
limit is 413, refused while it is read.
"""

from __future__ import annotations

import logging
import math
from http import HTTPStatus

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inferbus_common.errors import (
    InferbusError,
    InvalidArgument,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    status_of,
)
from inferbus_gateway.admission import BreakerOpen
from inferbus_gateway.canonical import InferRequest, InferResponse
from inferbus_gateway.generation import GenerationService
from inferbus_gateway.observation.access import RequestScope
from inferbus_gateway.rest.codec import HEADER_LENGTH, request_from_http, response_to_http
from inferbus_gateway.rest.compression import (
    BodyTooLarge,
    compress,
    decompress,
    response_encoding,
)
from inferbus_gateway.rest.extensions import extension_routes
from inferbus_gateway.rest.openai import error_body, openai_routes
from inferbus_gateway.rest.repository import repository_routes
from inferbus_gateway.service import InferenceService
from inferbus_gateway.triton.classification import Classifier
from inferbus_gateway.triton.repository import RepositoryExtension

log = logging.getLogger(__name__)

TIMEOUT_HEADER = "inferbus-timeout-ms"


def _error(exc: BaseException) -> Response:
    code, message = status_of(exc)
    status = 413 if isinstance(exc, BodyTooLarge) else code.http_status
    headers = {}
    if isinstance(exc, ResourceExhausted):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
        if exc.reason:
            headers["X-Inferbus-Reason"] = exc.reason
    elif isinstance(exc, BreakerOpen):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    elif isinstance(exc, Unauthenticated):
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no route: 404, wrong method: 405) as JSON errors."""
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    if status == 404:
        message = f"no such endpoint: {request.method} {request.url.path}"
    elif status == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"{request.method} is not allowed on {request.url.path} (allowed: {allowed})"
    else:
        message = exc.detail if exc.detail and exc.detail != phrase else phrase
    headers = dict(exc.headers or {})
    if request.url.path.startswith("/v1/"):
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": status}
        return JSONResponse({"error": error}, status_code=status, headers=headers)
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    """An exception no handler caught: 500 with a JSON error, its text kept out."""
    log.error("unhandled error on %s %s: %r", request.method, request.url.path, exc)
    if request.url.path.startswith("/v1/"):
        status, body, headers = error_body(exc)
        return JSONResponse(body, status_code=status, headers=headers)
    return _error(exc)


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused as soon as it grows past `limit` bytes.

    A chunked body declares no length; reading it whole first (as
    ``request.body()`` does) would let one client make the gateway hold any
    amount of memory before the size check.
    """
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _classify(
    classifier: Classifier | None, request: InferRequest, response: InferResponse
) -> None:
    """Apply the classification extension to an answer (both protocols call this)."""
    if classifier is None:
        raise Unavailable("the classification extension needs the registry (labels files)")
    await classifier.apply(request, response)


def _server_timing(timings: dict[str, float]) -> str:
    return ", ".join(f"{k};dur={v:.3f}" for k, v in timings.items())


def rest_app(
    service: InferenceService,
    max_body_bytes: int,
    *,
    access_log: bool = True,
    repository: RepositoryExtension | None = None,
    generation: GenerationService | None = None,
    classifier: Classifier | None = None,
) -> Starlette:
    """Build the V2 REST app around an `InferenceService`.

    Args:
        service: the protocol-neutral gateway.
        max_body_bytes: largest request body accepted.
        access_log: write one access-log line per inference request.
        repository: Triton's model repository extension (None: its routes are absent).
        generation: the OpenAI-compatible endpoints (None: their routes are absent).
        classifier: Triton's classification extension (None: requests for it are refused).
    """

    async def live(_: Request) -> Response:
        return JSONResponse({"live": service.live()})

    async def ready(_: Request) -> Response:
        ok, reason = service.ready()
        if ok:
            return JSONResponse({"ready": ok, "reason": reason})
        return JSONResponse(
            {"ready": ok, "reason": reason, "error": f"not ready: {reason}"}, status_code=503
        )

    async def server_metadata(_: Request) -> Response:
        return JSONResponse(service.server_metadata())

    async def model_metadata(request: Request) -> Response:
        p = request.path_params
        try:
            await service.authorize(request.headers, p["model"])
            return JSONResponse(service.model_metadata(p["model"], p.get("version", "")))
        except InferbusError as exc:
            return _error(exc)

    async def model_config(request: Request) -> Response:
        p = request.path_params
        try:
            await service.authorize(request.headers, p["model"])
            return JSONResponse(service.model_config(p["model"], p.get("version", "")))
        except InferbusError as exc:
            return _error(exc)

    async def model_stats(request: Request) -> Response:
        p = request.path_params
        try:
            entries = await service.model_statistics(
                request.headers, p.get("model", ""), p.get("version", "")
            )
        except InferbusError as exc:
            return _error(exc)
        return JSONResponse({"model_stats": entries})

    async def model_ready(request: Request) -> Response:
        p = request.path_params
        ok = service.model_ready(p["model"], p.get("version", ""))
        if ok:
            return JSONResponse({"name": p["model"], "ready": ok})
        version = f" version '{p['version']}'" if p.get("version") else ""
        error = f"model '{p['model']}'{version} is not ready"
        return JSONResponse({"name": p["model"], "ready": ok, "error": error}, status_code=400)

    async def infer(request: Request) -> Response:
        p = request.path_params
        scope = RequestScope(
            "http", p["model"], request.headers.get("traceparent", ""), access_log, service.trace
        )
        try:
            scope.start()
            declared = request.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
                raise BodyTooLarge(
                    f"request body of {declared} bytes exceeds the limit of {max_body_bytes}"
                )
            body = await _read_body(request, max_body_bytes)
            body = decompress(body, request.headers.get("content-encoding", ""), max_body_bytes)
            hl = request.headers.get(HEADER_LENGTH)
            timeout_ms = request.headers.get(TIMEOUT_HEADER)
            try:
                header_length = int(hl) if hl is not None else None
                timeout_s = float(timeout_ms) / 1000.0 if timeout_ms is not None else None
            except ValueError:
                raise InvalidArgument(
                    f"{HEADER_LENGTH} and {TIMEOUT_HEADER} must be numbers"
                ) from None
            if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
                # A zero, negative, NaN or infinite deadline is the client's mistake,
                # not a request that timed out in the platform.
                raise InvalidArgument(
                    f"{TIMEOUT_HEADER} must be a positive, finite number of milliseconds"
                )
            req, binary_outputs, binary_all = request_from_http(
                p["model"], p.get("version", ""), body, header_length, timeout_s
            )
            req.traceparent = scope.traceparent
            scope.request = req
            resp = await service.infer(req, "http", request.headers)
            scope.response = resp
            if req.classification:
                await _classify(classifier, req, resp)
            payload, json_len = response_to_http(resp, binary_outputs, binary_all)
        except InferbusError as exc:
            scope.finish(exc)
            return _error(exc)
        except Exception as exc:
            log.exception("unhandled error in REST infer")
            scope.finish(exc)
            return _error(exc)
        except BaseException as exc:
            scope.finish(exc)
            raise
        scope.finish(None)
        headers = {"Server-Timing": _server_timing(resp.timings_ms)}
        if resp.degraded:
            headers["X-Inferbus-Degraded"] = resp.degraded
        media_type = "application/json"
        if json_len is not None:
            # The JSON length counts uncompressed bytes, as the client reads them.
            headers[HEADER_LENGTH] = str(json_len)
            media_type = "application/octet-stream"
        encoding = response_encoding(request.headers.get("accept-encoding", ""))
        if encoding is not None:
            payload = compress(payload, encoding)
            headers["Content-Encoding"] = encoding
            headers["Vary"] = "Accept-Encoding"
        return Response(payload, media_type=media_type, headers=headers)

    return Starlette(
        exception_handlers={HTTPException: _http_exception, Exception: _server_error},
        routes=[
            Route("/v2/health/live", live),
            Route("/v2/health/ready", ready),
            Route("/v2", server_metadata),
            Route("/v2/", server_metadata),  # as the Open Inference Protocol spec writes it
            Route("/v2/models/stats", model_stats),
            Route("/v2/models/{model}/stats", model_stats),
            Route("/v2/models/{model}/versions/{version}/stats", model_stats),
            Route("/v2/models/{model}", model_metadata),
            Route("/v2/models/{model}/versions/{version}", model_metadata),
            Route("/v2/models/{model}/config", model_config),
            Route("/v2/models/{model}/versions/{version}/config", model_config),
            Route("/v2/models/{model}/ready", model_ready),
            Route("/v2/models/{model}/versions/{version}/ready", model_ready),
            Route("/v2/models/{model}/infer", infer, methods=["POST"]),
            Route("/v2/models/{model}/versions/{version}/infer", infer, methods=["POST"]),
            # Triton's shared-memory, trace and logging extensions.
            *extension_routes(service),
            # Triton's model repository extension (when the registry address is set).
            *(repository_routes(repository) if repository is not None else []),
            # OpenAI-compatible generative endpoints (/v1/...).
            *(openai_routes(generation) if generation is not None else []),
        ],
    )
