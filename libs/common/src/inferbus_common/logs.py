"""Structured logging: JSON lines with a fixed set of fields."""

from __future__ import annotations

import json
import logging
import sys
import time

#: Extra fields copied from `logger.info(..., extra={...})` into the JSON line.
CONTEXT_FIELDS = (
    "request_id",
    "trace_id",
    "model",
    "version",
    "tenant",
    "latency_ms",
    "status",
    "worker_id",
    "pool",
    "batch_size",
    "nats_url",
    "port",
    "reason",
)


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
            "msg": record.getMessage(),
        }
        for key in CONTEXT_FIELDS:
            value = record.__dict__.get(key)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(service: str, level: str = "INFO", fmt: str = "json") -> None:
    """Configure the root logger once for a service process."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("uvicorn.access", "nats"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
