"""Reaching the stack's NATS from the CLI (audit stream, drift bucket)."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import nats
import nats.aio.client

from inferbus_cli.state import load_state, resolve_home
from inferbus_common import security
from inferbus_common.bus import server_urls
from inferbus_common.grpcauth import read_secret

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def default_nats_url(home: Path) -> str:
    """NATS URL of the running stack (state.json), else ``nats://127.0.0.1:4222``."""
    try:
        state = load_state(home)
    except ValueError:
        return DEFAULT_NATS_URL
    if state is None:
        return DEFAULT_NATS_URL
    url = state.endpoints.get("nats", DEFAULT_NATS_URL)
    return ",".join(u if "://" in u else f"nats://{u}" for u in url.split(","))


def nats_options(p: argparse.ArgumentParser) -> None:
    """``--nats`` and ``--prefix``, shared by the commands that read the bus."""
    p.add_argument("--nats", help="NATS URL (default: the stack's, from state.json)")
    p.add_argument("--prefix", default="ib", help="subject prefix of the deployment (ib)")


def nats_url(args: argparse.Namespace) -> str:
    """The NATS URL a command should use."""
    return args.nats or default_nats_url(resolve_home(args.home))


def parse_duration(text: str) -> float:
    """Seconds in ``90``, ``90s``, ``15m``, ``1h``, ``2d`` or ``250ms``.

    Raises:
        argparse.ArgumentTypeError: not a positive duration.
    """
    match = _DURATION.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration; use e.g. 90s, 15m, 1h or 2d")
    return float(match.group(1)) * _UNIT_S[match.group(2) or "s"]


async def connect_nats(url: str) -> nats.aio.client.Client:
    """Connect the CLI to NATS, as the ``admin`` user when the bus requires one.

    Credentials come from the environment, never the command line:
    ``INFERBUS_NATS_USER`` with ``INFERBUS_NATS_PASSWORD_FILE`` (or
    ``INFERBUS_NATS_PASSWORD``), or ``INFERBUS_NATS_CREDS_FILE`` (NKEY/JWT).
    """
    options: dict[str, object] = {}
    user = os.environ.get("INFERBUS_NATS_USER", "")
    if user:
        password_file = os.environ.get("INFERBUS_NATS_PASSWORD_FILE")
        password = read_secret(
            os.environ.get("INFERBUS_NATS_PASSWORD", ""),
            Path(password_file) if password_file else None,
        )
        options.update(user=user, password=password or "", inbox_prefix=security.inbox_prefix(user))
    creds = os.environ.get("INFERBUS_NATS_CREDS_FILE")
    if creds:
        options["user_credentials"] = creds
    # A cluster's nodes come comma-separated (state.json, --nats).
    return await nats.connect(
        server_urls(url), connect_timeout=5.0, max_reconnect_attempts=2, **options
    )
