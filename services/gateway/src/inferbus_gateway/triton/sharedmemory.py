"""Triton's system shared-memory extension: tensors in POSIX shared memory.

A client on the gateway's host creates a POSIX shared-memory object
(``shm_open``, e.g. ``/input_simple``), registers a region of it under a
name (``SystemSharedMemoryRegister`` / ``POST
/v2/systemsharedmemory/region/{name}/register``), and then names the region
in an input's or requested output's parameters (``shared_memory_region``,
``shared_memory_byte_size``, ``shared_memory_offset``) instead of sending
the bytes. The gateway maps the object (``/dev/shm/<key>``), copies an
input's bytes out of it before validation, and writes an output's bytes into
it instead of the answer. The bus, batchers and workers see ordinary
tensors. CUDA shared memory needs the GPU on the gateway's host and is
refused with a message naming the extension (`CUDA_UNSUPPORTED`).

Regions belong to the caller's tenant when authentication is on (a tenant
sees and uses only its own); without it there is one namespace, as in
Triton. Details: docs/architecture.md ("Shared memory").
"""

from __future__ import annotations

import mmap
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from prometheus_client import Counter

from inferbus_common.codec import Tensor, check_raw_size
from inferbus_common.errors import FailedPrecondition, InvalidArgument, NotFound
from inferbus_gateway.canonical import InferRequest, InferResponse, ShmRef

SHM_BYTES = Counter(
    "inferbus_gateway_shared_memory_bytes_total",
    "Tensor bytes read from (input) or written to (output) system shared memory.",
    ["direction"],
)

CUDA_UNSUPPORTED = (
    "CUDA shared memory (Triton's cuda_shared_memory extension) is not supported by "
    "inferbus: the gateway does not run models on a GPU. Use system shared memory "
    "(register_system_shared_memory) or send the tensor in the request"
)

_KEY = re.compile(r"^/?[A-Za-z0-9._+-]{1,250}$")
_PARAMS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")


def shm_ref(params: Mapping[str, object], what: str) -> ShmRef | None:
    """The shared-memory reference in an input's or output's parameters (None: none).

    Args:
        params: the tensor's parameters as plain values.
        what: ``input 'NAME'`` or ``output 'NAME'``, for messages.

    Raises:
        InvalidArgument: a partial or mistyped reference.
    """
    region = params.get("shared_memory_region")
    if region is None:
        if any(k in params for k in _PARAMS[1:]):
            raise InvalidArgument(f"{what}: shared_memory_byte_size needs shared_memory_region")
        return None
    if not isinstance(region, str) or not region:
        raise InvalidArgument(f"{what}: shared_memory_region must be a region name")
    size = params.get("shared_memory_byte_size")
    offset = params.get("shared_memory_offset", 0)
    for key, value in (("shared_memory_byte_size", size), ("shared_memory_offset", offset)):
        if type(value) is not int or value < 0:
            raise InvalidArgument(f"{what}: {key} must be a non-negative integer, got {value!r}")
    assert isinstance(size, int) and isinstance(offset, int)
    return ShmRef(region, size, offset)


@dataclass(slots=True, eq=False)
class _Region:
    name: str
    key: str
    offset: int
    byte_size: int
    owner: str
    map: mmap.mmap


class SystemSharedMemory:
    """The registered regions of this gateway (see the module docstring).

    Args:
        enabled: False refuses every registration (the extension is off).
        root: where POSIX shared-memory objects live (``/dev/shm`` on Linux).
        max_regions: most regions registered at once.
    """

    def __init__(
        self, *, enabled: bool = True, root: Path = Path("/dev/shm"), max_regions: int = 1024
    ) -> None:
        self.enabled = enabled
        self._root = root
        self._max = max_regions
        self._regions: dict[tuple[str, str], _Region] = {}
        self._lock = threading.Lock()

    # --- registration ------------------------------------------------------------
    def register(self, owner: str, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map `byte_size` bytes at `offset` of the object `key` as region `name`.

        Raises:
            FailedPrecondition: the extension is off, or `name` is registered already.
            InvalidArgument: a bad key, or a region outside the object.
            NotFound: no shared-memory object of that key.
        """
        if not self.enabled:
            raise FailedPrecondition(
                "system shared memory is off on this gateway "
                "(INFERBUS_GATEWAY_SYSTEM_SHARED_MEMORY=false)"
            )
        if not name:
            raise InvalidArgument("a shared-memory region needs a name")
        if not _KEY.match(key) or key.strip("/") in (".", ".."):
            raise InvalidArgument(
                f"shared-memory key {key!r} must be a POSIX shm name like '/input_simple' "
                "(letters, digits, '.', '_', '+', '-')"
            )
        if offset < 0 or byte_size <= 0:
            raise InvalidArgument("a region needs offset >= 0 and byte_size > 0")
        with self._lock:
            if (owner, name) in self._regions:
                raise FailedPrecondition(
                    f"shared-memory region '{name}' is already registered; unregister it first"
                )
            if len(self._regions) >= self._max:
                raise FailedPrecondition(
                    f"{self._max} shared-memory regions are registered; unregister some"
                )
        path = self._root / key.lstrip("/")
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise NotFound(
                f"no shared-memory object '{key}' on the gateway's host; create it with "
                "shm_open before registering (client and gateway must share the host)"
            ) from None
        except OSError as exc:
            raise InvalidArgument(f"cannot open shared-memory object '{key}': {exc}") from None
        try:
            size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise InvalidArgument(
                    f"region '{name}' ({byte_size} bytes at offset {offset}) does not fit "
                    f"shared-memory object '{key}' of {size} bytes"
                )
            region_map = mmap.mmap(fd, offset + byte_size)
        finally:
            os.close(fd)
        with self._lock:
            if (owner, name) in self._regions:
                region_map.close()
                raise FailedPrecondition(f"shared-memory region '{name}' is already registered")
            self._regions[(owner, name)] = _Region(name, key, offset, byte_size, owner, region_map)

    def unregister(self, owner: str, name: str = "") -> None:
        """Forget region `name` (every region of `owner` when empty); unknown names are fine."""
        with self._lock:
            keys = [k for k in self._regions if k[0] == owner and (not name or k[1] == name)]
            regions = [self._regions.pop(k) for k in keys]
        for region in regions:
            region.map.close()

    def status(self, owner: str, name: str = "") -> list[dict[str, Any]]:
        """Triton's status of region `name`, or of every region of `owner`.

        Raises:
            NotFound: `name` is not registered.
        """
        with self._lock:
            regions = [
                r
                for (o, n), r in sorted(self._regions.items())
                if o == owner and (not name or n == name)
            ]
        if name and not regions:
            raise NotFound(f"shared-memory region '{name}' is not registered")
        return [
            {"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
            for r in regions
        ]

    def close(self) -> None:
        """Unmap every region."""
        with self._lock:
            regions = list(self._regions.values())
            self._regions.clear()
        for region in regions:
            region.map.close()

    # --- tensors -----------------------------------------------------------------
    def _span(self, owner: str, ref: ShmRef, what: str) -> tuple[_Region, int, int]:
        region = self._regions.get((owner, ref.region))
        if region is None:
            raise InvalidArgument(f"{what}: shared-memory region '{ref.region}' is not registered")
        if ref.offset + ref.byte_size > region.byte_size:
            raise InvalidArgument(
                f"{what}: {ref.byte_size} bytes at offset {ref.offset} do not fit region "
                f"'{ref.region}' of {region.byte_size} bytes"
            )
        start = region.offset + ref.offset
        return region, start, start + ref.byte_size

    def read_inputs(self, request: InferRequest, owner: str) -> None:
        """Fill the inputs of `request` that name a region with a copy of its bytes.

        Raises:
            InvalidArgument: an unknown region, a span outside it, or bytes that
                do not fit the input's shape.
        """
        by_name = {t.name: t for t in request.inputs}
        for name, ref in request.shm_inputs.items():
            tensor: Tensor | None = by_name.get(name)
            if tensor is None:
                continue
            what = f"input '{name}'"
            with self._lock:
                region, start, stop = self._span(owner, ref, what)
                tensor.data = bytes(region.map[start:stop])
            SHM_BYTES.labels("input").inc(ref.byte_size)
            check_raw_size(name, tensor.datatype, tensor.shape, tensor.data)

    def write_outputs(
        self, request: InferRequest, response: InferResponse, owner: str
    ) -> InferResponse:
        """Write the outputs `request` asked into regions there.

        Returns the answer to send: those outputs without their bytes, naming
        their region (`response` itself is left as it is: it may be a cached
        answer replayed to a retry).

        Raises:
            InvalidArgument: an unknown region, or an output larger than its span.
        """
        outputs = []
        placed: dict[str, ShmRef] = {}
        for tensor in response.outputs:
            ref = request.shm_outputs.get(tensor.name)
            if ref is None:
                outputs.append(tensor)
                continue
            what = f"output '{tensor.name}'"
            size = tensor.nbytes
            if size > ref.byte_size:
                raise InvalidArgument(
                    f"{what} is {size} bytes but shared_memory_byte_size is {ref.byte_size}"
                )
            with self._lock:
                region, start, _ = self._span(owner, ref, what)
                region.map[start : start + size] = memoryview(tensor.data).cast("B")
            SHM_BYTES.labels("output").inc(size)
            placed[tensor.name] = ShmRef(ref.region, size, ref.offset)
            outputs.append(Tensor(tensor.name, tensor.datatype, tensor.shape, b""))
        return replace(response, outputs=outputs, shm_outputs=placed)
