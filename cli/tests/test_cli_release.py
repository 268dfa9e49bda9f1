"""`inferbus route`, `inferbus rollout` and `inferbus pools` against a real registry
(in-process, real nats-server, local store); the CLI's blocking gRPC runs in a thread
as a user's shell would call it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from inferbus_cli.__main__ import main
from inferbus_cli.parser import build_parser
from inferbus_registry.app import RegistryApp


def test_parser_knows_the_release_commands() -> None:
    p = build_parser()
    a = p.parse_args(["rollout", "start", "m", "2", "--steps", "5,25,100", "--interval", "1s"])
    assert (a.handler, a.steps, a.interval, a.on_fail) == (
        "rollout:run_start",
        [5.0, 25.0, 100.0],
        1.0,
        "rollback",
    )
    assert p.parse_args(["rollout", "abort", "m"]).action == "abort"
    assert p.parse_args(["pools"]).handler == "pools:run_list"
    assert p.parse_args(["pools", "set", "gpu", "--max-gpus", "4"]).max_gpus == 4
    with pytest.raises(SystemExit):
        p.parse_args(["rollout", "start", "m", "2", "--steps", "5,x"])


async def _cli(*argv: str) -> int:
    return await asyncio.to_thread(main, list(argv))


async def test_route_rollout_and_pools_commands(
    registry: RegistryApp, fraud_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reg = ["--registry", f"127.0.0.1:{registry.grpc_port}"]
    model = fraud_model
    for version in ("1", "2", "3"):
        assert (
            await _cli("models", "push", str(model), "--name", "fraud", "--version", version, *reg)
            == 0
        )
    capsys.readouterr()

    # route set / show, with who and why recorded.
    code = await _cli(
        "route", "set", "fraud", "--canary", "2", "--weight", "10", "--sticky", "tenant",
        "--by", "alice", "-m", "try 2", *reg,
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "canary:   2 @ 10%" in out and "by alice: try 2" in out
    assert await _cli("route", "show", "fraud", "--json", *reg) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["route"]["canary_weight"] == 10 and shown["route"]["updated_by"] == "alice"
    assert shown["history"] and shown["history"][0]["canary"] == ""
    kv_revision = shown["kv_revision"]

    # A stale --expect-revision is refused with a clear message.
    assert await _cli("route", "set", "fraud", "--weight", "20", *reg) == 0
    capsys.readouterr()
    code = await _cli(
        "route", "set", "fraud", "--weight", "30", "--expect-revision", str(kv_revision), *reg
    )
    err = capsys.readouterr().err
    assert code == 1 and "FAILED_PRECONDITION" in err and "re-read" in err
    assert await _cli("route", "show", "fraud", *reg) == 0
    text = capsys.readouterr().out
    assert "history (newest first" in text and "canary:   2 @ 20%" in text

    # Invalid input: a weight over 100.
    assert await _cli("route", "set", "fraud", "--weight", "150", *reg) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err

    # Rollout: refused while another canary is set, then started, status, abort.
    assert await _cli("rollout", "start", "fraud", "3", "--interval", "1m", *reg) == 1
    assert "already has canary '2'" in capsys.readouterr().err
    assert await _cli("route", "set", "fraud", "--canary", "none", *reg) == 0
    capsys.readouterr()
    code = await _cli(
        "rollout", "start", "fraud", "2", "--steps", "10,100", "--interval", "1m", "--by", "bob",
        *reg,
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "state:    running" in out and "step:     1/2 at 10%" in out
    assert await _cli("rollout", "status", "fraud", "--json", *reg) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["started_by"] == "bob" and doc["state"] == "running"
    assert await _cli("rollout", "pause", "fraud", *reg) == 0
    assert "state:    paused" in capsys.readouterr().out
    assert await _cli("rollout", "start", "fraud", "2", *reg) == 1
    assert "abort it with `inferbus rollout abort fraud`" in capsys.readouterr().err
    assert await _cli("rollout", "abort", "fraud", "--reason", "not today", *reg) == 0
    assert "state:    aborted (not today)" in capsys.readouterr().out
    assert await _cli("route", "show", "fraud", "--json", *reg) == 0
    assert json.loads(capsys.readouterr().out)["route"]["canary"] == ""

    # Pools: set a quota and freeze, the ledger shows it and placed versions.
    assert (
        await _cli("pools", "set", "default", "--max-workers", "2", "--state", "frozen", *reg) == 0
    )
    assert "state frozen, max_workers 2" in capsys.readouterr().out
    assert await _cli("pools", "--json", *reg) == 0
    pools = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    assert pools["default"]["state"] == "frozen" and pools["default"]["max_workers"] == 2
    assert "fraud/1" in pools["default"]["placed"]
    assert await _cli("rollout", "start", "fraud", "2", *reg) == 1
    assert "pool 'default' is frozen" in capsys.readouterr().err
    assert await _cli("pools", *reg) == 0
    assert "default  frozen" in capsys.readouterr().out
