"""Triton's trace and logging extensions, mapped onto the gateway's tracing and log level.

**Trace settings** (gRPC ``TraceSetting``, REST ``/v2[/models/{m}]/trace/setting``):
the gateway is where inferbus decides whether a request is traced
(`inferbus_common.tracing`: the other services follow the request's
``traceparent`` flag), so Triton's settings steer the gateway's sampler:

* ``trace_level``: ``["OFF"]`` (the gateway starts no trace and records no
  span) or ``["TIMESTAMPS"]`` (spans with their timings); ``TENSORS`` is
  refused: spans never carry tensor data.
* ``trace_rate``: trace 1 request in N (ratio 1/N; the configured
  ``tracing_sample_ratio`` shows as its rounded N).
* ``trace_count``: traces left to take before tracing stops (-1: no limit).
* ``trace_mode`` (``opentelemetry``), ``trace_file`` (``""``) and
  ``log_frequency`` (``0``) are read-only: spans are exported over OTLP.

A model's settings override the global ones key by key; an empty value list
(REST: ``null``) resets a key to the global value. Turning tracing on needs a
gateway started with tracing enabled (an exporter): otherwise
FAILED_PRECONDITION says how to start it.

**Log settings** (gRPC ``LogSettings``, REST ``/v2/logging``): ``log_info``,
``log_warning``, ``log_error`` and ``log_verbose_level`` set the gateway's
log level (inferbus logs by threshold: verbose → DEBUG, info → INFO, ...; a
combination that is no threshold, like info without warnings, is refused),
``log_format`` is ``json`` or ``text``, ``log_file`` is read-only (``""``:
standard error). Settings are per gateway process. Details:
docs/architecture.md ("Trace and log settings").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from inferbus_common import tracing
from inferbus_common.errors import FailedPrecondition, InvalidArgument
from inferbus_common.logs import setup_logging

_TRACE_KEYS = (
    "trace_level",
    "trace_rate",
    "trace_count",
    "log_frequency",
    "trace_file",
    "trace_mode",
)
_READ_ONLY = {"trace_file": "", "trace_mode": "opentelemetry", "log_frequency": "0"}
_LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")


def _rate_of(ratio: float) -> int:
    return max(1, round(1 / ratio)) if ratio > 0 else 1000


class TraceSettings:
    """The gateway's trace settings, global and per model (module docstring).

    Args:
        available: the process records spans (tracing was enabled at start).
        ratio: the configured sample ratio (``tracing_sample_ratio``).
    """

    def __init__(self, *, available: bool, ratio: float) -> None:
        self.available = available
        self._global: dict[str, str] = {
            "trace_level": "TIMESTAMPS" if available and ratio > 0 else "OFF",
            "trace_rate": str(_rate_of(ratio)),
            "trace_count": "-1",
        }
        self._models: dict[str, dict[str, str]] = {}
        self._counts: dict[str, int] = {}
        """Traces left per scope ('' = global) while a trace_count is set."""
        self._lock = threading.Lock()

    @classmethod
    def from_process(cls) -> TraceSettings:
        """Settings reflecting this process's tracer (`tracing.setup_tracing`)."""
        return cls(available=tracing.enabled(), ratio=tracing.sample_ratio())

    def _effective(self, model: str) -> dict[str, str]:
        return {**self._global, **self._models.get(model, {})}

    def get(self, model: str = "") -> dict[str, list[str]]:
        """Triton's settings document: every key with its value list."""
        current = self._effective(model)
        scope = model if "trace_count" in self._models.get(model, {}) else ""
        if scope in self._counts:
            current["trace_count"] = str(self._counts[scope])
        out = {k: [v] for k, v in current.items()}
        out.update({k: [v] for k, v in _READ_ONLY.items()})
        out["trace_level"] = current["trace_level"].split(",")
        return {k: out[k] for k in _TRACE_KEYS}

    def update(self, model: str, changes: Mapping[str, list[str] | None]) -> dict[str, list[str]]:
        """Apply Triton's setting changes; returns the settings after them.

        Raises:
            InvalidArgument: an unknown key, a bad value, a read-only key changed.
            FailedPrecondition: turning tracing on in a gateway without a tracer.
        """
        parsed: dict[str, str | None] = {}
        for key, values in changes.items():
            if key not in _TRACE_KEYS:
                raise InvalidArgument(
                    f"unknown trace setting '{key}'; settings: {list(_TRACE_KEYS)}"
                )
            if not values:
                parsed[key] = None
                continue
            if key in _READ_ONLY:
                if values != [_READ_ONLY[key]]:
                    raise InvalidArgument(
                        f"trace setting '{key}' is fixed to {_READ_ONLY[key]!r}: inferbus "
                        "exports spans over OTLP (INFERBUS_GATEWAY_TRACING_* settings)"
                    )
                continue
            parsed[key] = self._check(key, values)
        level = parsed.get("trace_level")
        if level not in (None, "OFF") and not self.available:
            raise FailedPrecondition(
                "tracing is off in this gateway: start it with INFERBUS_GATEWAY_TRACING_ENABLED="
                "true (and an exporter) to record traces"
            )
        with self._lock:
            target = self._models.setdefault(model, {}) if model else self._global
            for key, value in parsed.items():
                if value is None:
                    if model:
                        target.pop(key, None)
                    continue
                target[key] = value
                if key == "trace_count":
                    count = int(value)
                    if count < 0:
                        self._counts.pop(model, None)
                    else:
                        self._counts[model] = count
            if model and not target:
                del self._models[model]
        return self.get(model)

    @staticmethod
    def _check(key: str, values: list[str]) -> str:
        if key == "trace_level":
            bad = [v for v in values if v not in _LEVELS]
            if bad:
                raise InvalidArgument(f"trace_level {bad} unknown; levels: {list(_LEVELS)}")
            if "TENSORS" in values:
                raise InvalidArgument(
                    "trace_level TENSORS is not supported: inferbus spans never carry tensor "
                    "data; use TIMESTAMPS"
                )
            if "OFF" in values and len(values) > 1:
                raise InvalidArgument("trace_level OFF excludes every other level")
            return values[0] if "OFF" in values else "TIMESTAMPS"
        if len(values) != 1:
            raise InvalidArgument(f"trace setting '{key}' takes one value, got {values}")
        try:
            number = int(values[0])
        except ValueError:
            raise InvalidArgument(
                f"trace setting '{key}' must be an integer, got {values[0]!r}"
            ) from None
        if key == "trace_rate" and number < 1:
            raise InvalidArgument("trace_rate must be at least 1 (trace 1 request in N)")
        if key == "trace_count" and number < -1:
            raise InvalidArgument("trace_count must be -1 (no limit) or a count of traces")
        return str(number)

    def root_ratio(self, model: str) -> float:
        """The share of `model`'s requests (without a client decision) that start a trace;
        0 when its trace level is OFF or its trace count is used up."""
        current = self._effective(model)
        if current["trace_level"] == "OFF":
            return 0.0
        scope = model if "trace_count" in self._models.get(model, {}) else ""
        if self._counts.get(scope, 1) <= 0:
            return 0.0
        return 1.0 / int(current["trace_rate"])

    def off(self, model: str) -> bool:
        """The gateway records no span for `model` (its level is OFF)."""
        return self._effective(model)["trace_level"] == "OFF"

    def traced(self, model: str) -> None:
        """Count one trace taken for `model` against its trace_count."""
        scope = model if "trace_count" in self._models.get(model, {}) else ""
        with self._lock:
            left = self._counts.get(scope)
            if left is not None and left > 0:
                self._counts[scope] = left - 1


_LEVEL_BY_FLAGS = {
    (True, True, True): "INFO",
    (False, True, True): "WARNING",
    (False, False, True): "ERROR",
    (False, False, False): "CRITICAL",
}


class LogSettings:
    """The gateway's log level and format as Triton's log settings (module docstring).

    Args:
        service: the service name in log lines.
        level: the level at start (``log_level``).
        fmt: the format at start (``log_format``).
    """

    def __init__(self, service: str, level: str, fmt: str) -> None:
        self._service = service
        self._level = level
        self._format = fmt
        self._lock = threading.Lock()

    def get(self) -> dict[str, bool | int | str]:
        """Triton's log settings document."""
        level = self._level
        return {
            "log_file": "",
            "log_info": level in ("DEBUG", "INFO"),
            "log_warning": level in ("DEBUG", "INFO", "WARNING"),
            "log_error": level != "CRITICAL",
            "log_verbose_level": 1 if level == "DEBUG" else 0,
            "log_format": self._format,
        }

    def update(self, changes: Mapping[str, object]) -> dict[str, bool | int | str]:
        """Apply Triton's log setting changes; returns the settings after them.

        Raises:
            InvalidArgument: an unknown key, a mistyped value, a combination that
                is no threshold, a log file, or an unknown format.
        """
        current = self.get()
        for key, value in changes.items():
            if key not in current:
                raise InvalidArgument(f"unknown log setting '{key}'; settings: {sorted(current)}")
            expected: type = type(current[key])
            if type(value) is not expected:
                raise InvalidArgument(
                    f"log setting '{key}' must be a {expected.__name__}, got {value!r}"
                )
            assert isinstance(value, bool | int | str)  # checked just above; narrows for mypy
            if key == "log_verbose_level" and isinstance(value, int) and value < 0:
                raise InvalidArgument("log_verbose_level must be 0 or more")
            current[key] = value
        if current["log_file"]:
            raise InvalidArgument(
                "log_file cannot be set: inferbus services log to standard error "
                "(collect it with your supervisor)"
            )
        if current["log_format"] not in ("json", "text"):
            raise InvalidArgument(
                f"log_format {current['log_format']!r} is not supported; formats: json, text"
            )
        flags = (
            bool(current["log_info"]),
            bool(current["log_warning"]),
            bool(current["log_error"]),
        )
        if current["log_verbose_level"]:
            if flags != (True, True, True):
                raise InvalidArgument(
                    "log_verbose_level > 0 needs log_info, log_warning and log_error"
                )
            level = "DEBUG"
        elif flags in _LEVEL_BY_FLAGS:
            level = _LEVEL_BY_FLAGS[flags]
        else:
            raise InvalidArgument(
                "inferbus logs by threshold: log_info needs log_warning, and log_warning "
                "needs log_error"
            )
        with self._lock:
            if (level, current["log_format"]) != (self._level, self._format):
                self._level, self._format = level, str(current["log_format"])
                setup_logging(self._service, self._level, self._format)
                logging.getLogger(__name__).warning(
                    "log settings changed: level %s, format %s", self._level, self._format
                )
        return self.get()
