"""REST routes of Triton's shared-memory, trace and logging extensions.

Paths and bodies as Triton's HTTP/REST protocol:

* ``GET /v2/systemsharedmemory[/region/{name}]/status`` → ``[{name, key,
  offset, byte_size}]``; ``POST /v2/systemsharedmemory/region/{name}/register``
  with ``{"key", "offset", "byte_size"}``; ``POST
  /v2/systemsharedmemory[/region/{name}]/unregister``
  (`inferbus_gateway.triton.sharedmemory`);
* the same under ``/v2/cudasharedmemory``: status is empty, unregistering
  nothing succeeds, registering is 400 naming the unsupported extension;
* ``GET|POST /v2[/models/{model}]/trace/setting`` (``trace_level`` a list,
  the others strings; ``null`` resets a model's key) and ``GET|POST
  /v2/logging`` (`inferbus_gateway.triton.tracelog`).

Errors are ``{"error": message}`` with the usual status codes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inferbus_common.errors import (
    InferbusError,
    InvalidArgument,
    Unavailable,
    Unimplemented,
)
from inferbus_gateway.rest.repository import error_response
from inferbus_gateway.service import InferenceService
from inferbus_gateway.triton.sharedmemory import CUDA_UNSUPPORTED

log = logging.getLogger(__name__)

MAX_BODY = 1 << 16
"""Settings and registrations are small; a larger body is refused."""


async def _body(request: Request) -> dict[str, Any]:
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY:
            raise InvalidArgument(f"request body exceeds {MAX_BODY} bytes")
    if not raw.strip():
        return {}
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"request body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("request body must be a JSON object")
    return doc


def _handler(
    what: str, fn: Callable[[Request], Awaitable[Response]]
) -> Callable[[Request], Awaitable[Response]]:
    async def handle(request: Request) -> Response:
        try:
            return await fn(request)
        except InferbusError as exc:
            return error_response(exc)
        except Exception as exc:
            log.exception("unhandled error in %s", what)
            return error_response(exc)

    return handle


def _uint(doc: dict[str, Any], key: str, default: int | None = None) -> int:
    value = doc.get(key, default)
    if type(value) is not int or value < 0:
        raise InvalidArgument(f'"{key}" must be a non-negative integer, got {value!r}')
    return value


def _trace_json(doc: dict[str, list[str]]) -> dict[str, Any]:
    """Triton's HTTP form: ``trace_level`` is a list, every other value a string."""
    return {k: (v if k == "trace_level" else (v[0] if v else "")) for k, v in doc.items()}


def extension_routes(service: InferenceService) -> list[Route]:
    """The shared-memory, trace and logging routes served by `service`."""

    def shm():
        if service.shared_memory is None:
            raise Unavailable("system shared memory is not served by this gateway")
        return service.shared_memory

    async def shm_status(request: Request) -> Response:
        owner = await service.caller(request.headers)
        return JSONResponse(shm().status(owner, request.path_params.get("name", "")))

    async def shm_register(request: Request) -> Response:
        owner = await service.caller(request.headers)
        doc = await _body(request)
        key = doc.get("key")
        if not isinstance(key, str):
            raise InvalidArgument('"key" must be the shared-memory object\'s name')
        shm().register(
            owner,
            request.path_params["name"],
            key,
            _uint(doc, "offset", 0),
            _uint(doc, "byte_size"),
        )
        return Response(status_code=200)

    async def shm_unregister(request: Request) -> Response:
        owner = await service.caller(request.headers)
        shm().unregister(owner, request.path_params.get("name", ""))
        return Response(status_code=200)

    async def cuda_status(request: Request) -> Response:
        await service.caller(request.headers)
        if request.path_params.get("name"):
            raise Unimplemented(CUDA_UNSUPPORTED)
        return JSONResponse([])

    async def cuda_register(request: Request) -> Response:
        raise Unimplemented(CUDA_UNSUPPORTED)

    async def cuda_unregister(request: Request) -> Response:
        await service.caller(request.headers)
        if request.path_params.get("name"):
            raise Unimplemented(CUDA_UNSUPPORTED)
        return Response(status_code=200)

    async def trace_setting(request: Request) -> Response:
        if service.trace is None:
            raise Unavailable("trace settings are not served by this gateway")
        model = request.path_params.get("model", "")
        change = request.method == "POST"
        await service.authorize_settings(request.headers, change=change)
        if model:
            service.resolve(model)
        if not change:
            return JSONResponse(_trace_json(service.trace.get(model)))
        changes: dict[str, list[str] | None] = {}
        for key, value in (await _body(request)).items():
            if value is None:
                changes[key] = None
            elif isinstance(value, str):
                changes[key] = [value]
            elif isinstance(value, list) and all(isinstance(v, str) for v in value):
                changes[key] = value
            else:
                raise InvalidArgument(
                    f'trace setting "{key}" must be a string, a list of strings or null'
                )
        return JSONResponse(_trace_json(service.trace.update(model, changes)))

    async def logging_settings(request: Request) -> Response:
        if service.log_settings is None:
            raise Unavailable("log settings are not served by this gateway")
        change = request.method == "POST"
        await service.authorize_settings(request.headers, change=change)
        if not change:
            return JSONResponse(service.log_settings.get())
        return JSONResponse(service.log_settings.update(await _body(request)))

    shm_base = "/v2/systemsharedmemory"
    cuda_base = "/v2/cudasharedmemory"
    return [
        Route(f"{shm_base}/status", _handler("shm status", shm_status)),
        Route(f"{shm_base}/region/{{name}}/status", _handler("shm status", shm_status)),
        Route(
            f"{shm_base}/region/{{name}}/register",
            _handler("shm register", shm_register),
            methods=["POST"],
        ),
        Route(
            f"{shm_base}/unregister", _handler("shm unregister", shm_unregister), methods=["POST"]
        ),
        Route(
            f"{shm_base}/region/{{name}}/unregister",
            _handler("shm unregister", shm_unregister),
            methods=["POST"],
        ),
        Route(f"{cuda_base}/status", _handler("cuda status", cuda_status)),
        Route(f"{cuda_base}/region/{{name}}/status", _handler("cuda status", cuda_status)),
        Route(
            f"{cuda_base}/region/{{name}}/register",
            _handler("cuda register", cuda_register),
            methods=["POST"],
        ),
        Route(
            f"{cuda_base}/unregister",
            _handler("cuda unregister", cuda_unregister),
            methods=["POST"],
        ),
        Route(
            f"{cuda_base}/region/{{name}}/unregister",
            _handler("cuda unregister", cuda_unregister),
            methods=["POST"],
        ),
        Route(
            "/v2/trace/setting", _handler("trace settings", trace_setting), methods=["GET", "POST"]
        ),
        Route(
            "/v2/models/{model}/trace/setting",
            _handler("trace settings", trace_setting),
            methods=["GET", "POST"],
        ),
        Route("/v2/logging", _handler("log settings", logging_settings), methods=["GET", "POST"]),
    ]
