"""The gateway's generative path: admit, publish, receive an ordered chunk stream, cancel.

`GenerationDispatcher` owns one inbox subscription per gateway
(``ib.reply.<instance>.gen.*``; the tensor `Dispatcher` only sees
``ib.reply.<instance>.*``, one token deep). Each request gets a `ChunkStream`
that puts the worker's chunks back in ``Ib-Seq`` order (chunk frames, several
streams' chunks in one message on ``ib.reply.<instance>.gen.frames``, are
unpacked into their streams first) within a small window
and fails cleanly (UNAVAILABLE, "stream lost chunk N") on a gap that the window
cannot close or that is not closed within ``gap_timeout_s``.

`GenerationService` is what the OpenAI endpoints call: `GenerationService.open`
runs admission (the same `Admission` as V2: auth, access, breaker, QPS limits,
quotas) plus the tenant's tokens-per-minute bucket, resolves the model (it must
be generative and ready), and publishes the request to ``ib.genroute.<model>``
(a subject of its own: one framing per subject); the router sends it on to
``ib.gen.<model>.<version>``. With direct dispatch, a request on a plain route
(`plain_version`) to a version one LLM worker serves goes to
``ib.gen.<model>.<version>`` itself: the router would have nothing to decide
(no canary draw, no shadow, no placement among workers).
`GenerationCall.chunks` yields the chunks; leaving it early (client gone) or
hitting the deadline publishes ``ib.gencancel.<request id>`` so the worker aborts
the request in vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Mapping

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from inferbus_common.bus import is_no_responders
from inferbus_common.catalog import Catalog, DeployedVersion
from inferbus_common.catalogrecords import not_ready_error
from inferbus_common.errors import (
    FailedPrecondition,
    InferbusError,
    InvalidArgument,
    NotFound,
)
from inferbus_common.generation import (
    GenerationChunk,
    GenerationRequest,
    no_generation_worker,
    unpack_chunks,
)
from inferbus_common.modelconfig import GenerationConfig
from inferbus_common.protocol import headers as h
from inferbus_common.subjects import Subjects
from inferbus_gateway.admission import Admission
from inferbus_gateway.admission.tokens import estimate_prompt_tokens
from inferbus_gateway.chunkstream import ChunkStream
from inferbus_gateway.dispatch.plain import plain_version
from inferbus_gateway.genmetrics import (
    GEN_CANCELS,
    GEN_FRAMES_BAD,
    GEN_INTER_TOKEN,
    GEN_REQUESTS,
    GEN_TOKENS,
    GEN_TOKENS_PER_SECOND,
    GEN_TTFT,
)

log = logging.getLogger(__name__)


MAX_UNANSWERED = 10_000
"""Streams cancelled before any message came that a gateway watches for a late chunk."""

FRAMES_TOKEN = "frames"
"""Last token of the subject where workers send this gateway's chunk frames (stream
tokens are numbers)."""
NO_WORKER_MARK = "n"
"""``<inbox>.n<stream token>``: the NATS reply subject of a request published straight
to a version's LLM workers, where nats-server's "no responders" comes back."""


class GenerationDispatcher:
    """Publishes generative requests and routes chunk messages to their streams.

    Args:
        nc: connected NATS client.
        subjects: naming scheme.
        instance: this gateway's id (names its inbox).
        chunk_frames: ask workers for chunk frames (`frames_subject`).
        catalog: live catalog, to say why no worker took a request published straight
            to a version (`publish_to_workers`).
    """

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        instance: str,
        *,
        chunk_frames: bool = True,
        catalog: Catalog | None = None,
    ) -> None:
        self._nc = nc
        self._catalog = catalog
        self.subjects = subjects
        self._inbox = f"{subjects.reply_inbox(instance)}.gen"
        self.frames_subject = f"{self._inbox}.{FRAMES_TOKEN}" if chunk_frames else ""
        """Where workers send this gateway's chunk frames ('' : not asked for)."""
        self._streams: dict[str, ChunkStream] = {}
        self._unanswered: dict[str, tuple[str, int]] = {}
        """Streams cancelled before any message came: token → (request id, until ns)."""
        self._tokens = itertools.count(1)
        self._sub: Subscription | None = None

    async def start(self) -> None:
        """Subscribe to this instance's generation inbox."""
        self._sub = await self._nc.subscribe(
            f"{self._inbox}.*",
            cb=self._on_chunk,
            pending_msgs_limit=1_000_000,
            pending_bytes_limit=1 << 30,
        )

    async def stop(self) -> None:
        """Unsubscribe; open streams see a gap or their deadline."""
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    @property
    def open_streams(self) -> int:
        """Requests whose chunks are awaited."""
        return len(self._streams)

    async def _on_chunk(self, msg: Msg) -> None:
        token = msg.subject[len(self._inbox) + 1 :]
        if token == FRAMES_TOKEN:
            await self._on_frame(msg)
            return
        if token[:1] == NO_WORKER_MARK:
            self._no_worker(token[1:], msg)
            return
        await self._deliver(token, msg)

    def _no_worker(self, token: str, msg: Msg) -> None:
        """No LLM worker took a request published straight to its version: 429 when
        its workers are all full, 503 when none serves it (as the router answers)."""
        stream = self._streams.get(token)
        if stream is None or stream.direct is None or not is_no_responders(msg):
            return
        assert self._catalog is not None  # `publish_to_workers` made sure of it
        stream.feed_error(no_generation_worker(self._catalog, *stream.direct))

    async def _on_frame(self, msg: Msg) -> None:
        """Hand each chunk of a frame to its stream."""
        version = (msg.headers or {}).get(h.VERSION, "")
        cut = len(self._inbox) + 1
        streams = self._streams
        try:
            for reply, seq, final, body in unpack_chunks(msg.data):
                stream = streams.get(reply[cut:])
                if stream is not None:
                    stream.feed_framed(seq, final, version, body)
                else:
                    await self._late(reply[cut:], not final)
        except ValueError as exc:
            GEN_FRAMES_BAD.inc()
            log.warning("a malformed chunk frame was dropped: %s", exc)

    async def _deliver(self, token: str, msg: Msg) -> None:
        stream = self._streams.get(token)
        if stream is not None:
            stream.feed(msg)
            return
        headers = msg.headers or {}
        await self._late(token, h.SEQ in headers and headers.get(h.FINAL) != "1")

    async def _late(self, token: str, more_to_come: bool) -> None:
        """A chunk for no open stream: a request cancelled before its worker took it
        gets its cancel once more."""
        unanswered = self._unanswered.pop(token, None)
        if unanswered is not None and more_to_come:
            # A worker took the request after its cancel went by: cancel it again.
            GEN_CANCELS.labels("late").inc()
            try:
                await self.publish(self.subjects.gen_cancel(unanswered[0]), b"", {})
            except Exception as exc:  # the worker then stops at the request's deadline
                log.warning("could not publish the cancel of %s: %s", unanswered[0], exc)

    def open(self) -> tuple[str, ChunkStream]:
        """A fresh reply subject and the stream its chunks go to."""
        token = str(next(self._tokens))
        stream = ChunkStream()
        self._streams[token] = stream
        return f"{self._inbox}.{token}", stream

    def close(self, reply: str) -> None:
        """Forget a stream (late chunks are dropped)."""
        self._streams.pop(reply.rsplit(".", 1)[-1], None)

    def close_unanswered(self, reply: str, request_id: str, until_ns: int) -> None:
        """Forget a stream cancelled before any message came; cancel again on its first.

        The request goes to the workers through the router, its cancel straight
        to them: the cancel can arrive before any worker holds the request, and
        is then lost. A first chunk that still comes (before `until_ns`, the
        request's deadline, when the worker stops by itself) gets the cancel
        published once more. At most `MAX_UNANSWERED` are remembered.
        """
        token = reply.rsplit(".", 1)[-1]
        self._streams.pop(token, None)
        now = time.time_ns()
        while self._unanswered:
            oldest = next(iter(self._unanswered))
            if self._unanswered[oldest][1] > now and len(self._unanswered) < MAX_UNANSWERED:
                break
            del self._unanswered[oldest]
        self._unanswered[token] = (request_id, until_ns)

    async def publish(self, subject: str, body: bytes, headers: dict[str, str]) -> None:
        """Publish on the bus (the request, or a cancel)."""
        await self._nc.publish(subject, body, headers=headers)

    async def publish_to_workers(
        self, model: str, version: str, body: bytes, headers: dict[str, str], reply: str
    ) -> None:
        """Publish a request straight to the LLM workers of (`model`, `version`); their
        chunks go to `reply` (`open`), nats-server's "no responders" to its ``n`` twin."""
        assert self._catalog is not None, "direct dispatch needs the dispatcher's catalog"
        token = reply.rsplit(".", 1)[-1]
        stream = self._streams.get(token)
        if stream is not None:
            stream.direct = (model, version)
        await self._nc.publish(
            self.subjects.gen(model, version),
            body,
            reply=f"{self._inbox}.{NO_WORKER_MARK}{token}",
            headers=headers,
        )


_SETTLING: set[asyncio.Future[None]] = set()
"""Settlements in flight (a reference, so none is collected before it ends)."""


class GenerationCall:
    """One admitted, published generative request.

    Attributes:
        request_id: the request id (``Ib-Request-Id``).
        model: the model name the client used.
        version: the version that answered (known after the first chunk).
        prompt_tokens, completion_tokens: counts (final on the last chunk).
        finish_reason: ``stop``/``length``/``abort`` once finished.
    """

    def __init__(
        self,
        service: GenerationService,
        *,
        request_id: str,
        model: str,
        tenant: str,
        reply: str,
        stream: ChunkStream,
        deadline_ns: int,
        estimate: int,
        t0: float,
    ) -> None:
        self._service = service
        self.request_id = request_id
        self.model = model
        self.version = ""
        self.tenant = tenant
        self._reply = reply
        self._stream = stream
        self._deadline_ns = deadline_ns
        self.estimate = estimate
        self._t0 = t0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.created = int(time.time())

    async def chunks(self) -> AsyncGenerator[GenerationChunk, None]:
        """The chunks, in order; cancels the request in the worker if left early.

        Raises:
            InferbusError: see `ChunkStream.chunks`.
        """
        svc = self._service
        status = "CANCELLED"
        why = "client-gone"
        error: InferbusError | None = None
        first_at = last_at = 0.0
        inter_token = GEN_INTER_TOKEN.labels(self.model)
        try:
            async for chunk in self._stream.chunks(self._deadline_ns):
                self.version = self.version or self._stream.version
                now = time.monotonic()
                if chunk.tokens:
                    if not first_at:
                        first_at = now
                        GEN_TTFT.labels(self.model).observe(now - self._t0)
                    elif last_at:
                        inter_token.observe((now - last_at) / chunk.tokens)
                    last_at = now
                    self.completion_tokens += chunk.tokens
                if chunk.finish_reason is not None:
                    self.finish_reason = chunk.finish_reason
                    self.prompt_tokens = chunk.prompt_tokens
                    self.completion_tokens = chunk.completion_tokens or self.completion_tokens
                yield chunk
            status = "OK"
            if first_at and last_at > first_at and self.completion_tokens > 1:
                GEN_TOKENS_PER_SECOND.labels(self.model).observe(
                    (self.completion_tokens - 1) / (last_at - first_at)
                )
        except InferbusError as exc:
            status = exc.code.name
            error = exc
            why = {"DEADLINE_EXCEEDED": "deadline", "UNAVAILABLE": "gap"}.get(status, "")
            raise
        finally:
            if why and status != "OK" and not self._stream.received:
                svc.dispatcher.close_unanswered(self._reply, self.request_id, self._deadline_ns)
            else:
                svc.dispatcher.close(self._reply)
            GEN_REQUESTS.labels(self.model, status).inc()
            GEN_TOKENS.labels(self.model, "prompt").inc(self.prompt_tokens)
            GEN_TOKENS.labels(self.model, "completion").inc(self.completion_tokens)
            # In a task of its own: a client that left cancels this one (Starlette
            # cancels the streaming task, and anyio cancels every await after it),
            # which must not drop the cancel or the token settlement on the way.
            settle = asyncio.ensure_future(self._settle(status, why, error))
            _SETTLING.add(settle)
            settle.add_done_callback(_SETTLING.discard)
            await asyncio.shield(settle)

    async def _settle(self, status: str, why: str, error: InferbusError | None) -> None:
        """Cancel the request in the worker (when left early), settle tokens and breaker."""
        svc = self._service
        if status != "OK" and why:
            GEN_CANCELS.labels(why).inc()
            try:
                await svc.dispatcher.publish(
                    svc.dispatcher.subjects.gen_cancel(self.request_id), b"", {}
                )
            except Exception as exc:  # the worker then finishes it; nothing else to do
                log.warning("could not publish the cancel of %s: %s", self.request_id, exc)
        await svc.finish(self, status, error)


class GenerationService:
    """The generative side of the gateway (see module docstring).

    Args:
        catalog: live catalog.
        dispatcher: publishes and collects chunks.
        admission: the gateway's admission (None: admit all).
        default_timeout_s: upper bound of a request's deadline when it brings none.
        access_log: write one access-log line per OpenAI request (as V2 does).
        direct: publish requests the router has nothing to decide for straight to the
            version's workers (`direct_version`).
    """

    def __init__(
        self,
        catalog: Catalog,
        dispatcher: GenerationDispatcher,
        *,
        admission: Admission | None = None,
        default_timeout_s: float = 120.0,
        access_log: bool = True,
        direct: bool = False,
    ) -> None:
        self.catalog = catalog
        self.dispatcher = dispatcher
        self.direct = direct
        self.admission = admission
        self.default_timeout_s = default_timeout_s
        self.access_log = access_log

    def generative_models(self) -> list[DeployedVersion]:
        """Stable versions of routed models whose engine is generative, by name."""
        out = []
        for name in sorted(self.catalog.routes):
            dv = self.catalog.resolve(name, "")
            if dv is not None and dv.config.generative:
                out.append(dv)
        return out

    def resolve(self, model: str, version: str = "") -> DeployedVersion:
        """The generative version a request names.

        Raises:
            NotFound: unknown model or version.
            FailedPrecondition: the model is not generative (use the V2 API).
        """
        if not model:
            raise InvalidArgument("'model' is required")
        dv = self.catalog.resolve(model, version)
        if dv is None:
            what = f"model '{model}'" + (f" version '{version}'" if version else "")
            raise NotFound(f"{what} is not served here; GET /v1/models lists the models")
        if not dv.config.generative:
            raise FailedPrecondition(
                f"model '{model}' is not generative; call it with the KServe V2 API "
                f"(/v2/models/{model}/infer)"
            )
        return dv

    def direct_version(self, model: str, pinned: str) -> str:
        """The version to publish a request to without the router ('' : through it).

        Only on direct dispatch, for a plain route (`plain_version`: a pin or no
        canary taking traffic, no shadow) whose version exactly one live LLM worker
        serves: with several the router places requests by prompt prefix.
        """
        if not self.direct:
            return ""
        version = plain_version(self.catalog.routes.get(model), pinned)
        if not version or len(self.catalog.ready_workers(model, version)) != 1:
            return ""
        return version

    async def authorize(self, headers: Mapping[str, str], model: str = "") -> str:
        """Authenticate (and, with a model, authorize) a metadata call; returns the tenant."""
        if self.admission is None:
            return ""
        principal = await self.admission.authenticator.authenticate(headers)
        if model:
            await self.admission.authenticator.authorize(principal, model)
        return principal.tenant

    async def visible_models(self, headers: Mapping[str, str]) -> list[DeployedVersion]:
        """`generative_models` the caller may call (all of them when auth is off).

        Raises:
            Unauthenticated: no or bad credentials.
            Unavailable: the access list cannot be read.
        """
        models = self.generative_models()
        if self.admission is None:
            return models
        auth = self.admission.authenticator
        principal = await auth.authenticate(headers)
        return [dv for dv in models if await auth.may_call(principal, dv.model)]

    async def open(
        self,
        model: str,
        request: GenerationRequest,
        headers: Mapping[str, str],
        *,
        version: str = "",
        timeout_s: float | None = None,
        request_id: str = "",
        traceparent: str = "",
    ) -> GenerationCall:
        """Admit and publish a request; returns the call whose chunks to read.

        Raises:
            InferbusError: admission refused (401/403/429/503), unknown or
                non-generative model (404/400), model not ready (503).
        """
        t0 = time.monotonic()
        tenant = ""
        admission = self.admission
        if admission is not None:
            principal = await admission.admit(headers, model=model, interface="Generate")
            tenant = principal.tenant
        estimate = 0
        admitted = False
        try:
            dv = self.resolve(model, version)
            state = self.catalog.version_state(dv.model, dv.version)
            if state != "ready":
                raise not_ready_error(dv.model, dv.version, state)
            gen = dv.config.generation or GenerationConfig()
            if timeout_s is None:
                timeout_s = min(gen.default_timeout_ms / 1000.0, self.default_timeout_s)
            if admission is not None and admission.tokens is not None:
                texts = [m.content for m in request.messages] or [request.prompt]
                estimate = estimate_prompt_tokens(texts)
                if not await admission.tokens.reserve(tenant, estimate):
                    estimate = 0  # no limit: nothing to settle either
            request_id = request_id or uuid.uuid4().hex
            deadline_ns = h.deadline_from_timeout(timeout_s)
            reply, stream = self.dispatcher.open()
            call = GenerationCall(
                self,
                request_id=request_id,
                model=model,
                tenant=tenant,
                reply=reply,
                stream=stream,
                deadline_ns=deadline_ns,
                estimate=estimate,
                t0=t0,
            )
            out = {
                h.REQUEST_ID: request_id,
                h.DEADLINE: str(deadline_ns),
                h.MODEL: model,
                h.REPLY: reply,
                h.KIND: h.KIND_GENERATE,
            }
            if self.dispatcher.frames_subject:
                out[h.CHUNK_FRAMES] = self.dispatcher.frames_subject
            if version:
                # The concrete version resolved above (the router's own rule), so an
                # alias moved meanwhile cannot send it elsewhere.
                out[h.VERSION] = dv.version
            if tenant:
                out[h.TENANT] = tenant
            if traceparent:
                out[h.TRACEPARENT] = traceparent
            direct = self.direct_version(model, dv.version if version else "")
            try:
                if direct:
                    out[h.VERSION] = direct
                    await self.dispatcher.publish_to_workers(
                        model, direct, request.encode(), out, reply
                    )
                else:
                    await self.dispatcher.publish(
                        self.dispatcher.subjects.gen_route(model), request.encode(), out
                    )
            except BaseException:
                self.dispatcher.close(reply)
                raise
            admitted = True
            return call
        except BaseException as exc:
            if not admitted:
                if admission is not None:
                    admission.record(model, exc)
                if isinstance(exc, InferbusError):
                    GEN_REQUESTS.labels(model, exc.code.name).inc()
            raise

    async def finish(self, call: GenerationCall, status: str, error: InferbusError | None) -> None:
        """Settle the tenant's tokens and feed the breaker once a call is over.

        A client that went away is not the model's failure: it is recorded as a
        success for the breaker. A call without the worker's final counts (cancelled
        or failed) is settled with the estimate plus the tokens streamed so far.
        """
        admission = self.admission
        if admission is None:
            return
        admission.record(call.model, error)
        if admission.tokens is not None and call.estimate:
            actual = call.prompt_tokens + call.completion_tokens
            if status != "OK" and not call.prompt_tokens:
                actual = call.estimate + call.completion_tokens
            try:
                await admission.tokens.settle(call.tenant, call.estimate, actual)
            except Exception as exc:  # settling must never fail an answered request
                log.warning("TPM settle failed: %s", exc)
