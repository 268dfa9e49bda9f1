"""Who may say what on the bus: per-service NATS users and subject permissions.

Each service connects as its own NATS user (password or NKEY/JWT credentials
file, see `ServiceSettings.nats_auth`). The broker, not the services, enforces
what each user may publish and subscribe to, so a compromised or buggy worker
cannot write routes, and a gateway cannot forge worker replies. The table is
built from `Subjects`, so a non-default prefix gets the same rules.

`nats_authorization` renders the ``authorization`` block of a nats-server
configuration from that table; ``python -m inferbus_common.security`` writes a
complete configuration plus one environment file per service.

Each user also gets its own inbox prefix (``_INBOX_<user>``): JetStream API
answers and KV watch deliveries go there, and no other service may read them.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

from inferbus_common.subjects import Subjects

ROLES = ("gateway", "router", "batcher", "worker", "llm", "registry", "edge", "admin")
"""NATS users of an installation: one per service kind (``edge``: the compiled gRPC
front, services/edge), plus ``admin`` (CLI, operators)."""

SERVICE_ENV = {
    "gateway": "INFERBUS_GATEWAY_",
    "router": "INFERBUS_ROUTER_",
    "batcher": "INFERBUS_BATCHER_",
    "worker": "INFERBUS_WORKER_",
    "llm": "INFERBUS_LLM_",
    "registry": "INFERBUS_REGISTRY_",
    "edge": "INFERBUS_EDGE_",
}
"""Environment prefix of each service's settings."""


def inbox_prefix(user: str) -> str:
    """Inbox prefix of a user's connection (see the module docstring)."""
    return f"_INBOX_{user}"


@dataclass
class Permissions:
    """Subjects a NATS user may publish to and subscribe to (NATS wildcards)."""

    publish: list[str] = field(default_factory=list)
    subscribe: list[str] = field(default_factory=list)


def _kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def permissions(role: str, subjects: Subjects) -> Permissions:
    """The permissions of one role.

    Raises:
        ValueError: unknown role.
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
    p = subjects.prefix
    if role == "admin":
        return Permissions(publish=[">"], subscribe=[">"])
    if role == "edge":
        # It only asks the gateways' queue group and reads their answers: no
        # catalog, no stream, no other service's subjects.
        return Permissions(publish=[subjects.edge_grpc()], subscribe=[f"{inbox_prefix(role)}.>"])
    buckets = [
        subjects.models_bucket,
        subjects.routes_bucket,
        subjects.workers_bucket,
        subjects.rollouts_bucket,
        subjects.pools_bucket,
        subjects.profiles_bucket,
        subjects.drift_bucket,
    ]
    kv_streams = [_kv_stream(b) for b in buckets]
    # Every service reads the catalog: open (or create) the buckets, watch them
    # through ordered consumers, read single keys.
    pub = ["$JS.API.INFO", "$JS.FC.>"]
    for stream in kv_streams:
        pub += [
            f"$JS.API.STREAM.INFO.{stream}",
            f"$JS.API.STREAM.CREATE.{stream}",
            f"$JS.API.CONSUMER.CREATE.{stream}",
            f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.DELETE.{stream}.*",
            f"$JS.API.CONSUMER.INFO.{stream}.*",
            f"$JS.API.DIRECT.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}.>",
            f"$JS.API.STREAM.MSG.GET.{stream}",
        ]
    sub = [f"{inbox_prefix(role)}.>"]
    batches = subjects.batch_stream
    batch_stream_api = [
        f"$JS.API.STREAM.INFO.{batches}",
        f"$JS.API.STREAM.CREATE.{batches}",
    ]
    audit_stream_api = [
        f"$JS.API.STREAM.INFO.{subjects.audit_stream}",
        f"$JS.API.STREAM.CREATE.{subjects.audit_stream}",
        f"$JS.API.STREAM.UPDATE.{subjects.audit_stream}",
    ]
    replies = f"{p}.reply.>"
    if role == "gateway":
        pub += [
            f"{p}.route.>",
            f"{p}.genroute.>",
            # Direct dispatch: requests on plain routes go straight to the batchers,
            # generative ones to the LLM workers.
            f"{p}.infer.>",
            f"{p}.gen.>",
            # The fast lane: lone requests straight to a worker with a free slot.
            f"{p}.fast.>",
            f"{p}.audit.>",
            f"{p}.gencancel.>",
            f"{p}.loadhint.>",
            # Liveness probes of workers (a crashed worker is known at once).
            f"{p}.alive.>",
            # Stateful models: requests straight to the worker holding the sequence.
            subjects.sequence_all,
            subjects.sequence_locate_all,
            f"$KV.{subjects.drift_bucket}.>",
            *audit_stream_api,
            # Reply frames: answers to the edge's calls, gathered, on its inbox.
            f"{inbox_prefix('edge')}.>",
        ]
        # Unary calls the gRPC edge (services/edge) carries over NATS.
        sub += [replies, subjects.edge_grpc()]
    elif role == "router":
        pub += [f"{p}.infer.>", f"{p}.gen.>", replies]
        sub += [f"{p}.route.>", f"{p}.genroute.>", f"{p}.audit.>", f"{p}.reply.>"]
    elif role == "batcher":
        # The batcher applies its stream bounds (and replicas) to an existing stream.
        pub += [f"{p}.batch.>", replies, *batch_stream_api, f"$JS.API.STREAM.UPDATE.{batches}"]
        sub += [f"{p}.infer.>", f"{p}.idle.>"]
    elif role in ("worker", "llm"):
        pub += [
            replies,
            f"{p}.idle.>",
            # Its start-up check that liveness probes reach it (versionhost.py).
            f"{p}.alive.>",
            f"$KV.{subjects.workers_bucket}.>",
            *batch_stream_api,
            f"$JS.API.CONSUMER.CREATE.{batches}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{batches}.>",
            f"$JS.API.CONSUMER.INFO.{batches}.>",
            f"$JS.API.CONSUMER.MSG.NEXT.{batches}.>",
            f"$JS.ACK.{batches}.>",
        ]
        sub += [
            f"{p}.events.>",
            f"{p}.loadhint.>",
            f"{p}.gen.>",
            f"{p}.gencancel.>",
            f"{p}.alive.>",
        ]
        if role == "worker":
            sub += [subjects.sequence_all, subjects.sequence_locate_all, f"{p}.fast.>"]
        if role == "llm":
            # A full LLM worker hands requests that reached it on to the subject.
            pub.append(f"{p}.gen.>")
    elif role == "registry":
        pub += [
            f"{p}.events.>",
            *(f"$KV.{b}.>" for b in buckets),
            *(f"$JS.API.STREAM.PURGE.{s}" for s in kv_streams),
            *(f"$JS.API.STREAM.UPDATE.{s}" for s in kv_streams),
            f"$JS.API.CONSUMER.LIST.{batches}",
            f"$JS.API.CONSUMER.INFO.{batches}.>",
            *batch_stream_api,
            *audit_stream_api,
            f"$JS.API.CONSUMER.CREATE.{subjects.audit_stream}.>",
            f"$JS.API.CONSUMER.DELETE.{subjects.audit_stream}.>",
        ]
        sub += [f"{p}.audit.>", f"{p}.events.>"]
    return Permissions(publish=pub, subscribe=sub)


def _quote(values: list[str]) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def nats_authorization(passwords: dict[str, str], subjects: Subjects) -> str:
    """The ``authorization { users = [...] }`` block for these users.

    Args:
        passwords: role → password (plain; keep the rendered file private, mode 0600).
        subjects: naming scheme (permissions follow its prefix).
    """
    lines = ["authorization {", "  users = ["]
    for role, password in passwords.items():
        perms = permissions(role, subjects)
        lines.append(
            f"    {{user: {json.dumps(role)}, password: {json.dumps(password)}, permissions: {{"
            f"publish: {{allow: {_quote(perms.publish)}}}, "
            f"subscribe: {{allow: {_quote(perms.subscribe)}}}, "
            # A user that answers requests may publish to the requester's
            # reply subject, whatever its name.
            f"allow_responses: true}}}}"
        )
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def generate(out: Path, subjects: Subjects, roles: tuple[str, ...] = ROLES) -> dict[str, str]:
    """Write ``nats-auth.conf``, one ``<role>.nats-password`` per role and one
    ``<service>.env`` per service (user + password file), with fresh random passwords.

    Returns:
        role → password.
    """
    out.mkdir(parents=True, exist_ok=True)
    passwords = {role: secrets.token_urlsafe(24) for role in roles}
    conf = out / "nats-auth.conf"
    conf.write_text(nats_authorization(passwords, subjects))
    conf.chmod(0o600)
    for role, password in passwords.items():
        secret = out / f"{role}.nats-password"
        secret.write_text(password)
        secret.chmod(0o600)
        prefix = SERVICE_ENV.get(role)
        if prefix is not None:
            env = out / f"{role}.env"
            env.write_text(
                f"{prefix}NATS_USER={role}\n{prefix}NATS_PASSWORD_FILE={secret.resolve()}\n"
            )
            env.chmod(0o600)
    return passwords


def main(argv: list[str] | None = None) -> int:
    """``python -m inferbus_common.security OUT_DIR [--prefix ib]``."""
    ap = argparse.ArgumentParser(
        prog="python -m inferbus_common.security",
        description="Write a nats-server authorization block with one user per inferbus "
        "service (random passwords, per-service subject permissions) and one .env file "
        "per service. Include nats-auth.conf from your nats-server configuration.",
    )
    ap.add_argument("out", type=Path, help="directory for nats-auth.conf and <service>.env")
    ap.add_argument("--prefix", default="ib", help="subject prefix (default: ib)")
    args = ap.parse_args(argv)
    generate(args.out, Subjects(args.prefix))
    print(
        f"wrote {args.out / 'nats-auth.conf'}, <role>.nats-password and <service>.env (mode 0600)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
