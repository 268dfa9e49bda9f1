"""Shared bits of the release commands (``route``, ``rollout``, ``pools``)."""

from __future__ import annotations

import argparse
import getpass
import socket
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from inferbus_cli.rpc import registry_channel, registry_stub, rpc_error_text
from inferbus_cli.state import default_registry_address, expected_stack, resolve_home
from inferbus_proto.registry import registry_pb2_grpc

T = TypeVar("T")


def identity(args: argparse.Namespace) -> str:
    """Who makes a change: ``--by``, else ``user@host`` (recorded in routes and events)."""
    given = getattr(args, "by", None)
    if given:
        return str(given)
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def registry_address(args: argparse.Namespace) -> str:
    """``--registry``, else the local stack's registry from state.json."""
    return args.registry or default_registry_address(resolve_home(args.home))


def call(
    args: argparse.Namespace, what: str, fn: Callable[[registry_pb2_grpc.RegistryStub], T]
) -> T | None:
    """Run one registry call; on failure print ``error: <what>: STATUS: msg`` and give None."""
    address = registry_address(args)
    with registry_channel(address, expected_stack(resolve_home(args.home), address)) as channel:
        try:
            return fn(registry_stub(channel))
        except grpc.RpcError as exc:
            print(f"error: {what}: {rpc_error_text(exc, address)}", file=sys.stderr)
            return None


def when(unix_ms: int) -> str:
    """UTC time of a record, ``-`` when unset."""
    if not unix_ms:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(unix_ms / 1000)) + "Z"
