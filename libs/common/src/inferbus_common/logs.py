"""Structured logging: JSON lines with a fixed set of fields.

Every line has ``ts`` (UTC, ms), ``level``, ``service``, ``logger`` and
``msg``, plus whichever context fields (`CONTEXT_FIELDS`) apply: a call passes
them with ``extra={...}``, or a block binds them for every line it logs with
`log_context` (a `contextvars` binding, so concurrent requests on one event
loop never see each other's fields). ``extra`` wins over a binding.

Secrets never reach a line: the fields are a fixed list (no headers, no
tensors), and the message and traceback text go through `redact`, which masks
bearer tokens, JWTs and inferbus API keys (``ib_…``) that a careless format
string or an exception message might carry.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
import sys
import time
from collections.abc import Iterator

import orjson

#: Fields copied into the JSON line from ``extra={...}`` or `log_context`.
CONTEXT_FIELDS = (
    "request_id",
    "trace_id",
    "model",
    "version",
    "tenant",
    "latency_ms",
    "status",
    "protocol",
    "worker_id",
    "pool",
    "batch_size",
    "nats_url",
    "port",
    "reason",
    # route changes (router)
    "revision",
    "updated_by",
    "change",
    "stable",
    "canary",
    "canary_weight",
    "shadow",
    "shadow_rate",
    "sticky",
)

_context: contextvars.ContextVar[dict[str, object] | None] = contextvars.ContextVar(
    "inferbus_log_context", default=None
)

_SECRETS = re.compile(
    r"(?i:bearer)\s+[A-Za-z0-9._~+/=-]+"  # Authorization: Bearer <anything>
    r"|\beyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*"  # a JWT
    r"|\bib_[A-Za-z0-9_-]{16,}"  # an inferbus API key
)
REDACTED = "[REDACTED]"


def redact(text: str) -> str:
    """`text` with bearer tokens, JWTs and inferbus API keys masked."""
    if "eyJ" not in text and "ib_" not in text and "earer" not in text and "EARER" not in text:
        return text  # the common case: nothing that could match, no regex run
    return _SECRETS.sub(REDACTED, text)


@contextlib.contextmanager
def log_context(**fields: object) -> Iterator[None]:
    """Add `fields` to every line logged inside the block (in this task/context).

    Example::

        with log_context(request_id=rid, model="fraud"):
            log.info("loaded")   # carries request_id and model
    """
    current = _context.get()
    token = _context.set({**current, **fields} if current else dict(fields))
    try:
        yield
    finally:
        _context.reset(token)


class JsonFormatter(logging.Formatter):
    """Formats records as one JSON object per line."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        """Render a record with `ts`, `level`, `service`, `msg` and context fields."""
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self._service,
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        bound = _context.get()
        attrs = record.__dict__
        for key in CONTEXT_FIELDS:
            value = attrs.get(key)
            if value is None and bound is not None:
                value = bound.get(key)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exc"] = redact(self.formatException(record.exc_info))
        return orjson.dumps(out, default=str).decode()


class _TextFormatter(logging.Formatter):
    """The human format, with the same redaction as the JSON one."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def setup_logging(service: str, level: str = "INFO", fmt: str = "json") -> None:
    """Configure the root logger once for a service process."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(
            _TextFormatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("uvicorn.access", "nats"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
