"""NATS subject, stream, consumer and KV bucket names.

Pure functions of a prefix (default ``ib``) and names. Model names, versions
and pools are free text for users, so each is mapped to a safe token: ASCII
letters, digits, ``_`` and ``-`` stay as they are; every other byte of the
UTF-8 encoding becomes ``=XX`` (hex). The mapping is reversible and its output
is valid in subjects, KV keys, stream and consumer names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SAFE = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
_ESCAPE = re.compile(r"=([0-9A-F]{2})")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_-]+$")


def subject_token(name: str) -> str:
    """Map a name to one safe subject token (see module docstring)."""
    if not name:
        raise ValueError("an empty name cannot be a subject token")
    out = []
    for b in name.encode("utf-8"):
        out.append(chr(b) if b in _SAFE else f"={b:02X}")
    return "".join(out)


def name_from_token(token: str) -> str:
    """Inverse of `subject_token`."""
    raw = bytearray()
    i = 0
    while i < len(token):
        if token[i] == "=":
            raw.append(int(token[i + 1 : i + 3], 16))
            i += 3
        else:
            raw.append(ord(token[i]))
            i += 1
    return raw.decode("utf-8")


@dataclass(frozen=True, slots=True)
class Subjects:
    """Every name on the bus, derived from one prefix.

    Attributes:
        prefix: first subject token; several deployments can share one NATS
            server with different prefixes.
    """

    prefix: str = "ib"

    def __post_init__(self) -> None:
        if not _PREFIX_RE.match(self.prefix):
            raise ValueError(f"subject prefix {self.prefix!r} must match {_PREFIX_RE.pattern}")

    # --- data path -----------------------------------------------------------
    def route(self, model: str) -> str:
        """Gateway → router, one subject per model (router queue group)."""
        return f"{self.prefix}.route.{subject_token(model)}"

    @property
    def route_all(self) -> str:
        """Wildcard the router subscribes to."""
        return f"{self.prefix}.route.*"

    def gen_route(self, model: str) -> str:
        """Gateway → router for generative requests, one subject per model (router
        queue group): its own subject, so that each subject has one request framing
        (request bundles on `route`, headers and a JSON body here)."""
        return f"{self.prefix}.genroute.{subject_token(model)}"

    @property
    def gen_route_all(self) -> str:
        """Wildcard the router subscribes to for generative requests."""
        return f"{self.prefix}.genroute.*"

    def edge_grpc(self) -> str:
        """gRPC edge (``services/edge``) → gateways, queue group ``gateway``: one
        unary KServe V2 call, request/reply (`inferbus_gateway.grpc_api.edge`)."""
        return f"{self.prefix}.edge.grpc"

    def infer(self, model: str, version: str) -> str:
        """Router → batcher, one subject per model version (batcher queue group)."""
        return f"{self.prefix}.infer.{subject_token(model)}.{subject_token(version)}"

    @property
    def infer_all(self) -> str:
        """Wildcard the batcher subscribes to."""
        return f"{self.prefix}.infer.*.*"

    def fast(self, model: str, version: str) -> str:
        """Gateway → idle workers: the fast lane of a model version (core NATS, worker
        queue group; a lone request on a plain route, see docs/architecture.md)."""
        return f"{self.prefix}.fast.{subject_token(model)}.{subject_token(version)}"

    def batch(self, pool: str, model: str, version: str) -> str:
        """Batcher → workers: JetStream work-queue subject for micro-batches."""
        return (
            f"{self.prefix}.batch.{subject_token(pool)}."
            f"{subject_token(model)}.{subject_token(version)}"
        )

    @property
    def batch_all(self) -> str:
        """Subjects captured by the micro-batch stream."""
        return f"{self.prefix}.batch.>"

    def gen(self, model: str, version: str) -> str:
        """Router → generative workers (skips the batcher)."""
        return f"{self.prefix}.gen.{subject_token(model)}.{subject_token(version)}"

    def gen_worker(self, model: str, version: str, worker_id: str) -> str:
        """Router → one generative worker of a version: prefix-aware placement
        (`inferbus_router.prefix`). A worker subscribes to it only while it has a
        free running slot; the router falls back to `gen` on "no responders"."""
        return f"{self.gen(model, version)}.{subject_token(worker_id)}"

    def gen_cancel(self, request_id: str) -> str:
        """Gateway → every generative worker: stop generating for this request.

        Not under ``gen.``: a model named ``cancel`` would otherwise collide with it.
        """
        return f"{self.prefix}.gencancel.{subject_token(request_id)}"

    @property
    def gen_cancel_all(self) -> str:
        """Wildcard every generative worker subscribes to (no queue group: all see it)."""
        return f"{self.prefix}.gencancel.*"

    def idle(self, pool: str, model: str, version: str) -> str:
        """Worker → batchers: a worker of this pool has a free slot and an empty queue."""
        return (
            f"{self.prefix}.idle.{subject_token(pool)}."
            f"{subject_token(model)}.{subject_token(version)}"
        )

    @property
    def idle_all(self) -> str:
        """Wildcard the batchers subscribe to for idle signals."""
        return f"{self.prefix}.idle.*.*.*"

    def sequence(self, worker: str, model: str, version: str) -> str:
        """Gateway → one worker: a request of a sequence (stateful model) that worker holds."""
        return (
            f"{self.prefix}.seq.{subject_token(worker)}."
            f"{subject_token(model)}.{subject_token(version)}"
        )

    def alive(self, worker: str) -> str:
        """Gateway → one worker: are you there? (An empty answer; nats-server's "no
        responders" says the worker's connection is gone: it died.)"""
        return f"{self.prefix}.alive.{subject_token(worker)}"

    def sequence_locate(self, model: str, version: str) -> str:
        """Gateway → every worker of a version: which of you holds this sequence?"""
        return f"{self.prefix}.seqwho.{subject_token(model)}.{subject_token(version)}"

    @property
    def sequence_all(self) -> str:
        """Wildcard of the sequence subjects (requests and locate questions)."""
        return f"{self.prefix}.seq.>"

    @property
    def sequence_locate_all(self) -> str:
        """Wildcard of the locate questions."""
        return f"{self.prefix}.seqwho.>"

    def reply_inbox(self, instance: str) -> str:
        """Prefix of reply subjects owned by one gateway instance."""
        return f"{self.prefix}.reply.{subject_token(instance)}"

    def shadow_inbox(self, instance: str) -> str:
        """Prefix of the subjects one router instance receives shadow-compare replies on.

        Under the reply namespace, so whoever may answer a request may answer
        it (NATS permissions), yet never inside a gateway's ``<inbox>.*``.
        """
        return f"{self.prefix}.reply.{subject_token(instance)}.shadow"

    # --- control plane -------------------------------------------------------
    def events(self, model: str) -> str:
        """Registry lifecycle events for one model."""
        return f"{self.prefix}.events.registry.{subject_token(model)}"

    @property
    def events_all(self) -> str:
        """Wildcard for every registry event."""
        return f"{self.prefix}.events.registry.*"

    def load_hint(self, model: str, version: str) -> str:
        """Gateway → workers: a request wants this lazy version; load it."""
        return f"{self.prefix}.loadhint.{subject_token(model)}.{subject_token(version)}"

    @property
    def load_hint_all(self) -> str:
        """Wildcard every worker subscribes to (no queue group: every worker of the pool loads)."""
        return f"{self.prefix}.loadhint.*.*"

    def audit(self, model: str) -> str:
        """Gateway → audit trail: one JSON record per answered request (`AuditRecord`)."""
        return f"{self.prefix}.audit.{subject_token(model)}"

    @property
    def audit_all(self) -> str:
        """Subjects captured by the audit stream."""
        return f"{self.prefix}.audit.>"

    @property
    def audit_records_all(self) -> str:
        """Wildcard of the audit records alone (one token per model, no payloads)."""
        return f"{self.prefix}.audit.*"

    def audit_payload(self, model: str, version: str) -> str:
        """Gateway → audit stream: captured request/answer tensors (`inferbus_common.capture`).

        One subject per model version, so replay reads only the version it replays.
        """
        return f"{self.prefix}.audit.payload.{subject_token(model)}.{subject_token(version)}"

    @property
    def audit_payload_all(self) -> str:
        """Wildcard of every captured payload."""
        return f"{self.prefix}.audit.payload.>"

    @property
    def batch_stream(self) -> str:
        """JetStream stream holding micro-batches (work-queue retention)."""
        return f"{self.prefix.upper().replace('-', '_')}_BATCHES"

    @property
    def audit_stream(self) -> str:
        """JetStream stream holding the audit trail."""
        return f"{self.prefix.upper().replace('-', '_')}_AUDIT"

    def batch_consumer(self, pool: str, model: str, version: str) -> str:
        """Durable pull consumer shared by the workers of one pool/model/version."""
        return f"w_{subject_token(pool)}__{subject_token(model)}__{subject_token(version)}"

    @property
    def routes_bucket(self) -> str:
        """KV bucket: model → routing table."""
        return f"{self.prefix}_routes"

    @property
    def models_bucket(self) -> str:
        """KV bucket: model.version → deployed version (config, digest, pool)."""
        return f"{self.prefix}_models"

    @property
    def profiles_bucket(self) -> str:
        """KV bucket: model.version → the version's drift reference (``profile.json``)."""
        return f"{self.prefix}_profiles"

    @property
    def drift_bucket(self) -> str:
        """KV bucket: model.version → latest drift statistics (`drift.DriftReport`)."""
        return f"{self.prefix}_drift"

    @property
    def workers_bucket(self) -> str:
        """KV bucket: worker id → heartbeat with the versions it serves."""
        return f"{self.prefix}_workers"

    @property
    def rollouts_bucket(self) -> str:
        """KV bucket: model → its latest progressive rollout (state machine record)."""
        return f"{self.prefix}_rollouts"

    @property
    def pools_bucket(self) -> str:
        """KV bucket: pool → quota and release state (`PoolSpec`)."""
        return f"{self.prefix}_pools"

    @staticmethod
    def model_key(model: str, version: str | None = None) -> str:
        """KV key for a model (routes) or a model version (models)."""
        if version is None:
            return subject_token(model)
        return f"{subject_token(model)}.{subject_token(version)}"
