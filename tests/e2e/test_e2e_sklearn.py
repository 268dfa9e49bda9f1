"""scikit-learn models pushed as pickles, served as ONNX by the whole stack.

The test trains each model itself, pushes the pickle with ``inferbus models
push`` (the registry converts it in its sandboxed child, `sklearnconvert`),
and checks that the gateway's answers over gRPC and HTTP match the estimator's
own ``predict_proba``/``predict`` to 1e-5:

* a Pipeline(StandardScaler, LogisticRegression) pushed as ``model.pkl`` and
  the same kind of pipeline pushed as ``model.joblib`` in a directory with a
  ``sample.npy`` (what the conversion is checked on);
* a regressor (Pipeline(StandardScaler, Ridge)): ``predictions`` is ``predict``;
* a LightGBM classifier (onnxmltools' converter through skl2onnx);
* an estimator skl2onnx cannot convert is refused at push, named.

One stack (one worker) for the module.
"""

from __future__ import annotations

import json
import pickle
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import joblib
import lightgbm
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from sklearn.datasets import make_classification, make_regression
from sklearn.kernel_ridge import KernelRidge
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler

from inferbus_cli.__main__ import main as cli
from inferbus_testing.stack import LocalStack

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

N_FEATURES = 8


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with LocalStack(tmp_path_factory.mktemp("sklearn"), workers=1) as st:
        yield st


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    x, y = make_classification(
        n_samples=400, n_features=N_FEATURES, n_informative=5, n_classes=3, random_state=0
    )
    # float32 from the start: the estimator sees exactly what the clients send.
    return (x * 10 + 3).astype(np.float32), y


def _push(stack: LocalStack, path: Path, name: str, capsys: pytest.CaptureFixture[str]) -> str:
    """``inferbus models push`` in-process; returns what it said on stderr."""
    t0 = time.monotonic()
    code = cli(
        [
            *("models", "push", str(path), "--name", name, "--version", "1"),
            *("--alias", "stable", "--registry", stack.registry_url),
        ]
    )
    out = capsys.readouterr()
    with capsys.disabled():  # the push's time and summary, for the log (pytest -s)
        print(f"\npush {name} ({path.name}): {time.monotonic() - t0:.2f}s\n{out.err}")
    assert code == 0, out.err
    return out.err


def _infer_both(stack: LocalStack, model: str, x: np.ndarray, outputs: list[str]) -> list[Any]:
    """The named outputs over gRPC, then over HTTP."""
    answers: list[dict[str, np.ndarray]] = []
    g = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        inp = grpcclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        res = g.infer(model, [inp], client_timeout=60)
        answers.append({o: res.as_numpy(o) for o in outputs})
    finally:
        g.close()
    h = httpclient.InferenceServerClient(stack.http_url, network_timeout=60)
    try:
        hinp = httpclient.InferInput("input", list(x.shape), "FP32")
        hinp.set_data_from_numpy(x, binary_data=False)
        hres = h.infer(model, [hinp])
        answers.append({o: hres.as_numpy(o) for o in outputs})
    finally:
        h.close()
    return answers


def _get(stack: LocalStack, name: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert cli(["models", "get", name, "--registry", stack.registry_url]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def _pipeline(x: np.ndarray, y: np.ndarray, c: float) -> Pipeline:
    return Pipeline(
        [("scale", StandardScaler()), ("clf", LogisticRegression(C=c, max_iter=1000))]
    ).fit(x, y)


def test_pipeline_pickle_and_joblib_serve_predict_proba(
    stack: LocalStack,
    data: tuple[np.ndarray, np.ndarray],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    x, y = data
    pkl_model, joblib_model = _pipeline(x, y, 1.0), _pipeline(x, y, 0.1)
    pkl = tmp_path / "model.pkl"
    pkl.write_bytes(pickle.dumps(pkl_model))
    said = _push(stack, pkl, "skl-pkl", capsys)
    assert "converted model.pkl (Pipeline(StandardScaler, LogisticRegression)" in said
    assert "input: FP32 [-1, 8]" in said and "probabilities: FP32 [-1, 3]" in said

    version_dir = tmp_path / "joblib-version"
    version_dir.mkdir()
    joblib.dump(joblib_model, version_dir / "model.joblib")
    np.save(version_dir / "sample.npy", x[:50])
    said = _push(stack, version_dir, "skl-joblib", capsys)
    assert "on 50 rows (sample.npy)" in said

    stack.wait_model_ready("skl-pkl")
    stack.wait_model_ready("skl-joblib")
    batch = x[:16]
    for name, model in (("skl-pkl", pkl_model), ("skl-joblib", joblib_model)):
        for answer in _infer_both(stack, name, batch, ["probabilities", "label"]):
            np.testing.assert_allclose(
                answer["probabilities"], model.predict_proba(batch), rtol=0, atol=1e-5
            )
            np.testing.assert_array_equal(answer["label"], model.predict(batch))

    doc = _get(stack, "skl-pkl", capsys)
    files = sorted(f["path"] for f in doc["files"])
    assert files == ["config.json", "conversion.json", "model.onnx"]  # no pickle stored
    conversion = doc["manifest"]["conversion"]
    assert conversion["max_abs_diff"]["probabilities"] < 1e-5
    assert conversion["label_mismatches"] == 0
    assert doc["manifest"]["signature"] is None or doc["manifest"]["signature"]["value"]


def test_regressor_serves_predict(
    stack: LocalStack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x, y = make_regression(n_samples=300, n_features=N_FEATURES, noise=0.5, random_state=1)
    x = x.astype(np.float32)
    model = Pipeline([("scale", StandardScaler()), ("ridge", Ridge(alpha=0.5))]).fit(x, y / 100)
    joblib.dump(model, tmp_path / "model.joblib")
    said = _push(stack, tmp_path / "model.joblib", "skl-reg", capsys)
    assert "output predictions: FP32 [-1]" in said
    stack.wait_model_ready("skl-reg")
    batch = x[:16]
    for answer in _infer_both(stack, "skl-reg", batch, ["predictions"]):
        np.testing.assert_allclose(answer["predictions"], model.predict(batch), rtol=0, atol=1e-5)


def test_lightgbm_classifier_serves_predict_proba(
    stack: LocalStack,
    data: tuple[np.ndarray, np.ndarray],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    x, y = data
    model = lightgbm.LGBMClassifier(n_estimators=30, num_leaves=8, verbose=-1).fit(x, y)
    joblib.dump(model, tmp_path / "model.pkl")
    said = _push(stack, tmp_path / "model.pkl", "lgbm", capsys)
    assert "LGBMClassifier" in said and "lightgbm 4." in said
    stack.wait_model_ready("lgbm")
    batch = x[:16]
    for answer in _infer_both(stack, "lgbm", batch, ["probabilities", "label"]):
        np.testing.assert_allclose(
            answer["probabilities"], model.predict_proba(batch), rtol=0, atol=1e-5
        )
        np.testing.assert_array_equal(answer["label"], model.predict(batch))


def test_unsupported_estimator_is_refused_naming_it(
    stack: LocalStack,
    data: tuple[np.ndarray, np.ndarray],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    x, y = data
    model = Pipeline([("scale", StandardScaler()), ("kr", KernelRidge())]).fit(x, y)
    (tmp_path / "model.pkl").write_bytes(pickle.dumps(model))
    code = cli(
        [
            *("models", "push", str(tmp_path / "model.pkl"), "--name", "kr", "--version", "1"),
            *("--registry", stack.registry_url),
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "INVALID_ARGUMENT" in err
    assert "estimator KernelRidge (sklearn.kernel_ridge.KernelRidge)" in err, err
    assert "(step 'kr' of the Pipeline) is not supported" in err, err
