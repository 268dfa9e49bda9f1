"""Where and how a version is stored: key layout, config.json and manifest.json.

Layout (see docs/architecture.md)::

    models/<name>/<version>/<file>          # model.onnx, or any artifact files
    models/<name>/<version>/config.json     # the version's ModelConfig
    models/<name>/<version>/manifest.json   # sha256 + size of every file, signature
    models/<name>/aliases.json              # {"model": ..., "aliases": {alias: version}}
    models/<name>/numbers.json              # {"highest": n}: version numbers (`numbering`)

A version exists once its `manifest.json` exists (`inferbus_registry.push`).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from inferbus_common.errors import InvalidArgument
from inferbus_common.modelconfig import ModelConfig
from inferbus_registry import numbering
from inferbus_registry.records import FileInfo

ROOT = "models"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"
ALIASES_FILE = "aliases.json"
ARCHIVED_FILE = "archived.json"
"""Marker in a version's folder: the version is archived (kept, never served)."""
UNLOADED_FILE = "unloaded.json"
"""Marker in a model's folder: the model is out of serving (its route is withdrawn)."""


def version_prefix(model: str, version: str) -> str:
    """Key prefix of a version's files."""
    return f"{ROOT}/{model}/{version}"


def parse_config(config_json: bytes, model: str) -> ModelConfig:
    """Parse a version's config.json, filling its `name` from the push.

    Raises:
        InvalidArgument: when the JSON is malformed, does not fit the schema, or
            names another model.
    """
    if not config_json.strip():
        raise InvalidArgument(f"{model}: config.json is missing from the push header")
    try:
        raw = json.loads(config_json)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{model}: config.json is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{model}: config.json must be a JSON object")
    try:
        config = ModelConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}"
            for err in exc.errors(include_url=False)
        )
        raise InvalidArgument(f"{model}: config.json is invalid: {problems}") from exc
    if not config.name:
        config = config.model_copy(update={"name": model})
    elif config.name != model:
        raise InvalidArgument(
            f"config.json names model {config.name!r} but the push is for {model!r}"
        )
    return config


def canonical_config_json(config: ModelConfig) -> bytes:
    """The exact bytes stored as config.json (stable, so retries hash the same)."""
    return (json.dumps(config.model_dump(mode="json"), indent=2, sort_keys=True) + "\n").encode()


def build_manifest(
    model: str,
    version: str,
    files: dict[str, FileInfo],
    created_unix_ms: int,
    signature: dict[str, str] | None = None,
    number: int = 0,
    conversion: dict[str, Any] | None = None,
) -> bytes:
    """manifest.json bytes; `signature` is null when the registry has no signing key;
    `number` is the version's Triton-style number (`numbering`), left out when 0;
    `conversion` is what converting a pushed pickle found (`sklearnconvert`), left
    out for a version pushed as ONNX."""
    doc: dict[str, Any] = {
        "model": model,
        "version": version,
        "files": {
            path: {"sha256": info.sha256, "size": info.size} for path, info in sorted(files.items())
        },
        "created_unix_ms": created_unix_ms,
        "signature": signature,
    }
    if number:
        doc[numbering.MANIFEST_KEY] = number
    if conversion is not None:
        doc["conversion"] = conversion
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
