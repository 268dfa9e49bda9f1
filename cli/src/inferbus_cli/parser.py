"""The `inferbus` argument parser: every subcommand, option and default."""

from __future__ import annotations

import argparse

from inferbus_cli.plan import Ports


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a port (0-65535; 0 = any free port)")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be positive")
    return value


def _home_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--home",
        help="state directory of the local stack (default: $INFERBUS_HOME or ./.inferbus)",
    )


def _add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "up",
        help="start NATS, Redis and every service on 127.0.0.1",
        description="Start nats-server (JetStream), redis-server (if installed), the registry, "
        "router, batcher, N workers and the gateway as local processes.",
    )
    p.add_argument(
        "-d", "--detach", action="store_true", help="return once everything is up (no supervisor)"
    )
    _home_option(p)
    p.add_argument("--workers", type=_positive_int, default=1, help="worker processes (1)")
    p.add_argument("--pool", default="default", help="worker pool of the workers (default)")
    p.add_argument("--store", choices=["local", "s3"], default="local", help="artifact store")
    p.add_argument("--s3-endpoint", default="127.0.0.1:9000", help="S3 endpoint HOST:PORT")
    p.add_argument("--s3-access-key", default="", help="S3 access key")
    p.add_argument("--s3-secret-key", default="", help="S3 secret key")
    p.add_argument("--s3-bucket", default="inferbus", help="S3 bucket")
    p.add_argument("--s3-secure", action="store_true", help="use HTTPS for S3")
    p.add_argument("--no-redis", action="store_true", help="do not start redis-server")
    d = Ports()
    ports = p.add_argument_group("ports (0 = any free port)")
    for flag, default, what in [
        ("--http-port", d.gateway_http, "gateway KServe V2 HTTP"),
        ("--grpc-port", d.gateway_grpc, "gateway KServe V2 gRPC"),
        ("--metrics-port", d.gateway_metrics, "gateway metrics"),
        ("--nats-port", d.nats, "NATS clients"),
        ("--nats-monitor-port", d.nats_monitor, "NATS monitoring"),
        ("--redis-port", d.redis, "Redis (0 = a unix socket under <home>/run)"),
        ("--registry-port", d.registry_grpc, "registry gRPC"),
        ("--registry-metrics-port", d.registry_metrics, "registry metrics"),
        ("--router-metrics-port", d.router_metrics, "router metrics"),
        ("--batcher-metrics-port", d.batcher_metrics, "batcher metrics"),
        ("--worker-metrics-port", d.worker_metrics, "first worker's metrics (+1 per worker)"),
    ]:
        # None = not given: the default, or 0 under --free-ports.
        ports.add_argument(flag, type=_port, default=None, help=f"{what} ({default})")
    ports.add_argument(
        "--free-ports",
        action="store_true",
        help="let every process whose port is not given pick a free one",
    )
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=60.0,
        help="seconds each process may take to come up (60)",
    )
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], default="INFO")
    p.set_defaults(handler="up:run")


def _add_down(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("down", help="stop the stack started by `inferbus up`")
    _home_option(p)
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=15.0,
        help="seconds each process gets after SIGTERM before SIGKILL (15)",
    )
    p.set_defaults(handler="down:run")


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="processes, ports and model readiness")
    _home_option(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler="status:run")


def _registry_options(p: argparse.ArgumentParser, timeout: float = 10.0) -> None:
    _home_option(p)
    p.add_argument(
        "--registry", help="registry gRPC HOST:PORT (default: from state.json, else :8070)"
    )
    p.add_argument("--timeout", type=_positive_float, default=timeout, help="RPC timeout (s)")


def _add_models(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="push, list and inspect models in the registry")
    msub = p.add_subparsers(dest="models_command", metavar="COMMAND", required=True)

    push = msub.add_parser("push", help="upload a model version")
    push.add_argument("path", help="version directory (config.json + artifact) or a .onnx file")
    push.add_argument("--name", required=True, help="model name")
    push.add_argument("--version", required=True, help="version, e.g. 1 or 1.2.0")
    push.add_argument(
        "--alias", action="append", default=[], help="alias to point at it (repeatable)"
    )
    push.add_argument("--config", help="config.json (required when PATH is a single file)")
    push.add_argument("--json", action="store_true", help="print the version as JSON")
    _registry_options(push, timeout=300.0)
    push.set_defaults(handler="models:run_push")

    lst = msub.add_parser("list", help="every model with versions and aliases")
    lst.add_argument("--json", action="store_true", help="print JSON")
    _registry_options(lst)
    lst.set_defaults(handler="models:run_list")

    get = msub.add_parser("get", help="one version with its config and manifest (JSON)")
    get.add_argument("name", help="model name")
    get.add_argument("--version", help="version or alias (default: stable)")
    _registry_options(get)
    get.set_defaults(handler="models:run_get")

    alias = msub.add_parser("alias", help="point an alias at a version")
    alias.add_argument("name", help="model name")
    alias.add_argument("alias", help="alias, e.g. stable or canary")
    alias.add_argument("version", help="version it points at")
    _registry_options(alias)
    alias.set_defaults(handler="models:run_alias")

    wait = msub.add_parser("wait", help="wait until the gateway reports the model ready")
    wait.add_argument("name", help="model name")
    wait.add_argument("--version", help="a specific version")
    _home_option(wait)
    wait.add_argument("--url", help="gateway gRPC HOST:PORT (default: from state.json, :8001)")
    wait.add_argument("--timeout", type=_positive_float, default=120.0, help="seconds (120)")
    wait.add_argument("--interval", type=_positive_float, default=0.25, help="poll interval (s)")
    wait.set_defaults(handler="models:run_wait")


def _add_infer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "infer",
        help="send one KServe V2 gRPC inference request",
        description="Inputs: NAME=JSON (e.g. input='[[0.1, 0.2]]') or NAME=@file.npy; "
        "--random N makes N random rows for every input not given.",
    )
    p.add_argument("model", help="model name")
    p.add_argument("--version", help="pin a version (default: the router's choice)")
    p.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME=JSON|@file.npy",
        help="an input tensor (repeatable)",
    )
    p.add_argument("--random", type=_positive_int, metavar="N", help="N random rows per input")
    p.add_argument("--seed", type=int, help="seed of --random")
    p.add_argument("--id", default="", help="request id")
    _home_option(p)
    p.add_argument("--url", help="gateway gRPC HOST:PORT (default: from state.json, :8001)")
    p.add_argument("--timeout", type=_positive_float, default=30.0, help="seconds (30)")
    p.add_argument("--compact", action="store_true", help="one-line JSON")
    p.add_argument("--show-inputs", action="store_true", help="also print the inputs sent")
    p.set_defaults(handler="infer:run")


def _add_limits(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "limits",
        help="show or change cluster-wide QPS limits (kept in Redis, live on every gateway)",
    )
    lsub = p.add_subparsers(dest="action", metavar="ACTION")
    p.set_defaults(handler="limits:run", action="list")

    def common(q: argparse.ArgumentParser) -> None:
        _home_option(q)
        q.add_argument("--redis", help="Redis URL (default: the stack's, from state.json)")
        q.add_argument("--prefix", default="ib", help="Redis key prefix of the gateways (ib)")
        q.add_argument("--json", action="store_true", help="print the limits as JSON")

    common(p)
    lst = lsub.add_parser("list", help="every limit")
    common(lst)
    st = lsub.add_parser("set", help="create or change a limit")
    common(st)
    st.add_argument("scope", choices=["interface", "model", "tenant-model"])
    st.add_argument("name", help="ModelInfer | MODEL | TENANT:MODEL (* allowed)")
    st.add_argument("qps", type=_positive_float, help="requests per second")
    st.add_argument("--burst", type=_positive_float, help="bucket size (default: derived)")
    dl = lsub.add_parser("delete", help="remove a limit")
    common(dl)
    dl.add_argument("scope", choices=["interface", "model", "tenant-model"])
    dl.add_argument("name")


def _add_keys(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="API keys and model access of tenants (kept in Redis)")
    ksub = p.add_subparsers(dest="action", metavar="ACTION")
    p.set_defaults(handler="keys:run", action="list", tenant="")

    def common(q: argparse.ArgumentParser) -> None:
        _home_option(q)
        q.add_argument("--redis", help="Redis URL (default: the stack's, from state.json)")
        q.add_argument("--prefix", default="ib", help="Redis key prefix of the gateways (ib)")
        q.add_argument("--json", action="store_true", help="print JSON")

    common(p)
    lst = ksub.add_parser("list", help="every key (never the secrets)")
    common(lst)
    lst.add_argument("tenant", nargs="?", default="", help="only this tenant's keys")
    cr = ksub.add_parser("create", help="a new key for a tenant (printed once)")
    common(cr)
    cr.add_argument("tenant")
    cr.add_argument("--models", nargs="*", default=[], help="also allow these models (* = all)")
    rv = ksub.add_parser("revoke", help="revoke a key by id")
    common(rv)
    rv.add_argument("key_id")
    for name, text in (("allow", "let a tenant call models"), ("disallow", "take models away")):
        q = ksub.add_parser(name, help=text)
        common(q)
        q.add_argument("tenant")
        q.add_argument("models", nargs="+")


def build_parser() -> argparse.ArgumentParser:
    """The `inferbus` parser.

    Each subcommand sets ``handler`` to ``"<module>:<function>"`` in
    `inferbus_cli.commands`; it is imported only when chosen, so that
    ``inferbus down`` does not pay for numpy and the protos' imports.
    """
    parser = argparse.ArgumentParser(
        prog="inferbus",
        description="Run and use a local inferbus stack.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_up(sub)
    _add_down(sub)
    _add_limits(sub)
    _add_keys(sub)
    _add_status(sub)
    _add_models(sub)
    _add_infer(sub)
    return parser
