"""String (BYTES) tensors through the ONNX Runtime engine, on real string models.

The worker hands engines object arrays of ``bytes``; ONNX Runtime wants ``str``
and answers ``str``. These tests pin the conversion both ways (no
``"b'..'"`` texts), warm-up of models that parse their strings, and which
run failures are permanent (answered at once) rather than retried.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats
import numpy as np
import onnx
import pytest
from nats.aio.msg import Msg
from onnx import TensorProto, helper

from inferbus_common.bus import ensure_batch_stream
from inferbus_common.catalog import DeployedVersion
from inferbus_common.codec import raw_to_numpy, serialize_bytes, tensor_from_numpy
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.microbatch import BatchEntry, encode_joined_batch
from inferbus_common.protocol.tensors import decode_tensors
from inferbus_common.subjects import Subjects
from inferbus_testing.answers import Answer, answers_of
from inferbus_testing.stringmodels import write_identity_bytes, write_parse_int
from inferbus_worker.engines import (
    EngineError,
    EngineInputError,
    OnnxRuntimeEngine,
    PermanentEngineError,
    build_engine,
    warmup_batch_sizes,
)
from inferbus_worker.engines.onnx import (
    bytes_from_ort,
    input_fault,
    permanent_failure,
    texts_for_ort,
)
from inferbus_worker.runner import ModelRunner
from inferbus_worker.settings import WorkerSettings

TEXTS = [b"hello", b"", b"42", b"caf\xc3\xa9 \xe2\x98\x83", b"nul\x00inside\x00", b"x" * 300]


def _objects(items: list, shape: tuple[int, ...]) -> np.ndarray:
    arr = np.empty(len(items), dtype=object)
    arr[:] = items
    return arr.reshape(shape)


def _load(model_dir: Path, tmp_path: Path) -> OnnxRuntimeEngine:
    config = ModelConfig.model_validate_json((model_dir / "config.json").read_text())
    engine = build_engine(config, model_dir, trt_cache_dir=tmp_path / "trt")
    assert isinstance(engine, OnnxRuntimeEngine)
    engine.load()
    engine.warmup(warmup_batch_sizes(config))
    return engine


@pytest.fixture
def identity(tmp_path: Path):
    engine = _load(write_identity_bytes(tmp_path / "id"), tmp_path)
    yield engine
    engine.close()


@pytest.fixture
def parse_int(tmp_path: Path):
    # Loading includes warm-up: with "" fed to TEXT it failed and the model never loaded.
    engine = _load(write_parse_int(tmp_path / "int"), tmp_path)
    yield engine
    engine.close()


def test_identity_returns_the_same_bytes(identity: OnnxRuntimeEngine) -> None:
    # As the worker builds it: V2 raw bytes → object array of bytes.
    inputs = raw_to_numpy(serialize_bytes(TEXTS), "BYTES", (3, 2))
    out = identity.run({"IN": inputs}, ["OUT"])["OUT"]
    assert out.shape == (3, 2)
    assert out.dtype == object
    assert out.reshape(-1).tolist() == TEXTS
    assert all(type(v) is bytes for v in out.reshape(-1))
    # And back to the wire unchanged.
    assert bytes(tensor_from_numpy("OUT", out).data) == serialize_bytes(TEXTS)


@pytest.mark.parametrize(
    "values",
    [
        _objects(["hello", "caf\u00e9"], (2, 1)),
        _objects([np.str_("hello"), np.str_("caf\u00e9")], (2, 1)),
        _objects([np.bytes_(b"hello"), bytearray("caf\u00e9".encode())], (2, 1)),
        np.array([["hello"], ["caf\u00e9"]]),  # numpy unicode array
        np.array([[b"hello"], ["caf\u00e9".encode()]]),  # numpy bytes array
    ],
    ids=["str", "np.str_", "np.bytes_+bytearray", "U-array", "S-array"],
)
def test_identity_accepts_every_string_form(identity: OnnxRuntimeEngine, values) -> None:
    out = identity.run({"IN": values}, ["OUT"])["OUT"]
    assert out.reshape(-1).tolist() == [b"hello", "caf\u00e9".encode()]


def test_non_utf8_bytes_are_refused_by_element(identity: OnnxRuntimeEngine) -> None:
    values = _objects([b"fine", b"also fine", b"\xff\xfe", b"ok"], (2, 2))
    with pytest.raises(EngineInputError, match=r"input 'IN' element 2 is not UTF-8"):
        identity.run({"IN": values}, ["OUT"])


def test_strings_parse_to_numbers_and_back(parse_int: OnnxRuntimeEngine) -> None:
    values = _objects([b"7", b"-12", b"007", b"9000000000"], (4, 1))
    out = parse_int.run({"TEXT": values}, ["VALUE", "CANONICAL"])
    assert out["VALUE"].dtype == np.int64
    assert out["VALUE"].reshape(-1).tolist() == [7, -12, 7, 9_000_000_000]
    assert out["CANONICAL"].reshape(-1).tolist() == [b"7", b"-12", b"7", b"9000000000"]


@pytest.mark.parametrize("text", [b"", b"seven", b"x12"])
def test_unparsable_text_is_a_permanent_input_error(
    parse_int: OnnxRuntimeEngine, text: bytes
) -> None:
    with pytest.raises(EngineInputError, match=r"cannot compute these inputs.*Cast"):
        parse_int.run({"TEXT": _objects([b"1", text], (2, 1))}, ["VALUE"])


def test_permanent_failures_are_kernel_errors_without_device_trouble() -> None:
    kernel = RuntimeError(
        "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while "
        "running Cast node. Name:'' Status Message: stoll"
    )
    assert permanent_failure(kernel)
    for device in [
        "Non-zero status code returned while running MatMul node. Status Message: "
        "Failed to allocate memory for requested buffer of size 1048576",
        "Non-zero status code returned while running Conv node. Status Message: CUDA "
        "error cudaErrorLaunchFailure",
        "Non-zero status code returned while running TRTKernel node: TensorRT EP failed",
    ]:
        assert not permanent_failure(RuntimeError(device))
    assert not permanent_failure(RuntimeError("[ONNXRuntimeError] : 1 : FAIL : session broken"))


def test_string_outputs_become_utf8_bytes() -> None:
    out = bytes_from_ort(_objects(["a", "caf\u00e9", ""], (3,)))
    assert out.tolist() == [b"a", "caf\u00e9".encode(), b""]
    assert texts_for_ort("x", _objects([b"a", b"b"], (1, 2))).tolist() == [["a", "b"]]


def _picky_model(out: Path) -> Path:
    """TEXT → one of three labels by number: only "5", "6", "7" are valid (not "0")."""
    labels = helper.make_tensor("labels", TensorProto.STRING, [3], [b"five", b"six", b"seven"])
    five = helper.make_tensor("five", TensorProto.INT64, [], [5])
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["TEXT"], ["n"], to=TensorProto.INT64),
            helper.make_node("Sub", ["n", "five"], ["idx"]),
            helper.make_node("Gather", ["labels", "idx"], ["LABEL"]),
        ],
        "picky",
        [helper.make_tensor_value_info("TEXT", TensorProto.STRING, ["batch", 1])],
        [helper.make_tensor_value_info("LABEL", TensorProto.STRING, ["batch", 1])],
        initializer=[labels, five],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    out.mkdir(parents=True)
    onnx.save_model(model, str(out / "model.onnx"))
    return out / "model.onnx"


def test_warmup_is_skipped_when_the_model_refuses_zero(tmp_path: Path, caplog) -> None:
    config = ModelConfig.model_validate(
        {
            "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [-1, 1]}],
            "outputs": [{"name": "LABEL", "datatype": "BYTES", "shape": [-1, 1]}],
        }
    )
    engine = OnnxRuntimeEngine(_picky_model(tmp_path / "picky"), config.engine)
    engine.load()
    engine.warmup(warmup_batch_sizes(config))
    assert "serving without warm-up" in caplog.text
    out = engine.run({"TEXT": _objects([b"7", b"5"], (2, 1))}, ["LABEL"])
    assert out["LABEL"].reshape(-1).tolist() == [b"seven", b"five"]
    with pytest.raises(EngineInputError):
        engine.run({"TEXT": _objects([b"0"], (1, 1))}, ["LABEL"])


def test_warmup_failure_without_string_inputs_fails_the_load(tmp_path: Path) -> None:
    # A graph whose Reshape cannot hold any batch: broken for every input.
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [3, 5])
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        "broken",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])],
        initializer=[shape],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(tmp_path / "model.onnx"))
    config = ModelConfig.model_validate(
        {
            "max_batch_size": 0,
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [3, 5]}],
        }
    )
    engine = OnnxRuntimeEngine(tmp_path / "model.onnx", config.engine)
    engine.load()
    with pytest.raises(EngineError, match="warm-up failed"):
        engine.warmup(warmup_batch_sizes(config))
    # Run anyway: the model's fault, for good (INTERNAL at once, a rollout sees it).
    with pytest.raises(PermanentEngineError, match=r"on every retry.*Reshape"):
        engine.run({"x": np.ones((2, 4), np.float32)}, ["y"])


def test_input_faults_are_values_the_input_brought() -> None:
    running = "Non-zero status code returned while running {op} node. Status Message: {msg}"
    for op, msg in [
        ("Cast", "stoll"),
        ("Cast", "stod"),
        ("Cast", "stoull"),
        ("Gather", "indices element out of data bounds, idx=9 must be within [-3,2]"),
    ]:
        assert input_fault(RuntimeError(running.format(op=op, msg=msg))), msg
    for op, msg in [
        ("Reshape", "The input tensor cannot be reshaped to the requested shape"),
        ("MatMul", "dimension mismatch"),
        ("Custom", "restore failed"),
    ]:
        assert not input_fault(RuntimeError(running.format(op=op, msg=msg))), msg


# --- the runner: a bad string fails its own request only, at once --------------------
@pytest.mark.integration
async def test_runner_answers_a_bad_string_at_once_and_its_neighbours_ok(
    nats_url: str, tmp_path: Path
) -> None:
    model_dir = write_parse_int(tmp_path / "strint")
    config = ModelConfig.model_validate_json((model_dir / "config.json").read_text())
    dv = DeployedVersion(model="strint", version="1", config=config, digest="sha256:x")
    engine = CountingEngine(model_dir / "model.onnx", config.engine)
    nc = await nats.connect(nats_url)
    subjects = Subjects("strings")
    js = nc.jetstream()
    await ensure_batch_stream(js, subjects)
    ws = WorkerSettings(
        nats_url="nats://unused",
        subject_prefix=subjects.prefix,
        fetch_timeout_s=0.2,
        nak_delay_s=0.05,
    )
    engine.load()
    runner = ModelRunner(nc, js, subjects, ws, dv, engine)
    replies: dict[str, Answer] = {}
    done = asyncio.Event()

    async def on_reply(msg: Msg) -> None:
        replies[msg.subject.rsplit(".", 1)[1]] = answers_of(msg)[0]
        if len(replies) == 4:
            done.set()

    await nc.subscribe("rr.strings.*", cb=on_reply)
    await runner.start()
    try:
        # One micro-batch of four requests (rows 1, 2, 1, 1); "x9" in r1 does not parse.
        texts = {"r0": [b"5"], "r1": [b"12", b"x9"], "r2": [b"007"], "r3": [b"-3"]}
        entries = [
            BatchEntry(rid, f"rr.strings.{rid}", h.deadline_from_timeout(30), 0, len(rows))
            for rid, rows in texts.items()
        ]
        flat = [t for rows in texts.values() for t in rows]
        column = _objects(flat, (len(flat), 1))
        data = encode_joined_batch(entries, [[tensor_from_numpy("TEXT", column)]])
        await js.publish(subjects.batch("default", "strint", "1"), data)
        await asyncio.wait_for(done.wait(), 10)
        bad = replies.pop("r1")
        assert bad.headers[h.STATUS] == "INVALID_ARGUMENT"
        assert "cannot compute these inputs" in bad.headers[h.ERROR]
        assert "Cast" in bad.headers[h.ERROR]
        values = {}
        for rid, msg in replies.items():
            assert h.STATUS not in (msg.headers or {}), msg.headers
            tensors = {t.name: t.as_numpy() for t in decode_tensors(msg.data)}
            values[rid] = (tensors["VALUE"].reshape(-1).tolist(), tensors["CANONICAL"].tolist())
        assert values == {
            "r0": ([5], [[b"5"]]),
            "r2": ([7], [[b"7"]]),
            "r3": ([-3], [[b"-3"]]),
        }
        # The batch, then each request alone; never redelivered.
        assert engine.calls == 1 + 4
        deadline = time.monotonic() + 10
        while True:
            info = await js.consumer_info(subjects.batch_stream, runner.consumer)
            if info.num_ack_pending == 0 and info.num_pending == 0:
                break
            assert time.monotonic() < deadline, info
            await asyncio.sleep(0.01)
        assert info.num_redelivered == 0
    finally:
        await runner.stop()
        await nc.close()


class CountingEngine(OnnxRuntimeEngine):
    """The real engine, counting its runs."""

    calls = 0

    def run(self, inputs, output_names):
        self.calls += 1
        return super().run(inputs, output_names)
