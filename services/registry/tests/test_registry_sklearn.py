"""Pushing a scikit-learn pickle: converted to ONNX in a sandboxed child, never stored.

The repository on a local store (no NATS): what is stored and derived, the
recorded difference, refusals that name the estimator, and the child's limits
(a pickle that sleeps is killed at the timeout, one that allocates hits the
memory limit, and the environment it sees holds no registry secret).
"""

from __future__ import annotations

import builtins
import io
import json
import pickle
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import joblib
import numpy as np
import onnx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sklearn.datasets import load_iris
from sklearn.kernel_ridge import KernelRidge
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler

from inferbus_common.errors import InvalidArgument
from inferbus_common.signing import signed_payload, verify
from inferbus_registry.repository import ModelRepository
from inferbus_registry.sklearnconvert import ConversionLimits
from inferbus_registry.store import LocalStore

pytestmark = [pytest.mark.slow]


async def _chunks(files: dict[str, bytes]) -> AsyncIterator[tuple[str, bytes]]:
    for name, data in files.items():
        yield name, data


def _pickled(obj: Any) -> bytes:
    buf = io.BytesIO()
    pickle.dump(obj, buf)
    return buf.getvalue()


def _pipeline() -> Pipeline:
    x, y = load_iris(return_X_y=True)
    return Pipeline([("scale", StandardScaler()), ("clf", LogisticRegression(max_iter=500))]).fit(
        x, y
    )


class _Runs:
    """Unpickling it calls ``fn(*args)``: what a hostile pickle does."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, self.args


def _repo(tmp_path: Path, **limits: Any) -> ModelRepository:
    return ModelRepository(
        LocalStore(tmp_path / "store"),
        spool_dir=tmp_path,
        conversion=ConversionLimits(**limits),
    )


async def test_pickled_pipeline_is_stored_as_onnx(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    data = _pickled(_pipeline())
    result = await repo.push("iris", "1", b"", [], _chunks({"model.pkl": data}))
    record = result.record
    assert sorted(record.files) == ["config.json", "conversion.json", "model.onnx"]
    config = record.config
    assert config.file == "model.onnx" and config.max_batch_size > 0
    assert [(t.name, t.datatype, t.shape) for t in config.inputs] == [("input", "FP32", [-1, 4])]
    assert [(t.name, t.datatype, t.shape) for t in config.outputs] == [
        ("label", "INT64", [-1]),
        ("probabilities", "FP32", [-1, 3]),
    ]
    conversion = json.loads(record.manifest_json)["conversion"]
    assert conversion["estimator"] == "Pipeline(StandardScaler, LogisticRegression)"
    assert conversion["task"] == "classification" and conversion["classes"] == [0, 1, 2]
    assert conversion["max_abs_diff"]["probabilities"] < 1e-5
    assert conversion["label_mismatches"] == 0
    assert conversion["sample"]["rows"] == 256 and "generated" in conversion["sample"]["from"]
    assert conversion["timings_s"]["total"] > 0
    stored = tmp_path / "store" / "models" / "iris" / "1"
    assert not (stored / "model.pkl").exists()
    onnx.checker.check_model(onnx.load(str(stored / "model.onnx")))
    assert "timings_s" not in json.loads((stored / "conversion.json").read_text())
    # The same pickle again: the same files, so the same version (not a conflict).
    again = await repo.push("iris", "1", b"", [], _chunks({"model.pkl": data}))
    assert not again.created and again.record.digest == record.digest


async def test_converted_version_is_signed(tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    repo = ModelRepository(LocalStore(tmp_path / "store"), signing_key=key, signing_key_id="k1")
    record = (
        await repo.push("iris", "1", b"", [], _chunks({"model.pkl": _pickled(_pipeline())}))
    ).record
    payload = signed_payload("iris", "1", {p: f.sha256 for p, f in record.files.items()})
    assert {"model.onnx", "conversion.json"} <= set(record.files)
    verify({"k1": key.public_key()}, record.key_id, record.signature, payload)


async def test_joblib_with_sample_and_config(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    buf = io.BytesIO()
    joblib.dump(_pipeline(), buf)
    sample = io.BytesIO()
    np.save(sample, load_iris(return_X_y=True)[0][:40].astype(np.float32))
    config = {
        "name": "iris",
        "file": "model.joblib",
        "max_batch_size": 8,
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 3]}],
    }
    result = await repo.push(
        "iris",
        "1",
        json.dumps(config).encode(),
        [],
        _chunks({"model.joblib": buf.getvalue(), "sample.npy": sample.getvalue()}),
    )
    assert sorted(result.record.files) == ["config.json", "conversion.json", "model.onnx"]
    assert result.record.config.file == "model.onnx"
    assert result.record.config.max_batch_size == 8
    conversion = json.loads(result.record.manifest_json)["conversion"]
    assert conversion["sample"] == {"from": "sample.npy", "rows": 40}
    assert conversion["source"] == "model.joblib"

    bad = {**config, "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 5]}]}
    with pytest.raises(InvalidArgument, match=r"dimension 1 is 5 in config\.json but 4"):
        await repo.push(
            "iris", "2", json.dumps(bad).encode(), [], _chunks({"model.joblib": buf.getvalue()})
        )


async def test_unsupported_estimator_is_named(tmp_path: Path) -> None:
    x, y = load_iris(return_X_y=True)
    model = Pipeline([("scale", StandardScaler()), ("kr", KernelRidge())]).fit(x, y)
    with pytest.raises(InvalidArgument, match=r"estimator KernelRidge \(sklearn\.kernel_ridge"):
        await _repo(tmp_path).push("kr", "1", b"", [], _chunks({"model.pkl": _pickled(model)}))


async def test_missing_module_and_garbage_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot be unpickled"):
        await _repo(tmp_path).push("g", "1", b"", [], _chunks({"model.pkl": b"not a pickle"}))
    # A pickle naming a module the registry lacks.
    data = b"\x80\x04\x8c\x0cno_such_xyzz\x94\x8c\x01f\x94\x93\x94."
    with pytest.raises(InvalidArgument, match="needs the Python module 'no_such_xyzz'"):
        await _repo(tmp_path).push("g", "1", b"", [], _chunks({"model.pkl": data}))


async def test_sleeping_pickle_is_killed_at_the_timeout(tmp_path: Path) -> None:
    repo = _repo(tmp_path, timeout_s=3.0)
    t0 = time.monotonic()
    with pytest.raises(InvalidArgument, match="took longer than the registry's 3 s"):
        await repo.push("s", "1", b"", [], _chunks({"model.pkl": _pickled(_Runs(time.sleep, 60))}))
    assert time.monotonic() - t0 < 20


async def test_allocating_pickle_hits_the_memory_limit(tmp_path: Path) -> None:
    repo = _repo(tmp_path, memory_mb=1024)
    hog = _pickled(_Runs(bytearray, 4 << 30))
    with pytest.raises(InvalidArgument, match="more than the registry's 1024 MiB"):
        await repo.push("m", "1", b"", [], _chunks({"model.pkl": hog}))


async def test_child_sees_no_registry_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFERBUS_REGISTRY_S3_SECRET_KEY", "s3cret")
    monkeypatch.setenv("INFERBUS_REGISTRY_ADMIN_TOKEN", "t0ken")
    seen = tmp_path / "env.json"
    code = f"import os, json; open({str(seen)!r}, 'w').write(json.dumps(dict(os.environ)))"
    with pytest.raises(InvalidArgument):  # what it unpickles to is no estimator
        await _repo(tmp_path).push(
            "e", "1", b"", [], _chunks({"model.pkl": _pickled(_Runs(builtins.exec, code))})
        )
    env = json.loads(seen.read_text())
    assert not [k for k in env if k.startswith("INFERBUS_")]
    assert "s3cret" not in json.dumps(env) and "t0ken" not in json.dumps(env)
