"""Secrets given either as a value or as a file (e.g. a mounted Kubernetes secret).

Kept apart from `inferbus_common.grpcauth` (which re-exports `read_secret`) so
that settings can use it without importing gRPC into services that never use it
(the router and the batcher).
"""

from __future__ import annotations

from pathlib import Path


def read_secret(value: str | None, file: Path | None) -> str | None:
    """A secret from its file (preferred) or its value; None when neither is set.

    The file's content is stripped of surrounding white space (a trailing newline).
    An empty file or value gives None.

    Raises:
        OSError: the file cannot be read.
    """
    if file is not None:
        return file.read_text().strip() or None
    return value or None
