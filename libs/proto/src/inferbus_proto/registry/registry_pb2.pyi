from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PushHeader(_message.Message):
    __slots__ = ("model", "version", "config_json", "aliases")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    config_json: bytes
    aliases: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., config_json: _Optional[bytes] = ..., aliases: _Optional[_Iterable[str]] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("path", "data")
    PATH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    path: str
    data: bytes
    def __init__(self, path: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: FileChunk
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[FileChunk, _Mapping]] = ...) -> None: ...

class FileEntry(_message.Message):
    __slots__ = ("path", "size", "sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    sha256: str
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class VersionInfo(_message.Message):
    __slots__ = ("model", "version", "config_json", "manifest_json", "digest", "aliases", "files", "created_unix_ms", "archived")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ARCHIVED_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    config_json: bytes
    manifest_json: bytes
    digest: str
    aliases: _containers.RepeatedScalarFieldContainer[str]
    files: _containers.RepeatedCompositeFieldContainer[FileEntry]
    created_unix_ms: int
    archived: bool
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., config_json: _Optional[bytes] = ..., manifest_json: _Optional[bytes] = ..., digest: _Optional[str] = ..., aliases: _Optional[_Iterable[str]] = ..., files: _Optional[_Iterable[_Union[FileEntry, _Mapping]]] = ..., created_unix_ms: _Optional[int] = ..., archived: _Optional[bool] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "versions", "aliases", "archived", "unloaded", "numbers")
    class AliasesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class NumbersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    ARCHIVED_FIELD_NUMBER: _ClassVar[int]
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    NUMBERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    versions: _containers.RepeatedScalarFieldContainer[str]
    aliases: _containers.ScalarMap[str, str]
    archived: _containers.RepeatedScalarFieldContainer[str]
    unloaded: bool
    numbers: _containers.ScalarMap[str, int]
    def __init__(self, name: _Optional[str] = ..., versions: _Optional[_Iterable[str]] = ..., aliases: _Optional[_Mapping[str, str]] = ..., archived: _Optional[_Iterable[str]] = ..., unloaded: _Optional[bool] = ..., numbers: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class GetVersionRequest(_message.Message):
    __slots__ = ("model", "version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class SetAliasRequest(_message.Message):
    __slots__ = ("model", "alias", "version", "force")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    model: str
    alias: str
    version: str
    force: bool
    def __init__(self, model: _Optional[str] = ..., alias: _Optional[str] = ..., version: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class DownloadFileRequest(_message.Message):
    __slots__ = ("model", "version", "path")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    path: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class ArchiveVersionRequest(_message.Message):
    __slots__ = ("model", "version", "requested_by")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_BY_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    requested_by: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., requested_by: _Optional[str] = ...) -> None: ...

class DeleteVersionRequest(_message.Message):
    __slots__ = ("model", "version", "requested_by")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_BY_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    requested_by: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., requested_by: _Optional[str] = ...) -> None: ...

class SetServingRequest(_message.Message):
    __slots__ = ("model", "serving", "version", "requested_by")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_BY_FIELD_NUMBER: _ClassVar[int]
    model: str
    serving: bool
    version: str
    requested_by: str
    def __init__(self, model: _Optional[str] = ..., serving: _Optional[bool] = ..., version: _Optional[str] = ..., requested_by: _Optional[str] = ...) -> None: ...

class GetRouteRequest(_message.Message):
    __slots__ = ("model", "history")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    model: str
    history: int
    def __init__(self, model: _Optional[str] = ..., history: _Optional[int] = ...) -> None: ...

class RouteState(_message.Message):
    __slots__ = ("route_json", "kv_revision", "history_json")
    ROUTE_JSON_FIELD_NUMBER: _ClassVar[int]
    KV_REVISION_FIELD_NUMBER: _ClassVar[int]
    HISTORY_JSON_FIELD_NUMBER: _ClassVar[int]
    route_json: bytes
    kv_revision: int
    history_json: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, route_json: _Optional[bytes] = ..., kv_revision: _Optional[int] = ..., history_json: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SetTrafficRequest(_message.Message):
    __slots__ = ("model", "canary", "canary_weight", "shadow", "shadow_rate", "sticky", "pool", "expected_kv_revision", "updated_by", "change", "force")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CANARY_FIELD_NUMBER: _ClassVar[int]
    CANARY_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SHADOW_FIELD_NUMBER: _ClassVar[int]
    SHADOW_RATE_FIELD_NUMBER: _ClassVar[int]
    STICKY_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_KV_REVISION_FIELD_NUMBER: _ClassVar[int]
    UPDATED_BY_FIELD_NUMBER: _ClassVar[int]
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    model: str
    canary: str
    canary_weight: float
    shadow: str
    shadow_rate: float
    sticky: str
    pool: str
    expected_kv_revision: int
    updated_by: str
    change: str
    force: bool
    def __init__(self, model: _Optional[str] = ..., canary: _Optional[str] = ..., canary_weight: _Optional[float] = ..., shadow: _Optional[str] = ..., shadow_rate: _Optional[float] = ..., sticky: _Optional[str] = ..., pool: _Optional[str] = ..., expected_kv_revision: _Optional[int] = ..., updated_by: _Optional[str] = ..., change: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class StartRolloutRequest(_message.Message):
    __slots__ = ("model", "version", "steps", "interval_s", "max_error_rate", "max_p99_ratio", "min_requests", "on_fail", "requested_by", "ready_timeout_s")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_ERROR_RATE_FIELD_NUMBER: _ClassVar[int]
    MAX_P99_RATIO_FIELD_NUMBER: _ClassVar[int]
    MIN_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ON_FAIL_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_BY_FIELD_NUMBER: _ClassVar[int]
    READY_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    steps: _containers.RepeatedScalarFieldContainer[float]
    interval_s: float
    max_error_rate: float
    max_p99_ratio: float
    min_requests: int
    on_fail: str
    requested_by: str
    ready_timeout_s: float
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., steps: _Optional[_Iterable[float]] = ..., interval_s: _Optional[float] = ..., max_error_rate: _Optional[float] = ..., max_p99_ratio: _Optional[float] = ..., min_requests: _Optional[int] = ..., on_fail: _Optional[str] = ..., requested_by: _Optional[str] = ..., ready_timeout_s: _Optional[float] = ...) -> None: ...

class GetRolloutRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ControlRolloutRequest(_message.Message):
    __slots__ = ("model", "action", "requested_by", "reason")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_BY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    model: str
    action: str
    requested_by: str
    reason: str
    def __init__(self, model: _Optional[str] = ..., action: _Optional[str] = ..., requested_by: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RolloutState(_message.Message):
    __slots__ = ("rollout_json",)
    ROLLOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    rollout_json: bytes
    def __init__(self, rollout_json: _Optional[bytes] = ...) -> None: ...

class ListPoolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolWorker(_message.Message):
    __slots__ = ("worker_id", "host", "cpus", "memory_bytes", "gpu_type", "gpu_count", "admitted", "reason", "models")
    class ModelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_TYPE_FIELD_NUMBER: _ClassVar[int]
    GPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    host: str
    cpus: int
    memory_bytes: int
    gpu_type: str
    gpu_count: int
    admitted: bool
    reason: str
    models: _containers.ScalarMap[str, str]
    def __init__(self, worker_id: _Optional[str] = ..., host: _Optional[str] = ..., cpus: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., gpu_type: _Optional[str] = ..., gpu_count: _Optional[int] = ..., admitted: _Optional[bool] = ..., reason: _Optional[str] = ..., models: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("name", "max_workers", "max_gpus", "state", "workers", "total_gpus", "placed", "queue_lag", "updated_by", "updated_unix_ms", "configured")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_GPUS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_GPUS_FIELD_NUMBER: _ClassVar[int]
    PLACED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LAG_FIELD_NUMBER: _ClassVar[int]
    UPDATED_BY_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_workers: int
    max_gpus: int
    state: str
    workers: _containers.RepeatedCompositeFieldContainer[PoolWorker]
    total_gpus: int
    placed: _containers.RepeatedScalarFieldContainer[str]
    queue_lag: int
    updated_by: str
    updated_unix_ms: int
    configured: bool
    def __init__(self, name: _Optional[str] = ..., max_workers: _Optional[int] = ..., max_gpus: _Optional[int] = ..., state: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[PoolWorker, _Mapping]]] = ..., total_gpus: _Optional[int] = ..., placed: _Optional[_Iterable[str]] = ..., queue_lag: _Optional[int] = ..., updated_by: _Optional[str] = ..., updated_unix_ms: _Optional[int] = ..., configured: _Optional[bool] = ...) -> None: ...

class ListPoolsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolInfo]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolInfo, _Mapping]]] = ...) -> None: ...

class SetPoolRequest(_message.Message):
    __slots__ = ("name", "max_workers", "max_gpus", "state", "updated_by")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_GPUS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    UPDATED_BY_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_workers: int
    max_gpus: int
    state: str
    updated_by: str
    def __init__(self, name: _Optional[str] = ..., max_workers: _Optional[int] = ..., max_gpus: _Optional[int] = ..., state: _Optional[str] = ..., updated_by: _Optional[str] = ...) -> None: ...
