"""The process that unpickles a pushed scikit-learn model and converts it to ONNX.

Run by `inferbus_registry.sklearnconvert` only, as ``python -I -m
inferbus_registry.sklearnsandbox REQUEST.json``, in a child process with a
scrubbed environment (no S3 keys, no tokens, no signing key path), its own
empty working directory, limits on address space and CPU time that it sets on
itself before it opens the pickle, and a wall-clock timeout enforced by the
registry, which kills its whole process group. Unpickling runs whatever code
the pickle names: this process is the only place inferbus ever does it.

It writes ``model.onnx`` and ``report.json`` into the request's ``out``
directory and exits 0; on a refusal it writes ``report.json`` with an
``error`` (a sentence for the person pushing) and exits 2.

The ONNX graph takes one FP32 input ``input`` [-1, n_features] (the
estimator's ``n_features_in_``). A classifier answers ``label`` [-1] (its
classes, INT64 or BYTES) and ``probabilities`` [-1, n_classes] (what
``predict_proba`` returns, columns in ``classes_`` order); a regressor answers
``predictions``: [-1] for one target (what ``predict`` returns), [-1, k] for k.
"""

from __future__ import annotations

import json
import re
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any

EXIT_REFUSED = 2
INPUT_NAME = "input"
GENERATED_SAMPLE_ROWS = 256
GENERATED_SAMPLE_SEED = 0


class Refused(Exception):
    """A pickle that cannot be served; the message is for the person pushing."""


def _limit(memory_mb: int, cpu_s: int) -> None:
    mem = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 5))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _qualname(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _at(where: str, part: str) -> str:
    return f"{where} > {part}" if where else part


def _leaves(est: Any, where: str) -> list[tuple[str, Any]]:
    """(where, estimator) for every estimator a converter must know, pipelines walked."""
    from sklearn.compose import ColumnTransformer
    from sklearn.pipeline import FeatureUnion, Pipeline

    if isinstance(est, Pipeline):
        found = [(where, est)]
        for name, step in est.steps:
            found += _leaves(step, _at(where, f"step {name!r}"))
        return found
    if isinstance(est, FeatureUnion):
        found = [(where, est)]
        for name, part in est.transformer_list:
            found += _leaves(part, _at(where, f"part {name!r}"))
        return found
    if isinstance(est, ColumnTransformer):
        found = [(where, est)]
        for name, part, _cols in getattr(est, "transformers_", est.transformers):
            found += _leaves(part, _at(where, f"transformer {name!r}"))
        return found
    if est is None or isinstance(est, str):  # "passthrough", "drop"
        return []
    return [(where, est)]


def _register_boosters() -> list[str]:
    """Converters for LightGBM models, when the pickle brought LightGBM in."""
    registered: list[str] = []
    if "lightgbm" not in sys.modules:
        return registered
    from lightgbm import LGBMClassifier, LGBMRegressor
    from onnxmltools.convert.lightgbm.operator_converters.LightGbm import convert_lightgbm
    from skl2onnx import update_registered_converter
    from skl2onnx.common.shape_calculator import (
        calculate_linear_classifier_output_shapes,
        calculate_linear_regressor_output_shapes,
    )

    update_registered_converter(
        LGBMClassifier,
        "LightGbmLGBMClassifier",
        calculate_linear_classifier_output_shapes,
        convert_lightgbm,
        options={"nocl": [True, False], "zipmap": [True, False, "columns"]},
    )
    update_registered_converter(
        LGBMRegressor,
        "LightGbmLGBMRegressor",
        calculate_linear_regressor_output_shapes,
        convert_lightgbm,
        options={"split": None},
    )
    registered.append("lightgbm")
    return registered


def _check_supported(est: Any, source: str) -> None:
    from skl2onnx._supported_operators import sklearn_operator_name_map

    for where, leaf in _leaves(est, ""):
        if type(leaf) not in sklearn_operator_name_map:
            name = type(leaf).__name__
            at = f" ({where} of the {type(est).__name__})" if where else ""
            raise Refused(
                f"{source}: estimator {name} ({_qualname(leaf)}){at} is not supported: "
                "skl2onnx has no ONNX converter for it; push an ONNX model instead, or a "
                "pipeline of supported estimators"
            )


def _convert(est: Any, n_features: int, classifier: bool, source: str, boosters: bool) -> Any:
    import onnx
    from skl2onnx import get_latest_tested_opset_version, to_onnx
    from skl2onnx.common.data_types import FloatTensorType

    options: dict[Any, Any] = {}
    if classifier:
        # Probabilities as a tensor, not skl2onnx's default list of maps (ZipMap).
        for _where, leaf in _leaves(est, ""):
            if hasattr(leaf, "predict_proba") and not hasattr(leaf, "steps"):
                options[id(leaf)] = {"zipmap": False}
    try:
        proto = to_onnx(
            est,
            initial_types=[(INPUT_NAME, FloatTensorType([None, n_features]))],
            options=options or None,
            # onnxmltools' LightGBM converter writes ai.onnx.ml 3 trees.
            target_opset=(
                {"": get_latest_tested_opset_version(), "ai.onnx.ml": 3} if boosters else None
            ),
        )
    except Exception as exc:
        found = re.search(r"<class '([^']+)'>", str(exc))
        named = f" (estimator {found.group(1)})" if found else ""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise Refused(f"{source}: skl2onnx could not convert it{named}: {first}") from exc

    graph = proto.graph
    outputs = [o.name for o in graph.output]
    if classifier:
        if len(outputs) != 2:
            raise Refused(f"{source}: the converted classifier has outputs {outputs}, not 2")
        _rename_output(proto, outputs[0], "label")
        _rename_output(proto, outputs[1], "probabilities")
    else:
        if len(outputs) != 1:
            raise Refused(f"{source}: the converted regressor has outputs {outputs}, not 1")
        import numpy as np

        if np.asarray(est.predict(np.zeros((1, n_features), np.float32))).ndim == 1:
            # One target: [-1] like `predict`, not skl2onnx's [-1, 1].
            shape = onnx.helper.make_tensor("predictions_shape", onnx.TensorProto.INT64, [1], [-1])
            graph.initializer.append(shape)
            graph.node.append(
                onnx.helper.make_node("Reshape", [outputs[0], "predictions_shape"], ["predictions"])
            )
            old = graph.output[0]
            new = onnx.helper.make_tensor_value_info(
                "predictions", old.type.tensor_type.elem_type, [None]
            )
            del graph.output[:]
            graph.output.append(new)
        else:
            _rename_output(proto, outputs[0], "predictions")
    onnx.checker.check_model(proto)
    return proto


def _rename_output(proto: Any, old: str, new: str) -> None:
    if old == new:
        return
    for node in proto.graph.node:
        for i, name in enumerate(node.output):
            if name == old:
                node.output[i] = new
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
    for out in proto.graph.output:
        if out.name == old:
            out.name = new


def _sample(path: str, n_features: int) -> tuple[Any, str]:
    import numpy as np

    if path:
        try:
            sample = np.load(path, allow_pickle=False)
        except Exception as exc:
            raise Refused(f"sample.npy cannot be read as a NumPy array: {exc}") from exc
        if sample.ndim == 1:
            sample = sample.reshape(1, -1)
        if sample.ndim != 2 or sample.shape[1] != n_features or sample.shape[0] == 0:
            raise Refused(
                f"sample.npy has shape {list(sample.shape)}; the model takes "
                f"[rows, {n_features}] (rows > 0)"
            )
        return sample.astype(np.float32), "sample.npy"
    rng = np.random.default_rng(GENERATED_SAMPLE_SEED)
    sample = rng.standard_normal((GENERATED_SAMPLE_ROWS, n_features)).astype(np.float32)
    return sample, f"generated: standard normal, seed {GENERATED_SAMPLE_SEED}"


def _compare(
    est: Any, onnx_bytes: bytes, sample: Any, classifier: bool
) -> tuple[dict[str, float], int]:
    import numpy as np
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    session = ort.InferenceSession(onnx_bytes, opts, providers=["CPUExecutionProvider"])
    got = dict(
        zip(
            [o.name for o in session.get_outputs()],
            session.run(None, {INPUT_NAME: sample}),
            strict=True,
        )
    )
    if classifier:
        want_proba = np.asarray(est.predict_proba(sample), dtype=np.float64)
        want_label = np.asarray(est.predict(sample))
        proba_diff = float(np.max(np.abs(want_proba - got["probabilities"].astype(np.float64))))
        mismatches = int(np.sum(want_label.astype(str) != got["label"].astype(str)))
        return {"probabilities": proba_diff}, mismatches
    want = np.asarray(est.predict(sample), dtype=np.float64)
    have = got["predictions"].astype(np.float64).reshape(want.shape)
    return {"predictions": float(np.max(np.abs(want - have)))}, 0


def _describe(est: Any) -> str:
    from sklearn.pipeline import Pipeline

    if isinstance(est, Pipeline):
        return "Pipeline(" + ", ".join(type(s).__name__ for _, s in est.steps) + ")"
    return type(est).__name__


def run(request: dict[str, Any]) -> dict[str, Any]:
    """Load, convert, compare; the report (raises `Refused`)."""
    source = str(request["source_name"])
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            import joblib

            # joblib reads plain pickles as well as its own files.
            est = joblib.load(request["source"])
        except ModuleNotFoundError as exc:
            raise Refused(
                f"{source}: the pickle needs the Python module {exc.name!r}, which this "
                "registry does not have (it converts scikit-learn and LightGBM models)"
            ) from exc
        except MemoryError:
            raise
        except Exception as exc:
            raise Refused(f"{source}: cannot be unpickled: {type(exc).__name__}: {exc}") from exc
    load_s = time.monotonic() - t0
    notes = sorted(
        {
            str(w.message).strip().splitlines()[0]
            for w in caught
            if type(w.message).__name__ == "InconsistentVersionWarning"
        }
    )

    from sklearn.base import is_classifier, is_regressor

    classifier = bool(is_classifier(est))
    if classifier and not hasattr(est, "predict_proba"):
        raise Refused(
            f"{source}: classifier {_describe(est)} has no predict_proba; inferbus serves "
            "classifiers with probabilities"
        )
    if not classifier and not is_regressor(est):
        raise Refused(
            f"{source}: estimator {type(est).__name__} ({_qualname(est)}) is not supported: "
            "inferbus converts classifiers with predict_proba, regressors and pipelines "
            "ending in one"
        )
    n_features = getattr(est, "n_features_in_", None)
    if not isinstance(n_features, int) or n_features <= 0:
        raise Refused(
            f"{source}: {_describe(est)} has no n_features_in_ (is it fitted, on a 2-D array?)"
        )
    boosters = _register_boosters()
    _check_supported(est, source)

    t1 = time.monotonic()
    proto = _convert(est, n_features, classifier, source, bool(boosters))
    onnx_bytes = proto.SerializeToString()
    convert_s = time.monotonic() - t1

    sample, sample_from = _sample(str(request.get("sample") or ""), n_features)
    t2 = time.monotonic()
    diffs, mismatches = _compare(est, onnx_bytes, sample, classifier)
    compare_s = time.monotonic() - t2
    tolerance = float(request["tolerance"])
    worst = max(diffs.values())
    if not worst <= tolerance:  # NaN fails too
        name = next(iter(diffs))
        raise Refused(
            f"{source}: the converted ONNX model's {name} differ from the pickle's by up to "
            f"{worst:.3g} on the sample ({sample_from}, {len(sample)} rows), more than the "
            f"registry's tolerance {tolerance:g}"
        )
    Path(request["out"], "model.onnx").write_bytes(onnx_bytes)

    import skl2onnx
    import sklearn

    versions = {"skl2onnx": skl2onnx.__version__, "scikit-learn": sklearn.__version__}
    if boosters:
        import lightgbm
        import onnxmltools

        versions |= {"lightgbm": lightgbm.__version__, "onnxmltools": onnxmltools.__version__}
    report: dict[str, Any] = {
        "source": source,
        "source_sha256": request["source_sha256"],
        "estimator": _describe(est),
        "task": "classification" if classifier else "regression",
        "n_features": n_features,
        "converter": versions,
        "sample": {"from": sample_from, "rows": len(sample)},
        "max_abs_diff": diffs,
        "tolerance": tolerance,
    }
    if classifier:
        report["classes"] = [c.item() if hasattr(c, "item") else c for c in est.classes_]
        report["label_mismatches"] = mismatches
    if notes:
        report["warnings"] = notes
    # Timings are not part of the stored record (a re-push must hash the same).
    report["_timings_s"] = {
        "load": round(load_s, 3),
        "convert": round(convert_s, 3),
        "compare": round(compare_s, 3),
    }
    return report


def main() -> int:
    """Entry point: ``python -I -m inferbus_registry.sklearnsandbox REQUEST.json``."""
    request = json.loads(Path(sys.argv[1]).read_text())
    out = Path(request["out"])
    _limit(int(request["memory_mb"]), int(request["cpu_s"]))
    try:
        report = run(request)
    except Refused as exc:
        (out / "report.json").write_text(json.dumps({"error": str(exc)}))
        return EXIT_REFUSED
    except MemoryError:
        (out / "report.json").write_text(
            json.dumps(
                {
                    "error": f"{request['source_name']}: converting it needs more than the "
                    f"registry's {request['memory_mb']} MiB"
                }
            )
        )
        return EXIT_REFUSED
    (out / "report.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
