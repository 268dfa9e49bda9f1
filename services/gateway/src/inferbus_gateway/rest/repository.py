"""REST routes of Triton's model repository extension (``/v2/repository/...``).

Bodies as Triton's HTTP/REST protocol: the index takes ``{"ready": bool}``
(optional) and answers a JSON array of ``{name, version, state, reason}``;
load and unload take ``{"parameters": {...}}`` (optional) and answer 200 with
an empty body. Errors are ``{"error": message}`` with the usual status codes.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inferbus_common.errors import InferbusError, InvalidArgument, Unauthenticated, status_of
from inferbus_gateway.triton.repository import RepositoryExtension

log = logging.getLogger(__name__)

MAX_BODY = 1 << 20
"""Repository requests are small; a larger body is refused."""


def error_response(exc: BaseException) -> Response:
    """An error as Triton's REST answers it: ``{"error": message}`` with its status."""
    code, message = status_of(exc)
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthenticated) else {}
    return JSONResponse({"error": message}, status_code=code.http_status, headers=headers)


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise InvalidArgument(f"repository request body exceeds {MAX_BODY} bytes")
    if not raw.strip():
        return {}
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"repository request body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("repository request body must be a JSON object")
    params = doc.get("parameters", {})
    if not isinstance(params, dict):
        raise InvalidArgument('"parameters" must be a JSON object')
    return doc


def repository_routes(ext: RepositoryExtension) -> list[Route]:
    """The three ``/v2/repository`` routes served by `ext`."""

    async def index(request: Request) -> Response:
        try:
            doc = await _body(request)
            ready = doc.get("ready", False)
            if not isinstance(ready, bool):
                raise InvalidArgument('"ready" must be true or false')
            entries = await ext.run("index", lambda: ext.index(request.headers, ready_only=ready))
        except InferbusError as exc:
            return error_response(exc)
        except Exception as exc:
            log.exception("unhandled error in repository index")
            return error_response(exc)
        return JSONResponse([e.as_json() for e in entries])

    async def load(request: Request) -> Response:
        model = request.path_params["model"]
        try:
            params = (await _body(request)).get("parameters", {})
            await ext.run("load", lambda: ext.load(request.headers, model, params))
        except InferbusError as exc:
            return error_response(exc)
        except Exception as exc:
            log.exception("unhandled error in repository load")
            return error_response(exc)
        return Response(status_code=200)

    async def unload(request: Request) -> Response:
        model = request.path_params["model"]
        try:
            await _body(request)  # parameters (e.g. unload_dependents) have no effect here
            await ext.run("unload", lambda: ext.unload(request.headers, model))
        except InferbusError as exc:
            return error_response(exc)
        except Exception as exc:
            log.exception("unhandled error in repository unload")
            return error_response(exc)
        return Response(status_code=200)

    return [
        Route("/v2/repository/index", index, methods=["POST"]),
        Route("/v2/repository/models/{model}/load", load, methods=["POST"]),
        Route("/v2/repository/models/{model}/unload", unload, methods=["POST"]),
    ]
