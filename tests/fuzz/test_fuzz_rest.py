"""Hostile REST infer requests (issue #11, item 3): hostile JSON fields,
invalid and deeply nested JSON, binary-extension bodies whose header length
lies, non-UTF-8 bytes, odd model names, CR/LF in request ids, a 100 MB body.
Each is answered 2xx or 4xx (never 5xx), no header carries injected lines,
and the stack keeps serving.

``INFERBUS_FUZZ_EXAMPLES=10000`` runs the long variant.
"""

from __future__ import annotations

import collections

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from inferbus_testing.chaos import rss_bytes
from inferbus_testing.hostile import examples, record, rest_requests

pytestmark = [pytest.mark.fuzz, pytest.mark.slow]

INJECTED = ("set-cookie", "evil")


@pytest.fixture(scope="module")
def http(fuzz_stack):
    with httpx.Client(base_url=f"http://{fuzz_stack.http_url}", timeout=15.0) as client:
        yield client


def test_hostile_rest_requests_get_client_errors(fuzz_stack, http) -> None:
    counts: collections.Counter[str] = collections.Counter()
    bad: list[str] = []

    @settings(
        max_examples=examples(),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(request=rest_requests())
    def check(request: tuple[str, dict[str, str], bytes]) -> None:
        path, headers, body = request
        resp = http.post(path, headers=headers, content=body)
        counts[str(resp.status_code)] += 1
        if resp.status_code >= 500:
            bad.append(f"{resp.status_code} {resp.text[:200]} <- {path} {body[:120]!r}")
        assert resp.status_code < 500, f"{resp.status_code} {resp.text[:300]} {path} {body[:300]!r}"
        for name, value in resp.headers.items():
            assert "\r" not in value and "\n" not in value
            assert not name.lower().startswith(INJECTED), (name, value)
        if resp.status_code >= 400:
            # Errors explain themselves in JSON, as the KServe V2 REST protocol says,
            # also for paths that match no route (404) and wrong methods (405).
            assert resp.headers.get("content-type", "").startswith("application/json"), resp.text
            assert "error" in resp.json(), resp.text[:300]

    try:
        check()
    finally:
        record("rest", counts, failures=bad[:5])
        print(dict(counts))
    fuzz_stack.assert_serving()


def test_100_mb_body_is_refused(fuzz_stack, http) -> None:
    body = b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": ['
    body += b"0," * ((100 << 20) // 2) + b"0]}]}"
    resp = http.post("/v2/models/fraud/infer", content=body)
    assert resp.status_code == 413, resp.text[:300]
    assert "exceeds" in resp.json()["error"]
    fuzz_stack.assert_serving()


def test_100_mb_chunked_body_without_length_is_refused(fuzz_stack, http) -> None:
    chunk = b"0," * (1 << 19)

    def chunks():
        yield b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": ['
        for _ in range((100 << 20) // len(chunk)):
            yield chunk
        yield b"0]}]}"

    gateway = fuzz_stack.gateway.pid
    assert gateway is not None
    before = rss_bytes(gateway)
    resp = http.post("/v2/models/fraud/infer", content=chunks())
    grown = rss_bytes(gateway) - before
    assert resp.status_code == 413, resp.text[:300]
    assert "exceeds" in resp.json()["error"]
    # Refused while streaming: the gateway never held the 100 MB (limit: 64 MiB).
    assert grown < 80 << 20, f"gateway RSS grew by {grown >> 20} MiB"
    fuzz_stack.assert_serving()


@pytest.mark.parametrize("timeout_ms", ["-1", "0", "nan", "inf", "1e309", "abc"])
def test_bad_timeout_header_is_a_client_error(fuzz_stack, http, timeout_ms: str) -> None:
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.0] * 64}]}
    resp = http.post(
        "/v2/models/fraud/infer", json=body, headers={"inferbus-timeout-ms": timeout_ms}
    )
    assert resp.status_code == 400, resp.text
    assert "inferbus-timeout-ms" in resp.json()["error"]
