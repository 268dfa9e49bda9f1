"""Triton's system shared memory: regions of POSIX shared-memory objects, per tenant."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from inferbus_common.codec import Tensor, serialize_bytes, tensor_from_numpy
from inferbus_common.errors import FailedPrecondition, InvalidArgument, NotFound
from inferbus_gateway.canonical import InferRequest, InferResponse, ShmRef
from inferbus_gateway.triton.sharedmemory import SystemSharedMemory, shm_ref


def _object(root: Path, key: str, size: int) -> Path:
    path = root / key.lstrip("/")
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def test_inputs_are_read_and_outputs_written_through_a_region(tmp_path: Path) -> None:
    path = _object(tmp_path, "/io", 256)
    data = np.arange(16, dtype=np.int32)
    with open(path, "r+b") as f:
        f.seek(64 + 8)
        f.write(data.tobytes())
    shm = SystemSharedMemory(root=tmp_path)
    shm.register("acme", "io", "/io", 64, 192)
    assert shm.status("acme") == [{"name": "io", "key": "/io", "offset": 64, "byte_size": 192}]
    request = InferRequest(
        model="m",
        version="",
        id="",
        inputs=[Tensor("X", "INT32", (1, 16), b"")],
        shm_inputs={"X": ShmRef("io", 64, 8)},
        shm_outputs={"Y": ShmRef("io", 80, 100)},
    )
    shm.read_inputs(request, "acme")
    assert np.array_equal(request.inputs[0].as_numpy().reshape(-1), data)
    words = np.array([b"one", b"two"], dtype=object)
    response = InferResponse(model="m", version="1", id="", outputs=[tensor_from_numpy("Y", words)])
    sent = shm.write_outputs(request, response, "acme")
    assert sent.outputs[0].data == b"" and sent.outputs[0].shape == (2,)
    assert sent.shm_outputs["Y"] == ShmRef("io", len(serialize_bytes(words)), 100)
    assert response.outputs[0].nbytes > 0 and not response.shm_outputs  # left as it was
    written = path.read_bytes()[64 + 100 : 64 + 100 + len(serialize_bytes(words))]
    assert written == serialize_bytes(words)
    shm.unregister("acme")
    assert shm.status("acme") == []


def test_regions_belong_to_their_tenant(tmp_path: Path) -> None:
    _object(tmp_path, "k", 16)
    shm = SystemSharedMemory(root=tmp_path)
    shm.register("acme", "r", "/k", 0, 16)
    assert shm.status("other") == []
    with pytest.raises(NotFound, match="not registered"):
        shm.status("other", "r")
    request = InferRequest(
        model="m",
        version="",
        id="",
        inputs=[Tensor("X", "INT32", (4,), b"")],
        shm_inputs={"X": ShmRef("r", 16)},
    )
    with pytest.raises(InvalidArgument, match="not registered"):
        shm.read_inputs(request, "other")
    shm.unregister("other")  # nothing of another tenant's goes
    assert len(shm.status("acme")) == 1
    shm.close()


@pytest.mark.parametrize(
    ("key", "offset", "size", "error", "message"),
    [
        ("/missing", 0, 8, NotFound, "no shared-memory object"),
        ("/../etc/passwd", 0, 8, InvalidArgument, "POSIX shm name"),
        ("/..", 0, 8, InvalidArgument, "POSIX shm name"),
        ("/a/b", 0, 8, InvalidArgument, "POSIX shm name"),
        ("/k", 8, 16, InvalidArgument, "does not fit"),
        ("/k", 0, 0, InvalidArgument, "byte_size > 0"),
    ],
)
def test_bad_registrations_are_refused(
    tmp_path: Path, key: str, offset: int, size: int, error: type, message: str
) -> None:
    _object(tmp_path, "k", 16)
    with pytest.raises(error, match=message):
        SystemSharedMemory(root=tmp_path).register("", "r", key, offset, size)


def test_duplicates_limits_and_the_off_switch(tmp_path: Path) -> None:
    _object(tmp_path, "k", 16)
    shm = SystemSharedMemory(root=tmp_path, max_regions=1)
    shm.register("", "r", "/k", 0, 16)
    with pytest.raises(FailedPrecondition, match="already registered"):
        shm.register("", "r", "/k", 0, 16)
    with pytest.raises(FailedPrecondition, match="regions are registered"):
        shm.register("", "r2", "/k", 0, 16)
    with pytest.raises(FailedPrecondition, match="SYSTEM_SHARED_MEMORY=false"):
        SystemSharedMemory(root=tmp_path, enabled=False).register("", "r", "/k", 0, 16)
    shm.close()


def test_spans_outside_the_region_and_too_small_outputs_are_refused(tmp_path: Path) -> None:
    _object(tmp_path, "k", 32)
    shm = SystemSharedMemory(root=tmp_path)
    shm.register("", "r", "/k", 0, 32)
    request = InferRequest(
        model="m",
        version="",
        id="",
        inputs=[Tensor("X", "INT32", (4,), b"")],
        shm_inputs={"X": ShmRef("r", 16, 24)},
        shm_outputs={"Y": ShmRef("r", 4)},
    )
    with pytest.raises(InvalidArgument, match="do not fit region"):
        shm.read_inputs(request, "")
    request.shm_inputs["X"] = ShmRef("r", 12)
    with pytest.raises(InvalidArgument, match="needs 16 bytes"):
        shm.read_inputs(request, "")
    response = InferResponse(
        model="m", version="1", id="", outputs=[tensor_from_numpy("Y", np.zeros(4, np.int32))]
    )
    with pytest.raises(InvalidArgument, match="shared_memory_byte_size is 4"):
        shm.write_outputs(request, response, "")
    shm.close()


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({}, None),
        ({"binary_data": True}, None),
        ({"shared_memory_region": "r", "shared_memory_byte_size": 8}, ShmRef("r", 8)),
        (
            {"shared_memory_region": "r", "shared_memory_byte_size": 8, "shared_memory_offset": 4},
            ShmRef("r", 8, 4),
        ),
    ],
)
def test_references_in_parameters(params: dict, expected: ShmRef | None) -> None:
    assert shm_ref(params, "input 'X'") == expected


@pytest.mark.parametrize(
    "params",
    [
        {"shared_memory_byte_size": 8},
        {"shared_memory_region": "", "shared_memory_byte_size": 8},
        {"shared_memory_region": "r"},
        {"shared_memory_region": "r", "shared_memory_byte_size": -1},
        {"shared_memory_region": "r", "shared_memory_byte_size": 8, "shared_memory_offset": "0"},
    ],
)
def test_partial_references_are_refused(params: dict) -> None:
    with pytest.raises(InvalidArgument):
        shm_ref(params, "input 'X'")
