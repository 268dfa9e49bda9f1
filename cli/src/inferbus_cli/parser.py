"""The `inferbus` argument parser: every subcommand, option and default."""

from __future__ import annotations

import argparse
import os

from inferbus_cli.busclient import nats_options, parse_duration
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


#: ``--gateways auto``: one gateway process per this many CPU cores ...
GATEWAY_CORES_EACH = 4
#: ... and at most this many.
GATEWAYS_AUTO_MAX = 8


def auto_gateways(cores: int | None) -> int:
    """``--gateways auto``: one process per 4 cores, at least 1, at most 8.

    A gateway process holds about 1.2 cores at full load (issue 31) and the
    router, batcher and workers need the rest of the host.
    """
    return max(1, min(GATEWAYS_AUTO_MAX, (cores or 1) // GATEWAY_CORES_EACH))


def _gateways(text: str) -> int:
    if text == "auto":
        return auto_gateways(len(os.sched_getaffinity(0)))
    return _positive_int(text)


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
        "-d",
        "--detach",
        action="store_true",
        help="return once everything is up; a background supervisor keeps it running",
    )
    p.add_argument(
        "--no-restart",
        action="store_true",
        help="leave a crashed service down (default: restart it, with back-off)",
    )
    # The background supervisor that `up -d` starts (not for people).
    p.add_argument("--supervisor", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--nats-cluster",
        type=int,
        choices=(1, 3, 5),
        default=1,
        help="NATS nodes: 1, or a cluster of 3 or 5 with clustered JetStream and "
        "3 replicas of every stream and bucket (1)",
    )
    _home_option(p)
    p.add_argument("--workers", type=_positive_int, default=1, help="worker processes (1)")
    p.add_argument(
        "--gateways",
        type=_gateways,
        default=1,
        help="gateway processes sharing the HTTP and gRPC ports (SO_REUSEPORT): a number, "
        "or 'auto' = one per 4 CPU cores, at least 1, at most 8 (1)",
    )
    edge_help = "also start inferbus-edge, a compiled gRPC front on --edge-port (8003)"
    p.add_argument("--edge", action="store_true", help=edge_help)
    p.add_argument(
        "--gpus",
        help="one worker per GPU instead of --workers: 'all', or GPU indices or UUIDs "
        "separated by commas (each worker gets its GPU as CUDA_VISIBLE_DEVICES)",
    )
    p.add_argument("--pool", default="default", help="worker pool of the workers (default)")
    p.add_argument("--store", choices=["local", "s3"], default="local", help="artifact store")
    p.add_argument("--s3-endpoint", default="127.0.0.1:9000", help="S3 endpoint HOST:PORT")
    p.add_argument("--s3-access-key", default="", help="S3 access key")
    p.add_argument("--s3-secret-key", default="", help="S3 secret key")
    p.add_argument("--s3-bucket", default="inferbus", help="S3 bucket")
    p.add_argument("--s3-secure", action="store_true", help="use HTTPS for S3")
    p.add_argument("--no-redis", action="store_true", help="do not start redis-server")
    p.add_argument(
        "--no-llm",
        action="store_true",
        help="do not start the LLM worker even when .venvs/vllm exists (scripts/bootstrap-llm.sh)",
    )
    d = Ports()
    ports = p.add_argument_group("ports (0 = any free port)")
    for flag, default, what in [
        ("--http-port", d.gateway_http, "gateway KServe V2 HTTP"),
        ("--grpc-port", d.gateway_grpc, "gateway KServe V2 gRPC"),
        ("--metrics-port", d.gateway_metrics, "gateway metrics"),
        ("--edge-port", d.edge_grpc, "edge KServe V2 gRPC (with --edge)"),
        ("--edge-metrics-port", d.edge_metrics, "edge metrics (with --edge)"),
        ("--nats-port", d.nats, "NATS clients (+1 per cluster node)"),
        ("--nats-monitor-port", d.nats_monitor, "NATS monitoring (+1 per cluster node)"),
        ("--nats-cluster-port", d.nats_cluster, "NATS cluster routes (+1 per node)"),
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
    push.add_argument(
        "path",
        help="version directory (config.json + artifact), a .onnx or torch.export .pt2 file, "
        "or a scikit-learn model.pkl/model.joblib (converted to ONNX by the registry)",
    )
    push.add_argument("--name", required=True, help="model name")
    push.add_argument("--version", required=True, help="version, e.g. 1 or 1.2.0")
    push.add_argument(
        "--alias", action="append", default=[], help="alias to point at it (repeatable)"
    )
    push.add_argument(
        "--config",
        help="config.json for a single-file PATH (without it a .onnx or .pt2 file's config "
        "is derived from its graph, and printed)",
    )
    push.add_argument("--json", action="store_true", help="print the version as JSON")
    push.add_argument(
        "--progress", action="store_true", help="draw a progress bar even when not a terminal"
    )
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
    alias.add_argument(
        "--force",
        action="store_true",
        help="skip the registry's artifact check (workers still verify; stable keeps "
        "serving until the new version is ready)",
    )
    _registry_options(alias)
    alias.set_defaults(handler="models:run_alias")

    for verb, text in (
        ("archive", "keep a version's files but take it out of serving"),
        ("unarchive", "make an archived version usable again"),
        ("delete", "delete a version's files and catalog entry"),
    ):
        q = msub.add_parser(verb, help=text)
        q.add_argument("name", help="model name")
        q.add_argument("version", help="version number")
        q.add_argument("--json", action="store_true", help="print the model as JSON")
        if verb == "delete":
            q.add_argument("--yes", action="store_true", help="do not ask for confirmation")
        _registry_options(q)
        q.set_defaults(handler=f"models:run_{verb}")

    dl = msub.add_parser("download", help="download an artifact file of a version")
    dl.add_argument("name", help="model name")
    dl.add_argument("--version", help="version or alias (default: stable)")
    dl.add_argument("--file", help="file inside the version (default: the config's model file)")
    dl.add_argument("-o", "--output", help="file or directory to write (default: ./<file>)")
    dl.add_argument(
        "--progress", action="store_true", help="draw a progress bar even when not a terminal"
    )
    _registry_options(dl, timeout=300.0)
    dl.set_defaults(handler="models:run_download")

    opt = msub.add_parser(
        "optimize", help="push an fp16 or int8 variant of a version, with its error and speed"
    )
    opt.add_argument("name", help="model name")
    opt.add_argument("version", help="source version or alias")
    kind = opt.add_mutually_exclusive_group(required=True)
    kind.add_argument("--fp16", action="store_true", help="float16 weights, float32 IO kept")
    kind.add_argument("--int8", action="store_true", help="int8 quantisation (ONNX Runtime)")
    opt.add_argument(
        "--calibration",
        help=".npz of input arrays (rows on axis 0): static int8 and the error sample",
    )
    opt.add_argument("--to", help="new version (default: SOURCE-fp16 / SOURCE-int8)")
    _registry_options(opt, timeout=300.0)
    opt.set_defaults(handler="optimize:run_optimize")

    prof = msub.add_parser("profile", help="ONNX Runtime (or torch) profiler: top ops per batch")
    prof.add_argument("name", help="model name")
    prof.add_argument("version", help="version or alias")
    prof.add_argument("--batch", default="1,8,32", help="batch sizes, comma-separated")
    prof.add_argument("--top", type=int, default=10, help="operators shown per batch (10)")
    prof.add_argument("--json", action="store_true", help="print JSON")
    _registry_options(prof, timeout=300.0)
    prof.set_defaults(handler="optimize:run_profile")

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


def _add_replay(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="replay captured requests of one version against another and report differences",
        description="Reads requests captured by the gateways (INFERBUS_GATEWAY_CAPTURE_RATE) for "
        "--from from the audit stream, sends each through the gateway pinned to --to, and "
        "compares the answers (exact for ints/bytes, allclose for floats, argmax agreement).",
    )
    p.add_argument("model", help="model name")
    p.add_argument("--from", dest="from_version", required=True, help="version that answered")
    p.add_argument("--to", dest="to_version", required=True, help="version to replay against")
    p.add_argument(
        "--since", type=parse_duration, default=3600.0, help="captures this recent (1h; 15m, 2d)"
    )
    p.add_argument("--limit", type=_positive_int, help="replay at most N requests (oldest first)")
    p.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance for floats (1e-5)")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance for floats (1e-4)")
    p.add_argument("--concurrency", type=_positive_int, default=8, help="requests in flight (8)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _home_option(p)
    nats_options(p)
    p.add_argument("--url", help="gateway gRPC HOST:PORT (default: from state.json, :8001)")
    p.add_argument("--timeout", type=_positive_float, default=30.0, help="per request (30 s)")
    p.set_defaults(handler="replay:run")


def _add_drift(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("drift", help="input/output drift of deployed versions")
    dsub = p.add_subparsers(dest="drift_command", metavar="COMMAND", required=True)
    rep = dsub.add_parser(
        "report", help="the worst-drifting features of a model (PSI, KS) per version"
    )
    rep.add_argument("model", help="model name")
    rep.add_argument("--version", default="", help="one version (default: every version)")
    rep.add_argument("--top", type=_positive_int, default=10, help="features shown (10)")
    rep.add_argument(
        "--threshold", type=_positive_float, default=0.2, help="PSI marked as drift (0.2)"
    )
    rep.add_argument("--json", action="store_true", help="print JSON")
    _home_option(rep)
    nats_options(rep)
    rep.set_defaults(handler="drift:run_report")


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="build a drift reference profile (profile.json) from a sample file",
        description="Per-feature histograms with bins from the sample's quantiles; put the "
        "result into the version directory before `inferbus models push`.",
    )
    p.add_argument("model", help="model name (recorded in the profile)")
    p.add_argument(
        "--sample", required=True, help="inputs: .npy, .npz (one array per input) or .csv"
    )
    p.add_argument("--input", default="input", help="input name for a .npy/.csv sample (input)")
    p.add_argument("--outputs", help="the model's outputs on the same rows (.npy, .npz, .csv)")
    p.add_argument(
        "--output", default="probabilities", help="output name for a .npy/.csv --outputs file"
    )
    p.add_argument("--bins", type=_positive_int, default=10, help="bins per feature (10)")
    p.add_argument("--out", default="profile.json", help="file written (profile.json)")
    p.set_defaults(handler="profile:run")


def _weights(text: str) -> list[float]:
    """``5,25,50,100`` → [5.0, 25.0, 50.0, 100.0] (rollout steps)."""
    try:
        steps = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of weights, e.g. 5,25,50,100"
        ) from None
    if not steps:
        raise argparse.ArgumentTypeError("give at least one weight, e.g. 5,25,50,100")
    return steps


def _release_options(p: argparse.ArgumentParser, *, json_help: str = "print JSON") -> None:
    _registry_options(p)
    p.add_argument("--json", action="store_true", help=json_help)
    p.add_argument("--by", help="who makes the change (default: user@host), recorded")


def _add_route(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "route",
        help="show a model's routing table or change its traffic split",
        description="Routes live in NATS KV; every change bumps the revision and is recorded "
        "(who, when, why) and published as an event.",
    )
    rsub = p.add_subparsers(dest="route_command", metavar="COMMAND", required=True)
    show = rsub.add_parser("show", help="the route, its revision and its history")
    show.add_argument("model", help="model name")
    show.add_argument("--history", type=int, default=5, help="earlier revisions to show (5)")
    _release_options(show)
    show.set_defaults(handler="route:run_show")

    st = rsub.add_parser("set", help="change canary, shadow, stickiness or pool")
    st.add_argument("model", help="model name")
    st.add_argument("--canary", help="canary version (none = clear)")
    st.add_argument("--weight", type=float, help="canary weight in percent (0-100)")
    st.add_argument("--shadow", help="shadow version (none = clear)")
    st.add_argument("--shadow-rate", type=float, help="share of requests copied (0-1)")
    st.add_argument("--sticky", help="tenant | header:<Name> | none")
    st.add_argument("--pool", help="pool of the stable version")
    st.add_argument(
        "--expect-revision",
        type=int,
        help="KV revision read with `route show`: refuse if the route changed since",
    )
    st.add_argument("-m", "--message", help="why (recorded as the route's change text)")
    st.add_argument(
        "--force",
        action="store_true",
        help="skip the registry's artifact check of the canary/shadow (routers still send "
        "nothing to a version no worker reports ready)",
    )
    _release_options(st)
    st.set_defaults(handler="route:run_set")


def _add_rollout(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "rollout",
        help="progressive rollouts that roll themselves back",
        description="The registry moves the canary weight step by step, judging each step from "
        "the gateways' audit records (error rate, p99 vs stable).",
    )
    rsub = p.add_subparsers(dest="rollout_command", metavar="COMMAND", required=True)
    start = rsub.add_parser("start", help="start rolling a version out")
    start.add_argument("model", help="model name")
    start.add_argument("version", help="version (or alias) to roll out")
    start.add_argument(
        "--steps", type=_weights, default=[5.0, 25.0, 50.0, 100.0], help="weights (5,25,50,100)"
    )
    start.add_argument(
        "--interval", type=parse_duration, default=60.0, help="time per step (60s; 2m, 500ms)"
    )
    start.add_argument(
        "--max-error-rate", type=float, default=0.01, help="canary error rate allowed (0.01)"
    )
    start.add_argument(
        "--max-p99-ratio", type=float, default=1.5, help="canary p99 / stable p99 allowed (1.5)"
    )
    start.add_argument(
        "--min-requests", type=_positive_int, default=20, help="canary requests to judge (20)"
    )
    start.add_argument("--on-fail", choices=["rollback", "pause"], default="rollback")
    start.add_argument(
        "--ready-timeout",
        type=parse_duration,
        default=120.0,
        help="time the canary may take to load before the rollout fails (120s)",
    )
    _release_options(start)
    start.set_defaults(handler="rollout:run_start")

    status = rsub.add_parser("status", help="the model's latest rollout")
    status.add_argument("model", help="model name")
    _release_options(status)
    status.set_defaults(handler="rollout:run_status")

    for action, text in (
        ("pause", "hold the current weight"),
        ("resume", "continue a paused rollout (the step's window starts again)"),
        ("abort", "stop: the canary leaves the route, stable unchanged"),
        ("rollback", "stop and roll back (after success: stable moves back)"),
    ):
        q = rsub.add_parser(action, help=text)
        q.add_argument("model", help="model name")
        q.add_argument("--reason", help="why (recorded)")
        _release_options(q)
        q.set_defaults(handler="rollout:run_control", action=action)


def _add_pools(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pools",
        help="the pool ledger (workers, specs, GPUs, placement, lag) and quotas",
    )
    psub = p.add_subparsers(dest="pools_command", metavar="COMMAND")
    _release_options(p)
    p.set_defaults(handler="pools:run_list")
    lst = psub.add_parser("list", help="the ledger (default)")
    _release_options(lst)
    lst.set_defaults(handler="pools:run_list")
    st = psub.add_parser("set", help="create or change a pool's quota and release state")
    st.add_argument("pool", help="pool name")
    st.add_argument("--max-workers", type=int, help="workers admitted at most (0 = unlimited)")
    st.add_argument("--max-gpus", type=int, help="GPUs of admitted workers at most (0 = unlimited)")
    st.add_argument("--state", choices=["open", "frozen"], help="release state")
    _release_options(st)
    st.set_defaults(handler="pools:run_set")


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
    _add_route(sub)
    _add_rollout(sub)
    _add_pools(sub)
    _add_replay(sub)
    _add_drift(sub)
    _add_profile(sub)
    return parser
