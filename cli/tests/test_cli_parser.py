"""Argument parsing of every subcommand and the option → UpOptions mapping."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferbus_cli.commands.up import options_from_args
from inferbus_cli.parser import build_parser
from inferbus_cli.plan import Ports, service_spec
from inferbus_common import gpus
from inferbus_common.gpus import GpuInfo


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_up_defaults_follow_the_architecture_ports(tmp_path: Path) -> None:
    args = parse("up", "--home", str(tmp_path))
    assert args.handler == "up:run"
    options = options_from_args(args)
    assert options.ports == Ports()
    assert (options.ports.nats, options.ports.redis) == (4222, 6379)
    assert (options.ports.gateway_http, options.ports.gateway_grpc) == (8000, 8001)
    assert options.home == tmp_path
    assert not options.detached
    assert options.workers == 1
    assert options.store == "local"
    assert options.redis


def test_up_free_ports_zeroes_only_ports_not_given(tmp_path: Path) -> None:
    args = parse("up", "-d", "--home", str(tmp_path), "--free-ports", "--grpc-port", "9001")
    options = options_from_args(args)
    assert options.detached
    assert options.ports.gateway_grpc == 9001
    assert options.ports.nats == 0
    assert options.ports.redis == 0
    assert options.ports.worker_metrics == 0


def test_up_explicit_ports_s3_and_workers(tmp_path: Path) -> None:
    args = parse(
        "up",
        "--home",
        str(tmp_path),
        "--workers",
        "3",
        "--nats-port",
        "0",
        "--http-port",
        "18000",
        "--store",
        "s3",
        "--s3-endpoint",
        "127.0.0.1:9100",
        "--s3-access-key",
        "ak",
        "--s3-secret-key",
        "sk",
        "--s3-bucket",
        "b",
        "--no-redis",
    )
    options = options_from_args(args)
    assert options.workers == 3
    assert options.ports.nats == 0
    assert options.ports.gateway_http == 18000
    assert options.ports.nats_monitor == 8222
    assert options.store == "s3"
    assert (options.s3.endpoint, options.s3.access_key, options.s3.bucket) == (
        "127.0.0.1:9100",
        "ak",
        "b",
    )
    assert not options.redis


@pytest.mark.parametrize(
    "argv",
    [
        ["up", "--http-port", "70000"],
        ["up", "--workers", "0"],
        ["up", "--store", "gcs"],
        ["models", "push", "dir", "--name", "m"],
        ["infer", "m", "--random", "0"],
        ["models"],
        [],
    ],
)
def test_bad_arguments_exit_with_usage(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_models_subcommands() -> None:
    push = parse(
        "models",
        "push",
        "d",
        "--name",
        "fraud",
        "--version",
        "1",
        "--alias",
        "stable",
        "--alias",
        "canary",
        "--registry",
        "127.0.0.1:9",
    )
    assert push.handler == "models:run_push"
    assert push.alias == ["stable", "canary"]
    assert push.registry == "127.0.0.1:9"
    assert parse("models", "list").handler == "models:run_list"
    get = parse("models", "get", "fraud", "--version", "stable")
    assert (get.handler, get.name, get.version) == ("models:run_get", "fraud", "stable")
    alias = parse("models", "alias", "fraud", "canary", "2")
    assert (alias.handler, alias.name, alias.alias, alias.version) == (
        "models:run_alias",
        "fraud",
        "canary",
        "2",
    )
    assert parse("models", "wait", "fraud").handler == "models:run_wait"


def test_infer_down_status() -> None:
    args = parse(
        "infer",
        "fraud",
        "--input",
        "input=[[1]]",
        "--input",
        "b=@x.npy",
        "--random",
        "3",
        "--url",
        "127.0.0.1:1",
        "--timeout",
        "2.5",
    )
    assert args.handler == "infer:run"
    assert args.input == ["input=[[1]]", "b=@x.npy"]
    assert (args.random, args.url, args.timeout) == (3, "127.0.0.1:1", 2.5)
    assert parse("down").handler == "down:run"
    st = parse("status", "--json")
    assert st.handler == "status:run" and st.json


def test_every_handler_resolves() -> None:
    """Each subcommand names a function that exists (imported lazily by main)."""
    import importlib

    argvs = [
        ["up"],
        ["down"],
        ["status"],
        ["infer", "m"],
        ["models", "list"],
        ["models", "get", "m"],
        ["models", "alias", "m", "a", "1"],
        ["models", "wait", "m"],
        ["models", "push", "p", "--name", "m", "--version", "1"],
    ]
    for argv in argvs:
        module_name, _, function = parse(*argv).handler.partition(":")
        module = importlib.import_module(f"inferbus_cli.commands.{module_name}")
        assert callable(getattr(module, function)), argv


TWO_GPUS = [
    GpuInfo(0, "GPU-11111111-aaaa", "NVIDIA H200", 140 << 30, 140 << 30),
    GpuInfo(1, "GPU-22222222-bbbb", "NVIDIA H200", 140 << 30, 140 << 30),
]


def test_up_gpus_starts_one_worker_per_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpus, "host_gpus", lambda: TWO_GPUS)
    options = options_from_args(parse("up", "--home", str(tmp_path), "--gpus", "all"))
    assert options.workers == 2
    assert options.gpus == ("GPU-11111111-aaaa", "GPU-22222222-bbbb")
    endpoints = {"nats": "nats://127.0.0.1:4222", "registry": "127.0.0.1:8070"}
    for i, uuid in enumerate(options.gpus):
        env = service_spec(options, f"worker-{i + 1}", endpoints).env
        assert env["CUDA_VISIBLE_DEVICES"] == uuid
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "CUDA_VISIBLE_DEVICES" not in service_spec(options, "gateway", endpoints).env
    one = options_from_args(parse("up", "--home", str(tmp_path), "--gpus", "1"))
    assert (one.workers, one.gpus) == (1, ("GPU-22222222-bbbb",))
    # Without --gpus nothing is decided for the workers.
    plain = options_from_args(parse("up", "--home", str(tmp_path), "--workers", "2"))
    assert plain.gpus == ()
    assert "CUDA_VISIBLE_DEVICES" not in service_spec(plain, "worker-1", endpoints).env


@pytest.mark.parametrize(
    ("host", "argv", "message"),
    [
        ([], ["--gpus", "all"], "no NVIDIA GPU found on this machine"),
        (TWO_GPUS, ["--gpus", "0,3"], "no single GPU '3' here"),
        (TWO_GPUS, ["--gpus", "0", "--workers", "2"], "leave --workers out"),
    ],
)
def test_up_gpus_errors_are_clear(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    host: list[GpuInfo],
    argv: list[str],
    message: str,
) -> None:
    from inferbus_cli.commands import up

    monkeypatch.setattr(gpus, "host_gpus", lambda: host)
    assert up.run(parse("up", "--home", str(tmp_path), *argv)) == 1
    assert message in capsys.readouterr().err
