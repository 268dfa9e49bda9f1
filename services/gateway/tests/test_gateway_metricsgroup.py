"""/metrics/group: the members' expositions merged, labelled, one HELP/TYPE per family;
a member that does not answer is counted, not waited for; a taken port is refused."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from inferbus_common import ops
from inferbus_gateway import metricsgroup

A = """# HELP inferbus_gateway_requests_total Requests.
# TYPE inferbus_gateway_requests_total counter
inferbus_gateway_requests_total{status="OK"} 3.0
# HELP up_seconds A gauge.
# TYPE up_seconds gauge
up_seconds 1.5
"""
B = """# HELP inferbus_gateway_requests_total Requests.
# TYPE inferbus_gateway_requests_total counter
inferbus_gateway_requests_total{status="OK"} 4.0
"""


async def test_members_are_merged_with_a_process_label(tmp_path: Path, monkeypatch) -> None:
    for name, port in (("gateway", 1), ("gateway-2", 2), ("gateway-3", 3)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"pid": 1, "metrics": port}))
    (tmp_path / "gateway-4.json").write_text("{")  # being written: skipped
    texts = {1: A, 2: B}

    async def fetch(host: str, port: int) -> str:
        if port not in texts:
            raise OSError("refused")
        return texts[port]

    monkeypatch.setattr(metricsgroup, "_fetch", fetch)
    body = (await metricsgroup.group_exposition(str(tmp_path / "gateway*.json"))).decode()
    types = [line for line in body.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types)) == 3
    families = {f.name: f for f in text_string_to_metric_families(body)}
    requests = {
        s.labels["gateway_process"]: s.value for s in families["inferbus_gateway_requests"].samples
    }
    assert requests == {"gateway": 3.0, "gateway-2": 4.0}
    assert families["up_seconds"].samples[0].labels == {"gateway_process": "gateway"}
    assert families["inferbus_gateway_group_scrape_errors"].samples[0].value == 1.0


def test_a_taken_port_is_refused_even_to_a_reuse_port_group() -> None:
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        # SO_REUSEPORT alone would share the port silently ...
        ops.bind_socket("127.0.0.1", port, reuse_port=True).close()
        # ... so the first process of a group checks without it first.
        with pytest.raises(ops.PortTakenError, match="already in use"):
            ops.check_port_free("127.0.0.1", port, "gateway gRPC")
    finally:
        holder.close()
    ops.check_port_free("127.0.0.1", port, "gateway gRPC")
    ops.check_port_free("127.0.0.1", 0, "gateway gRPC")
