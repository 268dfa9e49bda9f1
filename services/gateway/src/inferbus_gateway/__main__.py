"""Entry point: ``python -m inferbus_gateway``."""

from __future__ import annotations

import logging

import grpc

from inferbus_common import __version__, lifecycle, ops
from inferbus_common.bus import connect, shutdown
from inferbus_common.catalog import Catalog
from inferbus_common.logs import setup_logging
from inferbus_common.subjects import Subjects
from inferbus_gateway.admission import Admission
from inferbus_gateway.dispatch import Dispatcher
from inferbus_gateway.grpc_api.servicer import GRPCInferenceServicer
from inferbus_gateway.rest.app import rest_app
from inferbus_gateway.service import InferenceService
from inferbus_gateway.settings import GatewaySettings
from inferbus_proto.v2 import grpc_predict_v2_pb2_grpc as pb_grpc

log = logging.getLogger("inferbus_gateway")


async def serve(settings: GatewaySettings) -> None:
    """Run the gateway until SIGTERM/SIGINT, then drain in-flight requests."""
    stop = lifecycle.stop_event_on_signals()
    instance = settings.instance_id or lifecycle.default_instance_id("gateway")
    subjects = Subjects(settings.subject_prefix)
    nc = await connect(settings.nats_url, instance)
    try:
        async with (
            Catalog(nc.jetstream(), subjects) as catalog,
            Admission.from_settings(settings, instance) as admission,
        ):
            dispatcher = Dispatcher(nc, subjects, instance)
            await dispatcher.start()
            service = InferenceService(
                nc,
                catalog,
                dispatcher,
                server_name=settings.server_name,
                version=__version__,
                default_timeout_s=settings.default_timeout_s,
                idempotency_window_s=settings.idempotency_window_s,
                admission=admission,
                audit_subjects=subjects if settings.audit_enabled else None,
                instance=instance,
            )
            await catalog.wait_loaded()
            service.catalog_loaded = True

            server = grpc.aio.server(
                options=[
                    ("grpc.max_receive_message_length", settings.max_message_bytes),
                    ("grpc.max_send_message_length", settings.max_message_bytes),
                    ("grpc.so_reuseport", 0),
                ]
            )
            pb_grpc.add_GRPCInferenceServiceServicer_to_server(
                GRPCInferenceServicer(service), server
            )
            grpc_port = server.add_insecure_port(f"{settings.host}:{settings.grpc_port}")
            await server.start()
            http_sock = ops.bind_socket(settings.host, settings.http_port)
            metrics_sock = ops.bind_socket(settings.host, settings.metrics_port)
            try:
                async with (
                    ops.serve_http(
                        rest_app(service, settings.max_message_bytes), http_sock
                    ) as http_server,
                    ops.serve_http(ops.ops_app(service.ready), metrics_sock),
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
                    await server.stop(settings.drain_timeout_s)
            finally:
                await dispatcher.stop()
    finally:
        await shutdown(nc, settings.drain_timeout_s)


def main() -> None:
    """Build settings once, set up logging and run the gateway."""
    settings = GatewaySettings()
    setup_logging("gateway", settings.log_level, settings.log_format)
    lifecycle.run(lambda: serve(settings), use_uvloop=settings.use_uvloop)


if __name__ == "__main__":
    main()
