"""Starlette application serving the KServe V2 REST API."""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inferbus_common.errors import (
    InferbusError,
    InvalidArgument,
    ResourceExhausted,
    Unauthenticated,
    status_of,
)
from inferbus_gateway.admission import BreakerOpen
from inferbus_gateway.rest.codec import HEADER_LENGTH, request_from_http, response_to_http
from inferbus_gateway.service import InferenceService

log = logging.getLogger(__name__)

TIMEOUT_HEADER = "inferbus-timeout-ms"


def _error(exc: BaseException) -> Response:
    code, message = status_of(exc)
    headers = {}
    if isinstance(exc, ResourceExhausted):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
        if exc.reason:
            headers["X-Inferbus-Reason"] = exc.reason
    elif isinstance(exc, BreakerOpen):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    elif isinstance(exc, Unauthenticated):
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse({"error": message}, status_code=code.http_status, headers=headers)


def _server_timing(timings: dict[str, float]) -> str:
    return ", ".join(f"{k};dur={v:.3f}" for k, v in timings.items())


def rest_app(service: InferenceService, max_body_bytes: int) -> Starlette:
    """Build the V2 REST app around an `InferenceService`."""

    async def live(_: Request) -> Response:
        return JSONResponse({"live": service.live()})

    async def ready(_: Request) -> Response:
        ok, reason = service.ready()
        return JSONResponse({"ready": ok, "reason": reason}, status_code=200 if ok else 503)

    async def server_metadata(_: Request) -> Response:
        return JSONResponse(service.server_metadata())

    async def model_metadata(request: Request) -> Response:
        p = request.path_params
        try:
            await service.authorize(request.headers, p["model"])
            return JSONResponse(service.model_metadata(p["model"], p.get("version", "")))
        except InferbusError as exc:
            return _error(exc)

    async def model_ready(request: Request) -> Response:
        p = request.path_params
        ok = service.model_ready(p["model"], p.get("version", ""))
        return JSONResponse({"name": p["model"], "ready": ok}, status_code=200 if ok else 400)

    async def infer(request: Request) -> Response:
        p = request.path_params
        try:
            declared = request.headers.get("content-length")
            if declared is not None and int(declared) > max_body_bytes:
                raise InvalidArgument(
                    f"request body of {declared} bytes exceeds the limit of {max_body_bytes}"
                )
            body = await request.body()
            if len(body) > max_body_bytes:
                raise InvalidArgument(
                    f"request body of {len(body)} bytes exceeds the limit of {max_body_bytes}"
                )
            hl = request.headers.get(HEADER_LENGTH)
            timeout_ms = request.headers.get(TIMEOUT_HEADER)
            try:
                header_length = int(hl) if hl is not None else None
                timeout_s = float(timeout_ms) / 1000.0 if timeout_ms is not None else None
            except ValueError:
                raise InvalidArgument(
                    f"{HEADER_LENGTH} and {TIMEOUT_HEADER} must be numbers"
                ) from None
            req, binary_outputs, binary_all = request_from_http(
                p["model"], p.get("version", ""), body, header_length, timeout_s
            )
            req.traceparent = request.headers.get("traceparent", "")
            resp = await service.infer(req, "http", request.headers)
            payload, json_len = response_to_http(resp, binary_outputs, binary_all)
        except InferbusError as exc:
            return _error(exc)
        except Exception as exc:
            log.exception("unhandled error in REST infer")
            return _error(exc)
        headers = {"Server-Timing": _server_timing(resp.timings_ms)}
        if resp.degraded:
            headers["X-Inferbus-Degraded"] = resp.degraded
        if json_len is not None:
            headers[HEADER_LENGTH] = str(json_len)
            return Response(payload, media_type="application/octet-stream", headers=headers)
        return Response(payload, media_type="application/json", headers=headers)

    return Starlette(
        routes=[
            Route("/v2/health/live", live),
            Route("/v2/health/ready", ready),
            Route("/v2", server_metadata),
            Route("/v2/models/{model}", model_metadata),
            Route("/v2/models/{model}/versions/{version}", model_metadata),
            Route("/v2/models/{model}/ready", model_ready),
            Route("/v2/models/{model}/versions/{version}/ready", model_ready),
            Route("/v2/models/{model}/infer", infer, methods=["POST"]),
            Route("/v2/models/{model}/versions/{version}/infer", infer, methods=["POST"]),
        ]
    )
