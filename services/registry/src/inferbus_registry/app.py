"""The registry process as one async context manager: store, NATS, gRPC and ops HTTP.

Start-up order: store reachable → NATS connected → live catalog view loaded
(worker states, for `promotion`) → catalog republished into KV → ops HTTP →
gRPC listening → ports file written. Shutdown reverses it: /readyz turns 503
and gRPC `stop(grace)` lets in-flight calls finish, then the ops server stops
and NATS is flushed and closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import TracebackType

import grpc
from nats.aio.client import Client

from inferbus_common import bus
from inferbus_common.catalog import Catalog
from inferbus_common.errors import InferbusError, Unavailable
from inferbus_common.grpcauth import TokenGuard, read_secret
from inferbus_common.lifecycle import default_instance_id
from inferbus_common.ops import bind_socket, ops_app, serve_http, write_ports_file
from inferbus_common.registrychannel import message_size_options
from inferbus_common.signing import load_private_key, parse_trusted_keys
from inferbus_common.stackid import StackGuard
from inferbus_common.subjects import Subjects
from inferbus_proto.registry import registry_pb2_grpc
from inferbus_registry.grpcerrors import NATS_ERRORS
from inferbus_registry.pools import PoolBook
from inferbus_registry.promotion import PromotionWatcher
from inferbus_registry.publisher import CatalogPublisher
from inferbus_registry.repository import ModelRepository
from inferbus_registry.rollout import RolloutController
from inferbus_registry.service import RegistryService
from inferbus_registry.settings import RegistrySettings
from inferbus_registry.sklearnconvert import ConversionLimits
from inferbus_registry.store import LocalStore, S3Store, Store

READ_METHODS = frozenset(
    {"ListModels", "GetVersion", "DownloadFile", "GetRoute", "GetRollout", "ListPools"}
)
"""Registry calls a reader token may make (the rest change what is served)."""

_REPUBLISH_ERRORS: tuple[type[Exception], ...] = (*NATS_ERRORS, InferbusError)
"""Why a catalog republish may fail and be retried: the bus, or a bad record."""

log = logging.getLogger(__name__)


def open_store(settings: RegistrySettings) -> Store:
    """The store the settings name (local directory or S3)."""
    if settings.store == "s3":
        return S3Store(
            settings.s3_endpoint,
            settings.s3_access_key,
            read_secret(settings.s3_secret_key, settings.s3_secret_key_file) or "",
            settings.s3_bucket,
            secure=settings.s3_secure,
            region=settings.s3_region,
        )
    return LocalStore(settings.store_dir)


class RegistryApp:
    """A running registry: use ``async with RegistryApp(settings) as app``.

    Args:
        settings: the process settings (built once in `main`).
        store: overrides the store the settings name (tests).

    Attributes:
        grpc_port: the bound gRPC port (after start).
        metrics_port: the bound ops HTTP port (after start).
    """

    def __init__(self, settings: RegistrySettings, *, store: Store | None = None) -> None:
        self.settings = settings
        self.store = store if store is not None else open_store(settings)
        self.repo = ModelRepository(
            self.store,
            spool_dir=settings.spool_dir,
            max_push_bytes=settings.max_push_bytes,
            signing_key=(
                load_private_key(settings.signing_key_file) if settings.signing_key_file else None
            ),
            signing_key_id=settings.signing_key_id,
            trusted_keys=parse_trusted_keys(settings.trusted_keys),
            conversion=ConversionLimits(
                enabled=settings.convert_pickles,
                timeout_s=settings.convert_timeout_s,
                memory_mb=settings.convert_memory_mb,
                tolerance=settings.convert_tolerance,
                concurrency=settings.convert_concurrency,
            ),
        )
        self.subjects = Subjects(settings.subject_prefix)
        self.grpc_port = 0
        self.metrics_port = 0
        self.pools: PoolBook | None = None
        self.rollouts: RolloutController | None = None
        self.promotions: PromotionWatcher | None = None
        self._nc: Client | None = None
        self._server: grpc.aio.Server | None = None
        self._stack = contextlib.AsyncExitStack()
        self._store_ok = False
        self._republished = False
        self._stopping = False
        self._probe: asyncio.Task[None] | None = None
        self._probe_stop = asyncio.Event()

    def _catalog_changed(self) -> None:
        if self.promotions is not None:
            self.promotions.wake()

    def ready(self) -> tuple[bool, str]:
        """(ready, reason) for /readyz."""
        if self._stopping:
            return False, "shutting down"
        if self._server is None:
            return False, "gRPC server not started"
        if self._nc is None or not self._nc.is_connected:
            return False, "nats not connected"
        if not self._store_ok:
            return False, "store unreachable"
        if not self._republished:
            return False, "catalog not republished yet"
        return True, "ok"

    async def _supervise(self, publisher: CatalogPublisher) -> None:
        """Re-check the store, and republish the catalog after a NATS reconnect.

        A reconnect may land on a NATS server that lost its JetStream state
        (a fresh pod, a wiped volume); republishing is idempotent, so it is
        done after every reconnect rather than guessing.
        """
        assert self._nc is not None
        seen_reconnects = self._nc.stats["reconnects"]
        while not self._probe_stop.is_set():
            # An event, not only cancel(): nats-py calls built on asyncio.wait_for
            # can lose a cancellation on Python 3.11, which left this loop running
            # and shutdown waiting for it forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.store_probe_interval_s):
                    await self._probe_stop.wait()
            if self._probe_stop.is_set():
                return
            try:
                await self.store.check()
            except Unavailable as exc:
                if self._store_ok:
                    log.warning("store unreachable: %s", exc)
                self._store_ok = False
            else:
                self._store_ok = True
            reconnects = self._nc.stats["reconnects"]
            if reconnects != seen_reconnects and self._nc.is_connected and self._store_ok:
                self._republished = False
                try:
                    await publisher.republish_all(self.repo)
                except _REPUBLISH_ERRORS as exc:
                    log.warning("republishing the catalog after a reconnect failed: %s", exc)
                    continue  # try again on the next round
                seen_reconnects = reconnects
                self._republished = True

    async def __aenter__(self) -> RegistryApp:
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def _start(self) -> None:
        settings = self.settings
        if settings.spool_dir is not None:
            await asyncio.to_thread(settings.spool_dir.mkdir, parents=True, exist_ok=True)
        await self.store.check()
        self._store_ok = True

        name = settings.instance_id or default_instance_id("registry")
        self._nc = await bus.connect(settings.nats_url, name, **settings.nats_auth())
        self._stack.push_async_callback(self._close_nats)

        # Worker heartbeats and routes, for make-before-break of ``stable`` (promotion.py):
        # loaded before the republish, so a pending promotion is not lost at start-up.
        catalog = Catalog(self._nc.jetstream(), self.subjects, on_change=self._catalog_changed)
        await catalog.__aenter__()
        self._stack.push_async_callback(catalog.__aexit__, None, None, None)
        await catalog.wait_loaded()
        publisher = CatalogPublisher(self._nc, self.subjects, ready=catalog.is_ready)
        await publisher.republish_all(self.repo)
        self.promotions = PromotionWatcher(
            catalog,
            self.repo,
            publisher,
            timeout_s=settings.promotion_timeout_s,
            tick_s=settings.rollout_tick_s,
        )
        self.promotions.start()
        self._stack.push_async_callback(self.promotions.stop)
        self._republished = True

        sock = bind_socket(settings.host, settings.metrics_port)
        self.metrics_port = sock.getsockname()[1]
        await self._stack.enter_async_context(serve_http(ops_app(self.ready), sock))

        guard = TokenGuard(
            admin_token=read_secret(
                settings.admin_token.get_secret_value() if settings.admin_token else None,
                settings.admin_token_file,
            ),
            reader_token=read_secret(
                settings.reader_token.get_secret_value() if settings.reader_token else None,
                settings.reader_token_file,
            ),
            read_methods=READ_METHODS,
        )
        server = grpc.aio.server(
            interceptors=[StackGuard(settings.stack_id, "registry"), guard],
            options=message_size_options(settings.grpc_max_message_bytes),
        )
        self.pools = PoolBook(self._nc, self.subjects)
        self.rollouts = RolloutController(
            self._nc,
            self.subjects,
            self.repo,
            publisher,
            self.pools,
            tick_s=settings.rollout_tick_s,
            instance=name,
        )
        await self.rollouts.start()
        self._stack.push_async_callback(self.rollouts.stop)
        registry_pb2_grpc.add_RegistryServicer_to_server(
            RegistryService(self.repo, publisher, rollouts=self.rollouts, pools=self.pools),
            server,
        )
        self.grpc_port = server.add_insecure_port(f"{settings.host}:{settings.grpc_port}")
        if self.grpc_port == 0:
            raise OSError(f"cannot bind gRPC on {settings.host}:{settings.grpc_port}")
        await server.start()
        self._server = server
        self._stack.push_async_callback(self._stop_grpc)

        self._probe = asyncio.create_task(self._supervise(publisher))
        self._stack.push_async_callback(self._stop_probe)

        ports = {"grpc": self.grpc_port, "metrics": self.metrics_port}
        write_ports_file(settings.ports_file, ports)
        log.info(
            "registry serving gRPC on %s:%d (store: %s)",
            settings.host,
            self.grpc_port,
            settings.store,
            extra={"port": self.grpc_port},
        )

    async def _stop_probe(self) -> None:
        if self._probe is not None:
            self._probe_stop.set()
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                async with asyncio.timeout(max(1.0, self.settings.drain_timeout_s)):
                    await self._probe

    async def _stop_grpc(self) -> None:
        self._stopping = True  # /readyz turns 503 while in-flight calls finish
        if self._server is not None:
            await self._server.stop(self.settings.drain_timeout_s)

    async def _close_nats(self) -> None:
        if self._nc is not None:
            # The registry has no subscriptions: draining is flushing what it published.
            await bus.shutdown(self._nc, max(1.0, self.settings.drain_timeout_s))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stack.aclose()
