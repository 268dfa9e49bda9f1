"""`inferbus limits` against a real redis-server."""

from __future__ import annotations

import json

from inferbus_cli.__main__ import main


def test_set_list_delete(redis_server, capsys) -> None:
    url = redis_server.url
    assert main(["limits", "set", "model", "fraud", "100", "--redis", url]) == 0
    assert main(["limits", "set", "tenant-model", "acme:*", "5", "--redis", url]) == 0
    capsys.readouterr()
    assert main(["limits", "list", "--redis", url, "--json"]) == 0
    limits = json.loads(capsys.readouterr().out)
    assert {(x["scope"], x["name"], x["qps"], x["reason"]) for x in limits} == {
        ("model", "fraud", 100.0, "model-qps"),
        ("tenant-model", "acme:*", 5.0, "tenant-quota"),
    }
    assert main(["limits", "delete", "model", "fraud", "--redis", url]) == 0
    assert main(["limits", "delete", "model", "fraud", "--redis", url]) == 1
    capsys.readouterr()
    assert main(["limits", "--redis", url]) == 0
    out = capsys.readouterr().out
    assert "acme:*" in out and "fraud" not in out
