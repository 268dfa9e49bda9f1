"""Entry point: ``python -m inferbus_gateway``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

import grpc
import nats.errors
from nats.aio.client import Client
from prometheus_client import REGISTRY
from prometheus_client.registry import Collector
from starlette.routing import Route

from inferbus_common import __version__, lifecycle, ops
from inferbus_common.audittrail import ensure_audit_stream
from inferbus_common.bus import connect, shutdown
from inferbus_common.catalog import Catalog
from inferbus_common.grpcauth import read_secret
from inferbus_common.registrychannel import message_size_options
from inferbus_common.subjects import Subjects
from inferbus_gateway import metricsgroup
from inferbus_gateway.admission import Admission
from inferbus_gateway.dispatch.dispatcher import Dispatcher
from inferbus_gateway.dispatch.idempotency import IdempotencyCache
from inferbus_gateway.dispatch.lazyload import LazyLoader
from inferbus_gateway.dispatch.noworker import WorkerWatch
from inferbus_gateway.generation import GenerationDispatcher, GenerationService
from inferbus_gateway.grpc_api.edge import EdgeListener
from inferbus_gateway.grpc_api.servicer import GRPCInferenceServicer
from inferbus_gateway.grpc_api.tolerant import add_servicer_to_server
from inferbus_gateway.observation.auditbatch import AuditBatches
from inferbus_gateway.observation.capture import PayloadCapture
from inferbus_gateway.observation.drift import DriftMonitor
from inferbus_gateway.observation.slo import ModelSloCollector
from inferbus_gateway.pipeline import (
    Admit,
    AuditTrail,
    Dispatch,
    Fallback,
    Idempotency,
    InferHandler,
    Observers,
    Outcomes,
    Readiness,
    Recorder,
    RequestMetrics,
    SharedMemory,
    Step,
)
from inferbus_gateway.pipeline.steps import Observer
from inferbus_gateway.rest.app import rest_app
from inferbus_gateway.service import InferenceService
from inferbus_gateway.settings import GatewaySettings
from inferbus_gateway.triton.classification import Classifier
from inferbus_gateway.triton.repository import RepositoryExtension
from inferbus_gateway.triton.sequences import SequenceRouter
from inferbus_gateway.triton.sharedmemory import SystemSharedMemory
from inferbus_gateway.triton.tracelog import LogSettings, TraceSettings

log = logging.getLogger("inferbus_gateway")


def _execution_slots(catalog: Catalog) -> Callable[[str, str], int]:
    """A version's execution slots as the catalog knows them now: its ready workers
    times its ``instance_count`` (the batches each worker runs at once)."""

    def slots(model: str, version: str) -> int:
        dv = catalog.versions.get((model, version))
        per_worker = dv.config.instance_count if dv is not None else 1
        return len(catalog.ready_workers(model, version)) * per_worker

    return slots


def _register(collector: Collector) -> Collector:
    """Add a collector to the default registry (served on /metrics) and return it."""
    REGISTRY.register(collector)
    return collector


async def serve(settings: GatewaySettings, stop: asyncio.Event) -> None:
    """Run the gateway until SIGTERM/SIGINT, then drain in-flight requests."""
    instance = settings.instance_id or lifecycle.default_instance_id("gateway")
    subjects = Subjects(settings.subject_prefix)
    nc = await connect(settings.nats_url, instance, **settings.nats_auth())
    try:
        async with (
            contextlib.AsyncExitStack() as stack,
            Catalog(nc.jetstream(), subjects) as catalog,
            Admission.from_settings(settings, instance) as admission,
            PayloadCapture(
                nc,
                subjects,
                rate=settings.capture_rate,
                models=settings.capture_models,
                max_bytes=settings.capture_max_bytes,
            ) as capture,
            DriftMonitor(
                nc,
                catalog,
                subjects,
                rate=settings.drift_sample_rate,
                window_rows=settings.drift_window_rows,
                min_rows=settings.drift_min_rows,
                interval_s=settings.drift_interval_s,
            ) as drift,
        ):
            await _ensure_audit_stream(nc, subjects, settings)
            stack.callback(REGISTRY.unregister, _register(ModelSloCollector(catalog)))
            lazy = LazyLoader(nc, catalog, subjects, max_wait_s=settings.lazy_load_max_wait_s)
            shared_memory = SystemSharedMemory(
                enabled=settings.system_shared_memory,
                max_regions=settings.shared_memory_max_regions,
            )
            stack.callback(shared_memory.close)
            dispatcher = Dispatcher(
                nc,
                subjects,
                instance,
                direct=settings.direct_dispatch,
                bundle_window_s=settings.bundle_window_us / 1e6,
                bundle_max_requests=settings.bundle_max_requests,
                bundle_busy_cpu=settings.bundle_busy_cpu,
                bundle_per_slot=settings.bundle_per_slot,
                bundle_deep_per_slot=settings.bundle_deep_per_slot,
                bundle_release_on_reply=settings.bundle_release_on_reply,
                bundle_hold_by=settings.bundle_hold_by,
                fast_lane=settings.fast_lane,
                fast_lane_retry_s=settings.fast_lane_retry_s,
                fast_lane_max_in_flight=settings.fast_lane_max_in_flight,
                fast_lane_per_slot=settings.fast_lane_per_slot,
                slots=_execution_slots(catalog),
            )
            await dispatcher.start()
            await stack.enter_async_context(
                WorkerWatch(
                    nc,
                    catalog,
                    dispatcher.fail_pending,
                    interval_s=settings.worker_probe_interval_s,
                    grace_s=settings.no_worker_grace_s,
                )
            )
            gen_dispatcher = GenerationDispatcher(
                nc,
                subjects,
                instance,
                chunk_frames=settings.generation_chunk_frames,
                catalog=catalog,
            )
            await gen_dispatcher.start()
            generation = GenerationService(
                catalog,
                gen_dispatcher,
                admission=admission,
                default_timeout_s=settings.generation_max_timeout_s,
                access_log=settings.access_log,
                direct=settings.direct_dispatch,
            )
            handler = InferHandler(
                catalog,
                Dispatch(catalog, dispatcher, SequenceRouter(nc, catalog, subjects)),
                default_timeout_s=settings.default_timeout_s,
                readiness=Readiness(catalog, lazy, no_worker_grace_s=settings.no_worker_grace_s),
            )
            service = InferenceService(
                nc,
                catalog,
                handler,
                server_name=settings.server_name,
                version=__version__,
                stack_id=settings.stack_id,
                steps=build_pipeline(
                    settings,
                    handler,
                    nc=nc,
                    subjects=subjects,
                    instance=instance,
                    admission=admission,
                    observers=[o.observe for o in (capture, drift) if o.enabled],
                    shared_memory=shared_memory,
                ),
                admission=admission,
                shared_memory=shared_memory,
                trace=TraceSettings.from_process(),
                log_settings=LogSettings("gateway", settings.log_level, settings.log_format),
                settings_tenants=settings.settings_tenants,
            )
            await catalog.wait_loaded()
            service.catalog_loaded = True
            repository = RepositoryExtension(
                catalog,
                settings.registry_url,
                service.authorize,
                load_timeout_s=settings.repository_load_timeout_s,
                lazy=lazy,
                registry_token=read_secret(None, settings.registry_token_file),
            )

            shared = settings.port_group != "off"
            if settings.port_group == "first":
                ops.check_port_free(settings.host, settings.grpc_port, "gateway gRPC")
                ops.check_port_free(settings.host, settings.http_port, "gateway HTTP")
            server = grpc.aio.server(
                options=[
                    *message_size_options(settings.max_message_bytes),
                    # Off unless the ports are shared by a group of gateway processes:
                    # a second stack on the same port must fail, not silently share it.
                    ("grpc.so_reuseport", int(shared)),
                ]
            )
            classifier = Classifier(catalog, repository.read_file)
            servicer = GRPCInferenceServicer(
                service,
                access_log=settings.access_log,
                repository=repository,
                classifier=classifier,
                generation=generation,
                stream_max_in_flight=settings.stream_max_in_flight,
            )
            add_servicer_to_server(servicer, server)
            edge = EdgeListener(
                nc,
                subjects.edge_grpc(),
                servicer,
                max_in_flight=settings.edge_max_in_flight,
                reply_frames=settings.edge_reply_frames,
            )
            grpc_addr = f"{settings.host}:{settings.grpc_port}"
            credentials = _grpc_tls(settings)
            if credentials is None:
                grpc_port = server.add_insecure_port(grpc_addr)
            else:
                grpc_port = server.add_secure_port(grpc_addr, credentials)
            await server.start()
            if settings.edge_calls:
                await edge.start()
            http_sock = ops.bind_socket(settings.host, settings.http_port, reuse_port=shared)
            metrics_sock = ops.bind_socket(settings.host, settings.metrics_port)
            try:
                async with (
                    ops.serve_http(
                        rest_app(
                            service,
                            settings.max_message_bytes,
                            access_log=settings.access_log,
                            repository=repository,
                            generation=generation,
                            classifier=classifier,
                        ),
                        http_sock,
                        tls_cert_file=settings.tls_cert_file,
                        tls_key_file=settings.tls_key_file,
                        tls_client_ca_file=settings.tls_client_ca_file,
                        streams=True,
                    ) as http_server,
                    ops.serve_http(
                        ops.ops_app(service.ready, _group_routes(settings)), metrics_sock
                    ),
                ):
                    ports = {
                        "http": http_sock.getsockname()[1],
                        "grpc": grpc_port,
                        "metrics": metrics_sock.getsockname()[1],
                    }
                    ops.write_ports_file(settings.ports_file, ports)
                    log.info("gateway serving %s", ports)
                    await stop.wait()
                    log.info("gateway draining", extra={"status": "draining"})
                    http_server.should_exit = True
                    await asyncio.gather(
                        edge.stop(settings.drain_timeout_s),
                        server.stop(settings.drain_timeout_s),
                    )
            finally:
                await service.close()
                await dispatcher.stop()
                await gen_dispatcher.stop()
                await repository.close()
    finally:
        await shutdown(nc, settings.drain_timeout_s)


def build_pipeline(
    settings: GatewaySettings,
    handler: InferHandler,
    *,
    nc: Client,
    subjects: Subjects,
    instance: str,
    admission: Admission | None,
    observers: Sequence[Observer],
    shared_memory: SystemSharedMemory | None,
) -> list[Step]:
    """The steps around `handler`, in the order a ModelInfer meets them.

    Audit and metrics (`Outcomes`) are outermost, so they see every outcome, fallback
    answers included; observers see only the model's own answers; the fallback
    covers admission's refusals for load and the model's failures; admission
    comes before any work (shared memory, idempotency) is spent on a request;
    idempotency is innermost, so a replayed answer is still admitted, counted
    and audited. Steps a setting turns off are left out.

    Args:
        settings: the gateway's settings (audit, idempotency window).
        handler: answers requests with their model (also the backup model's).
        nc: connected NATS client (audit records).
        subjects: subject names (audit records).
        instance: this gateway's id (audit records).
        admission: admission control (None: admit all).
        observers: see each request its model answered (payload capture, drift).
        shared_memory: the system shared-memory regions (None: refused).
    """
    recorders: list[Recorder] = []
    if settings.audit_enabled:
        batches = AuditBatches(nc, subjects, max_delay_s=settings.audit_batch_ms / 1000.0)
        recorders.append(AuditTrail(batches, instance))
    recorders.append(RequestMetrics())
    steps: list[Step] = [Outcomes(recorders)]
    if observers:
        steps.append(Observers(observers))
    steps.append(Fallback(handler))
    if admission is not None:
        steps.append(Admit(admission))
    steps.append(SharedMemory(shared_memory))
    if settings.idempotency_window_s > 0:
        steps.append(Idempotency(IdempotencyCache(settings.idempotency_window_s)))
    return steps


async def _ensure_audit_stream(nc: Client, subjects: Subjects, settings: GatewaySettings) -> None:
    """Create the audit stream (or update its limits) before serving; a failure only warns.

    Records and captures are plain publishes, so without the stream they are
    simply not kept: the gateway serves either way.
    """
    if not (settings.audit_enabled or settings.capture_rate > 0):
        return
    try:
        async with asyncio.timeout(5.0):
            await ensure_audit_stream(
                nc.jetstream(),
                subjects,
                max_age_s=settings.audit_stream_max_age_s,
                max_bytes=settings.audit_stream_max_bytes,
                storage=settings.audit_stream_storage,
            )
    except (TimeoutError, nats.errors.Error) as exc:
        log.warning("audit stream %s not ensured: %s", subjects.audit_stream, exc)


def _group_routes(settings: GatewaySettings) -> list[Route]:
    """``/metrics/group`` when this process is one of a group (or a glob is set)."""
    pattern = settings.metrics_group
    if pattern is None and settings.port_group != "off":
        pattern = metricsgroup.default_pattern(settings.ports_file)
    return [] if pattern is None else [metricsgroup.group_route(pattern, settings.host)]


def _grpc_tls(settings: GatewaySettings) -> grpc.ServerCredentials | None:
    """Server TLS credentials from the settings (None: serve plaintext)."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    ca = settings.tls_client_ca_file.read_bytes() if settings.tls_client_ca_file else None
    return grpc.ssl_server_credentials(
        [(settings.tls_key_file.read_bytes(), settings.tls_cert_file.read_bytes())],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def main() -> None:
    """Run the gateway process (settings, logging, tracing, event loop)."""
    lifecycle.service_main("gateway", GatewaySettings, serve)


if __name__ == "__main__":
    main()
