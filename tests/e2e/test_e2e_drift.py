"""Drift detection through the real stack.

A reference profile of the fraud model's 64 inputs (standard normal) is built
with ``inferbus profile`` and pushed inside versions 2 and 3. Version 2 then
gets traffic whose features 2 and 5 are shifted; version 3 gets traffic from
the reference distribution. The gateway (sampling every request) must report
PSI above 0.2 for exactly features 2 and 5 of version 2 and for no feature of
version 3 — in its metrics, in the drift KV bucket and in ``inferbus drift
report``. A profile about a tensor the model does not have is refused at push.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import nats
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from inferbus_cli.__main__ import main as cli_main
from inferbus_client.registry import RegistryClient
from inferbus_common.drift import DriftReport
from inferbus_common.errors import InvalidArgument
from inferbus_common.subjects import Subjects

WINDOW = 1000
STACK_ENV = {
    "INFERBUS_GATEWAY_DRIFT_SAMPLE_RATE": "1",
    "INFERBUS_GATEWAY_DRIFT_WINDOW_ROWS": str(WINDOW),
    "INFERBUS_GATEWAY_DRIFT_MIN_ROWS": "500",
    "INFERBUS_GATEWAY_DRIFT_INTERVAL_S": "0.5",
}
SHIFTED = {2: 1.5, 5: -1.5}
THRESHOLD = 0.2


def _version_with_profile(model_dir: Path, out: Path, profile: Path) -> Path:
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns(".gitignore"))
    shutil.copy(profile, out / "profile.json")
    return out


async def _push(registry_url: str, path: Path, version: str) -> list[str]:
    async with RegistryClient(registry_url) as client:
        info = await client.push(path, "fraud", version, aliases=[])
    return [f.path for f in info.files]


def _wait_version_ready(url: str, version: str, timeout: float = 60.0) -> None:
    client = grpcclient.InferenceServerClient(url)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if client.is_model_ready("fraud", version):
                return
            time.sleep(0.05)
    finally:
        client.close()
    raise TimeoutError(f"fraud version {version} not ready after {timeout}s")


def _send(url: str, version: str, rng: np.random.Generator, shift: dict[int, float]) -> None:
    client = grpcclient.InferenceServerClient(url)
    try:
        for _ in range(WINDOW // 25):
            x = rng.normal(0.0, 1.0, size=(25, 64)).astype(np.float32)
            for col, delta in shift.items():
                x[:, col] += delta
            inp = grpcclient.InferInput("input", [25, 64], "FP32")
            inp.set_data_from_numpy(x)
            client.infer("fraud", [inp], model_version=version)
    finally:
        client.close()


async def _reports(nats_url: str) -> dict[str, DriftReport]:
    subjects = Subjects("ib")
    nc = await nats.connect(nats_url)
    try:
        try:
            kv = await nc.jetstream().key_value(subjects.drift_bucket)
        except nats.js.errors.BucketNotFoundError:
            return {}
        out = {}
        for version in ("2", "3"):
            try:
                entry = await kv.get(subjects.model_key("fraud", version))
            except nats.js.errors.KeyNotFoundError:
                continue
            out[version] = DriftReport.model_validate_json(entry.value or b"")
        return out
    finally:
        await nc.close()


def test_shifted_features_drift_and_unshifted_traffic_stays_low(
    stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = np.random.default_rng(11)
    sample = tmp_path / "sample.npy"
    np.save(sample, rng.normal(0.0, 1.0, size=(5000, 64)).astype(np.float32))
    profile = tmp_path / "profile.json"
    assert cli_main(["profile", "fraud", "--sample", str(sample), "--out", str(profile)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["features"] == 64 and summary["tensors"] == ["input"]

    for version in ("2", "3"):
        vdir = _version_with_profile(stack.model_dir, tmp_path / f"v{version}", profile)
        files = asyncio.run(_push(stack.registry_url, vdir, version))
        assert "profile.json" in files
        _wait_version_ready(stack.grpc_url, version)

    _send(stack.grpc_url, "2", rng, SHIFTED)
    _send(stack.grpc_url, "3", rng, {})

    deadline = time.monotonic() + 30
    reports: dict[str, DriftReport] = {}
    while time.monotonic() < deadline:
        reports = asyncio.run(_reports(stack.nats.url))
        if len(reports) == 2 and all(r.rows == WINDOW for r in reports.values()):
            break
        time.sleep(0.2)
    assert len(reports) == 2, f"drift reports missing: {sorted(reports)}"
    assert all(r.rows == WINDOW for r in reports.values()), {v: r.rows for v, r in reports.items()}

    shifted = reports["2"]
    assert len(shifted.features) == 64
    high = {name for name, fd in shifted.features.items() if fd.psi > THRESHOLD}
    assert high == {f"input[{c}]" for c in SHIFTED}
    for c in SHIFTED:
        assert (shifted.features[f"input[{c}]"].ks or 0.0) > 0.3
    steady = reports["3"]
    assert max(fd.psi for fd in steady.features.values()) < 0.1
    assert max(fd.ks or 0.0 for fd in steady.features.values()) < 0.1

    metrics = stack.metrics(stack.gateway)
    key = "inferbus_drift_psi{{feature=input[{c}],model=fraud,version={v}}}"
    assert metrics[key.format(c=2, v="2")] > THRESHOLD
    assert metrics[key.format(c=5, v="2")] > THRESHOLD
    assert metrics[key.format(c=3, v="2")] < THRESHOLD
    assert metrics[key.format(c=2, v="3")] < THRESHOLD
    assert metrics["inferbus_drift_ks{feature=input[2],model=fraud,version=2}"] > 0.3

    args = ["drift", "report", "fraud", "--version", "2", "--top", "3", "--json"]
    code = cli_main([*args, "--nats", stack.nats.url])
    assert code == 0
    (doc,) = json.loads(capsys.readouterr().out)
    worst = doc["worst"]
    assert {w["feature"] for w in worst[:2]} == {"input[2]", "input[5]"}
    assert [w["drifting"] for w in worst] == [True, True, False]
    assert cli_main(["drift", "report", "fraud", "--nats", stack.nats.url]) == 0
    text = capsys.readouterr().out
    assert "fraud version 2" in text and "fraud version 3" in text and "DRIFT" in text


def test_push_refuses_a_profile_about_unknown_tensors(stack, tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    sample = tmp_path / "other.npy"
    np.save(sample, rng.normal(size=(100, 3)))
    profile = tmp_path / "profile.json"
    args = ["profile", "fraud", "--sample", str(sample), "--input", "nope"]
    assert cli_main([*args, "--out", str(profile)]) == 0
    vdir = _version_with_profile(stack.model_dir, tmp_path / "bad", profile)
    with pytest.raises(InvalidArgument, match="does not have"):
        asyncio.run(_push(stack.registry_url, vdir, "9"))
