"""Triton's trace and log settings mapped onto the gateway's sampler and log level."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from inferbus_common.errors import FailedPrecondition, InvalidArgument
from inferbus_gateway.triton.tracelog import LogSettings, TraceSettings


def test_trace_settings_show_the_configured_ratio() -> None:
    doc = TraceSettings(available=True, ratio=0.01).get()
    assert doc == {
        "trace_level": ["TIMESTAMPS"],
        "trace_rate": ["100"],
        "trace_count": ["-1"],
        "log_frequency": ["0"],
        "trace_file": [""],
        "trace_mode": ["opentelemetry"],
    }
    assert TraceSettings(available=False, ratio=0.01).get()["trace_level"] == ["OFF"]


def test_rate_level_and_model_overrides_steer_the_root_ratio() -> None:
    trace = TraceSettings(available=True, ratio=0.01)
    assert trace.root_ratio("m") == pytest.approx(0.01)
    trace.update("", {"trace_rate": ["4"]})
    assert trace.root_ratio("m") == pytest.approx(0.25)
    trace.update("m", {"trace_rate": ["1"]})
    assert trace.root_ratio("m") == 1.0 and trace.root_ratio("other") == pytest.approx(0.25)
    assert trace.get("m")["trace_rate"] == ["1"]
    trace.update("m", {"trace_level": ["OFF"]})
    assert trace.off("m") and trace.root_ratio("m") == 0.0 and not trace.off("other")
    # An empty value list resets a model's key to the global value.
    trace.update("m", {"trace_level": [], "trace_rate": []})
    assert not trace.off("m") and trace.root_ratio("m") == pytest.approx(0.25)


def test_trace_count_stops_tracing_when_used_up() -> None:
    trace = TraceSettings(available=True, ratio=1.0)
    trace.update("m", {"trace_count": ["2"]})
    trace.traced("m")
    assert trace.get("m")["trace_count"] == ["1"]
    trace.traced("m")
    assert trace.root_ratio("m") == 0.0 and trace.root_ratio("x") == 1.0
    trace.update("m", {"trace_count": ["-1"]})
    assert trace.root_ratio("m") == 1.0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"trace_level": ["TENSORS"]}, "TENSORS is not supported"),
        ({"trace_level": ["LOUD"]}, "unknown"),
        ({"trace_level": ["OFF", "TIMESTAMPS"]}, "excludes"),
        ({"trace_rate": ["0"]}, "at least 1"),
        ({"trace_rate": ["x"]}, "integer"),
        ({"trace_count": ["-2"]}, "-1"),
        ({"trace_file": ["/tmp/t.json"]}, "fixed"),
        ({"trace_mode": ["triton"]}, "fixed"),
        ({"bogus": ["1"]}, "unknown trace setting"),
    ],
)
def test_bad_trace_settings_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        TraceSettings(available=True, ratio=0.1).update("", changes)


def test_turning_tracing_on_needs_a_tracer() -> None:
    trace = TraceSettings(available=False, ratio=0.1)
    with pytest.raises(FailedPrecondition, match="TRACING_ENABLED"):
        trace.update("", {"trace_level": ["TIMESTAMPS"]})
    assert trace.update("", {"trace_level": ["OFF"]})["trace_level"] == ["OFF"]


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def test_log_settings_set_the_level_by_threshold(restore_logging: None) -> None:
    logs = LogSettings("gateway", "INFO", "json")
    assert logs.get() == {
        "log_file": "",
        "log_info": True,
        "log_warning": True,
        "log_error": True,
        "log_verbose_level": 0,
        "log_format": "json",
    }
    assert logs.update({"log_verbose_level": 1})["log_verbose_level"] == 1
    assert logging.getLogger().level == logging.DEBUG
    logs.update({"log_verbose_level": 0, "log_info": False})
    assert logging.getLogger().level == logging.WARNING
    logs.update({"log_warning": False, "log_format": "text"})
    assert logging.getLogger().level == logging.ERROR
    assert logs.get()["log_format"] == "text"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"log_info": True, "log_warning": False}, "threshold"),
        ({"log_verbose_level": 2, "log_info": False}, "needs log_info"),
        ({"log_file": "/tmp/x.log"}, "cannot be set"),
        ({"log_format": "ISO8601"}, "not supported"),
        ({"log_info": 1}, "must be a bool"),
        ({"log_level": "INFO"}, "unknown log setting"),
    ],
)
def test_bad_log_settings_are_refused(changes: dict, message: str, restore_logging: None) -> None:
    with pytest.raises(InvalidArgument, match=message):
        LogSettings("gateway", "INFO", "json").update(changes)
