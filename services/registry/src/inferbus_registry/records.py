"""What the repository returns: stored versions, model states, push results."""

from __future__ import annotations

from dataclasses import dataclass, field

from inferbus_common.catalog import DeployedVersion
from inferbus_common.modelconfig import ModelConfig


@dataclass(frozen=True, slots=True)
class FileInfo:
    """One file of a version as recorded in its manifest."""

    sha256: str
    size: int


@dataclass(frozen=True, slots=True)
class VersionRecord:
    """A stored version: its config, manifest and digest."""

    model: str
    version: str
    config: ModelConfig
    config_json: bytes
    manifest_json: bytes
    digest: str
    """SHA-256 (hex) of `manifest_json`."""
    files: dict[str, FileInfo]
    created_unix_ms: int
    signature: str = ""
    """Base64 Ed25519 signature of the files' digests (empty: unsigned)."""
    key_id: str = ""
    profile_json: bytes = b""
    """The version's drift reference (``profile.json``) when it has one, else empty."""
    number: int = 0
    """Triton-style number (`numbering`; 0: none recorded and not an integer version)."""

    def deployed(self) -> DeployedVersion:
        """The catalog record published in the models KV bucket."""
        return DeployedVersion(
            model=self.model,
            version=self.version,
            config=self.config,
            digest=self.digest,
            files={path: info.sha256 for path, info in self.files.items()},
            created_unix_ms=self.created_unix_ms,
            signature=self.signature,
            key_id=self.key_id,
            number=self.number,
        )


@dataclass(slots=True)
class ModelState:
    """A model's versions (ascending) and aliases."""

    name: str
    versions: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    archived: list[str] = field(default_factory=list)
    """Versions kept in the store but out of serving (subset of `versions`)."""
    unloaded: bool = False
    """The model was taken out of serving: it has no route until loaded again."""

    def active_versions(self) -> list[str]:
        """Versions that may be aliased and routed (not archived), ascending."""
        archived = set(self.archived)
        return [v for v in self.versions if v not in archived]


@dataclass(frozen=True, slots=True)
class PushResult:
    """What a push did."""

    record: VersionRecord
    state: ModelState
    created: bool
    """False when the version already existed with the same content (a retry)."""
    bytes_stored: int
