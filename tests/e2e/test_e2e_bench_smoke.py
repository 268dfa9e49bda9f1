"""Smoke test of the benchmark load generator against the real stack.

Benchmarks themselves stay out of CI (``bench/run_all.py`` takes minutes);
this only proves ``bench/loadgen.py`` runs end to end against the gateway and
writes a sane JSON line, so the yardstick does not rot unnoticed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("protocol", "mode"),
    [("grpc", ["--concurrency", "4"]), ("rest", ["--rate", "50", "--arrival", "fixed"])],
)
def test_loadgen_writes_a_sane_result(stack, tmp_path: Path, protocol: str, mode: list[str]):
    out = tmp_path / "results.jsonl"
    url = stack.grpc_url if protocol == "grpc" else stack.http_url
    argv = [
        sys.executable,
        str(REPO / "bench" / "loadgen.py"),
        "--protocol",
        protocol,
        "--url",
        url,
        "--model",
        "fraud",
        *mode,
        "--duration",
        "1.5",
        "--warmup",
        "0.3",
        "--out",
        str(out),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]

    (line,) = out.read_text().splitlines()
    record = json.loads(line)
    assert record == json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["target"] == "inferbus"
    assert record["model"] == "fraud"
    assert record["protocol"] == protocol
    assert record["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}]
    assert record["ok"] > 0
    assert record["errors"] == {}
    assert record["requests"] == record["ok"]
    assert record["throughput_rps"] > 0
    assert record["throughput_rows_s"] == record["throughput_rps"]
    lat = record["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert "loadgen.py" in record["command"]
    assert record["machine"]["cpus"] >= 1
    if protocol == "grpc":
        # The gateway reports its stage timings in the response parameters.
        assert record["concurrency"] == 4
        assert {"queue", "compute", "gateway", "total"} <= set(record["stages"])
        assert record["stages"]["total"]["p50_us"] > 0
    else:
        assert record["mode"] == "open"
        assert record["rate"] == 50
