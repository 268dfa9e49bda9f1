"""The gRPC channel every client of the registry opens.

The registry's messages can be large (a push or download chunk, a catalog
listing with many versions), so its clients raise gRPC's 4 MiB default on both
directions; and when the registry requires a token, every call carries it
(`inferbus_common.grpcauth`). One function, so the registry client, the
gateway's repository extension and the workers agree on both.

`message_size_options` is the one spelling of gRPC's message-size options: the
registry's and the gateway's servers and the CLI's channels use it too.
"""

from __future__ import annotations

from typing import Any

import grpc

from inferbus_common import grpcauth

REGISTRY_MAX_MESSAGE_BYTES = 64 << 20
"""Largest message a registry client sends or receives."""


def message_size_options(max_bytes: int) -> list[tuple[str, Any]]:
    """gRPC channel/server options that allow messages up to `max_bytes` both ways."""
    return [
        ("grpc.max_receive_message_length", max_bytes),
        ("grpc.max_send_message_length", max_bytes),
    ]


def registry_channel(
    target: str, token: str | None, *, max_message_bytes: int = REGISTRY_MAX_MESSAGE_BYTES
) -> grpc.aio.Channel:
    """An asyncio channel to the registry at `target` (``host:port``).

    Args:
        target: the registry's gRPC address.
        token: the registry's admin or reader token (None: none is sent).
        max_message_bytes: largest message either way.
    """
    return grpcauth.aio_channel(target, token, options=message_size_options(max_message_bytes))
