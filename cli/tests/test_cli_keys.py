"""`inferbus keys` against a real redis-server."""

from __future__ import annotations

import json

from inferbus_cli.__main__ import main


def test_create_list_allow_revoke(redis_server, capsys) -> None:
    url = redis_server.url
    assert main(["keys", "create", "acme", "--models", "fraud", "--redis", url]) == 0
    out = capsys.readouterr().out.splitlines()
    secret = out[1].strip()
    key_id = out[0].split()[2]
    assert secret.startswith("ib_")
    assert main(["keys", "allow", "acme", "scorer", "--redis", url]) == 0
    assert "fraud, scorer" in capsys.readouterr().out
    assert main(["keys", "list", "--redis", url, "--json"]) == 0
    listed = capsys.readouterr().out
    records = json.loads(listed)
    assert [(r["tenant"], r["key_id"], r["revoked"]) for r in records] == [("acme", key_id, None)]
    assert secret not in listed
    assert main(["keys", "revoke", key_id, "--redis", url]) == 0
    assert main(["keys", "revoke", key_id, "--redis", url]) == 1
    capsys.readouterr()
    assert main(["keys", "--redis", url]) == 0
    assert "revoked" in capsys.readouterr().out
