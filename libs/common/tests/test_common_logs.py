"""JSON log lines: fixed fields, context binding, secrets masked."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from inferbus_common.logs import REDACTED, JsonFormatter, log_context, redact

JWT = (
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9."
    "eyJ0ZW5hbnQiOiJhY21lIiwiZXhwIjo0MTAyNDQ0ODAwfQ."
    "c2lnbmF0dXJlc2lnbmF0dXJlc2lnbmF0dXJl"
)
API_KEY = "ib_" + "Zx9" * 14


def _line(record: logging.LogRecord) -> dict[str, object]:
    return json.loads(JsonFormatter("gateway").format(record))


def _record(msg: str, *args: object, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord(
        "inferbus_gateway.access", logging.INFO, __file__, 1, msg, args, None
    )
    record.__dict__.update(extra)
    return record


def test_line_has_the_fixed_fields_and_only_known_extras() -> None:
    line = _line(
        _record(
            "infer",
            request_id="r1",
            trace_id="0af7651916cd43dd8448eb211c80319c",
            model="fraud",
            version="1",
            tenant="acme",
            latency_ms=1.5,
            status="OK",
            protocol="grpc",
            authorization="Bearer secret",  # not a context field: never written
        )
    )
    assert line["level"] == "INFO" and line["service"] == "gateway" and line["msg"] == "infer"
    assert str(line["ts"]).endswith("Z")
    for key, value in {
        "request_id": "r1",
        "trace_id": "0af7651916cd43dd8448eb211c80319c",
        "model": "fraud",
        "version": "1",
        "tenant": "acme",
        "latency_ms": 1.5,
        "status": "OK",
        "protocol": "grpc",
    }.items():
        assert line[key] == value
    assert "authorization" not in line
    assert "secret" not in json.dumps(line)


@pytest.mark.parametrize(
    "secret",
    [f"Bearer {JWT}", f"bearer {API_KEY}", JWT, API_KEY],
    ids=["b-jwt", "b-key", "jwt", "key"],
)
def test_secrets_in_messages_and_tracebacks_are_masked(secret: str) -> None:
    assert secret not in redact(f"header was {secret}!")
    assert REDACTED in redact(f"header was {secret}!")
    line = _line(_record("auth failed for %s", secret))
    assert secret not in json.dumps(line)
    try:
        raise ValueError(f"bad token {secret}")
    except ValueError:
        import sys

        record = _record("boom")
        record.exc_info = sys.exc_info()
    line = _line(record)
    assert "bad token" in str(line["exc"]) and secret not in str(line["exc"])


def test_redact_leaves_ordinary_text_alone() -> None:
    text = "model fraud version 1: key id k-123 revoked; the monkey obeyed"
    assert redact(text) == text


async def test_log_context_binds_fields_per_task() -> None:
    seen: dict[str, dict[str, object]] = {}

    async def handle(rid: str) -> None:
        with log_context(request_id=rid, model="fraud"):
            await asyncio.sleep(0)
            seen[rid] = _line(_record("step"))

    await asyncio.gather(handle("a"), handle("b"))
    assert seen["a"]["request_id"] == "a" and seen["b"]["request_id"] == "b"
    assert seen["a"]["model"] == "fraud"
    # extra= wins over the binding; outside the block nothing is bound.
    with log_context(request_id="outer"):
        assert _line(_record("x", request_id="inner"))["request_id"] == "inner"
    assert "request_id" not in _line(_record("x"))


async def test_buffered_lines_write_what_json_formatter_writes(tmp_path, monkeypatch) -> None:
    import io

    from inferbus_common import logs

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    stream = io.StringIO()
    try:
        logs.setup_logging("gw-test", "INFO", "json")
        root.handlers[0].stream = stream
        lines = logs.BufferedLines(logging.getLogger("test.access"))
        fields = {"model": "m", "status": "OK", "latency_ms": 1.5, "nope": "dropped"}
        lines.info("infer", fields)
        assert stream.getvalue() == ""  # waits for the batch
        lines.flush()
        fast = json.loads(stream.getvalue())
        stream.truncate(0)
        stream.seek(0)
        logging.getLogger("test.access").info("infer", extra=fields)
        slow = json.loads(stream.getvalue())
        fast.pop("ts"), slow.pop("ts")
        assert fast == slow
        assert "nope" not in fast
        # Another handler on the way (pytest's capture, a file handler): plain logging.
        other = logging.StreamHandler(io.StringIO())
        root.addHandler(other)
        stream.truncate(0)
        stream.seek(0)
        lines.info("infer", {"model": "m"})
        assert json.loads(stream.getvalue())["model"] == "m"
        assert other.stream.getvalue()
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
        monkeypatch.setattr(logs, "_json_root", None)
