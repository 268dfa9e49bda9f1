"""Version numbers for Triton's tools, as the registry keeps them.

Every version gets a Triton-style integer number at push
(`inferbus_common.versionnumbers.next_number`), written into its
``manifest.json`` (``"number"``), so it is immutable with the version and
survives a registry restart. A manifest from before numbering has none; such
a version counts as the integer it is, if it is one
(`inferbus_common.versionnumbers.number_of`).
"""

from __future__ import annotations

import json

from inferbus_common.errors import NotFound
from inferbus_common.versionnumbers import number_of
from inferbus_registry.store import Store

MANIFEST_KEY = "number"
"""The manifest field that holds the version's number."""

HIGHEST_FILE = "numbers.json"
"""In a model's folder: the highest number it ever gave (``{"highest": n}``),
kept when versions are deleted so that their numbers never come back."""


def manifest_number(manifest: dict[str, object], version: str) -> int:
    """The number a parsed manifest records for `version` (see `number_of`)."""
    raw = manifest.get(MANIFEST_KEY)
    return number_of(version, raw if isinstance(raw, int) and not isinstance(raw, bool) else 0)


async def version_numbers(store: Store, prefix: str, versions: list[str]) -> dict[str, int]:
    """Version → number for `versions`, read from their manifests under `prefix`
    (``models/<name>``); a version whose manifest vanished meanwhile is left out."""
    numbers: dict[str, int] = {}
    for version in versions:
        try:
            manifest = json.loads(await store.read_bytes(f"{prefix}/{version}/manifest.json"))
        except NotFound:
            continue
        numbers[version] = manifest_number(manifest, version)
    return numbers


async def highest_number(store: Store, prefix: str) -> int:
    """The highest number the model under `prefix` ever gave (0: none recorded)."""
    try:
        doc = await store.read_json(f"{prefix}/{HIGHEST_FILE}")
    except NotFound:
        return 0
    value = doc.get("highest") if isinstance(doc, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


async def record_highest(store: Store, prefix: str, number: int) -> None:
    """Remember `number` as the highest the model under `prefix` gave."""
    await store.write_bytes(f"{prefix}/{HIGHEST_FILE}", json.dumps({"highest": number}).encode())
