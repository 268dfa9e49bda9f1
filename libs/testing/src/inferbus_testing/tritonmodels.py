"""ONNX models built to the contracts of Triton's example clients, for tests.

Triton's client repository (``src/python/examples``) talks to models of
Triton's own test repository; these are inferbus versions of them, built
with `onnx.helper` to answer what the example scripts check:

* ``simple``: INT32 ``INPUT0``/``INPUT1`` ``[-1, 16]`` → ``OUTPUT0`` = sum,
  ``OUTPUT1`` = difference (max batch 8);
* ``simple_string``: the same on BYTES holding decimal integers;
* ``simple_identity``: BYTES ``INPUT0`` → ``OUTPUT0``, unchanged;
* ``simple_sequence``: a sequence model (controls START, READY): ``OUTPUT``
  = ``INPUT`` + START, any sequence id;
* ``simple_dyna_sequence``: controls START, END, READY, CORRID (UINT64):
  ``OUTPUT`` = ``INPUT`` + START + END × CORRID;
* ``simple_string_dyna_sequence``: implicit state and a string CORRID (a
  decimal text): the state accumulates ``INPUT`` from the start, ``OUTPUT``
  = that sum + END × CORRID;
* ``repeat_int32``: decoupled: ``IN`` ``[n]`` → n responses of ``OUT``
  ``[1]`` = ``IN[i]`` and ``IDX`` ``[1]`` = i (``DELAY`` and ``WAIT`` are
  taken but not honoured: an ONNX graph cannot pace its responses).

Each writer puts ``model.onnx`` and ``config.json`` into a folder ready for
``push``; `write_all` writes every one into ``<out>/<name>``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from inferbus_testing.stringmodels import save_model

INT = TensorProto.INT32


def _vi(name: str, elem: int, shape: Sequence[str | int | None]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _spec(name: str, datatype: str, shape: list[int]) -> dict[str, object]:
    return {"name": name, "datatype": datatype, "shape": shape}


def write_simple(out: Path, name: str = "simple") -> Path:
    """Triton's ``simple``: element-wise sum and difference of two INT32 tensors."""
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
        ],
        name,
        [_vi("INPUT0", INT, ["batch", 16]), _vi("INPUT1", INT, ["batch", 16])],
        [_vi("OUTPUT0", INT, ["batch", 16]), _vi("OUTPUT1", INT, ["batch", 16])],
    )
    return save_model(
        out,
        graph,
        {
            "name": name,
            "max_batch_size": 8,
            "inputs": [_spec("INPUT0", "INT32", [-1, 16]), _spec("INPUT1", "INT32", [-1, 16])],
            "outputs": [_spec("OUTPUT0", "INT32", [-1, 16]), _spec("OUTPUT1", "INT32", [-1, 16])],
        },
    )


def write_simple_string(out: Path, name: str = "simple_string") -> Path:
    """Triton's ``simple_string``: sum and difference of decimal texts, as texts."""
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["INPUT0"], ["a"], to=INT),
            helper.make_node("Cast", ["INPUT1"], ["b"], to=INT),
            helper.make_node("Add", ["a", "b"], ["sum"]),
            helper.make_node("Sub", ["a", "b"], ["diff"]),
            helper.make_node("Cast", ["sum"], ["OUTPUT0"], to=TensorProto.STRING),
            helper.make_node("Cast", ["diff"], ["OUTPUT1"], to=TensorProto.STRING),
        ],
        name,
        [
            _vi("INPUT0", TensorProto.STRING, ["batch", 16]),
            _vi("INPUT1", TensorProto.STRING, ["batch", 16]),
        ],
        [
            _vi("OUTPUT0", TensorProto.STRING, ["batch", 16]),
            _vi("OUTPUT1", TensorProto.STRING, ["batch", 16]),
        ],
    )
    return save_model(
        out,
        graph,
        {
            "name": name,
            "max_batch_size": 8,
            "inputs": [_spec("INPUT0", "BYTES", [-1, 16]), _spec("INPUT1", "BYTES", [-1, 16])],
            "outputs": [_spec("OUTPUT0", "BYTES", [-1, 16]), _spec("OUTPUT1", "BYTES", [-1, 16])],
        },
    )


def write_simple_identity(out: Path, name: str = "simple_identity") -> Path:
    """Triton's ``simple_identity``: BYTES in, the same BYTES out."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        name,
        [_vi("INPUT0", TensorProto.STRING, ["batch", "n"])],
        [_vi("OUTPUT0", TensorProto.STRING, ["batch", "n"])],
    )
    return save_model(
        out,
        graph,
        {
            "name": name,
            "max_batch_size": 8,
            "inputs": [_spec("INPUT0", "BYTES", [-1, -1])],
            "outputs": [_spec("OUTPUT0", "BYTES", [-1, -1])],
        },
    )


def _sequence_config(
    name: str, controls: Sequence[Mapping[str, object]], states: Sequence[Mapping[str, object]]
) -> dict[str, object]:
    return {
        "name": name,
        "max_batch_size": 8,
        "inputs": [_spec("INPUT", "INT32", [-1, 1])],
        "outputs": [_spec("OUTPUT", "INT32", [-1, 1])],
        "sequence_batching": {
            "max_sequence_idle_us": 5_000_000,
            "controls": controls,
            "states": states,
        },
    }


def write_simple_sequence(out: Path, name: str = "simple_sequence") -> Path:
    """Triton's ``simple_sequence`` contract: OUTPUT = INPUT + START (READY-gated)."""
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["START", "READY"], ["started"]),
            helper.make_node("Add", ["INPUT", "started"], ["OUTPUT"]),
        ],
        name,
        [
            _vi("INPUT", INT, ["batch", 1]),
            _vi("START", INT, ["batch", 1]),
            _vi("READY", INT, ["batch", 1]),
        ],
        [_vi("OUTPUT", INT, ["batch", 1])],
    )
    controls = [
        {"kind": "start", "name": "START", "datatype": "INT32"},
        {"kind": "ready", "name": "READY", "datatype": "INT32"},
    ]
    return save_model(out, graph, _sequence_config(name, controls, []))


def write_simple_dyna_sequence(out: Path, name: str = "simple_dyna_sequence") -> Path:
    """Triton's ``simple_dyna_sequence`` contract: OUTPUT = INPUT + START + END × CORRID."""
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["CORRID"], ["corrid"], to=INT),
            helper.make_node("Mul", ["END", "corrid"], ["ending"]),
            helper.make_node("Add", ["INPUT", "START"], ["started"]),
            helper.make_node("Add", ["started", "ending"], ["summed"]),
            helper.make_node("Mul", ["summed", "READY"], ["OUTPUT"]),
        ],
        name,
        [
            _vi("INPUT", INT, ["batch", 1]),
            _vi("START", INT, ["batch", 1]),
            _vi("END", INT, ["batch", 1]),
            _vi("READY", INT, ["batch", 1]),
            _vi("CORRID", TensorProto.UINT64, ["batch", 1]),
        ],
        [_vi("OUTPUT", INT, ["batch", 1])],
    )
    controls = [
        {"kind": "start", "name": "START", "datatype": "INT32"},
        {"kind": "end", "name": "END", "datatype": "INT32"},
        {"kind": "ready", "name": "READY", "datatype": "INT32"},
        {"kind": "corrid", "name": "CORRID", "datatype": "UINT64"},
    ]
    return save_model(out, graph, _sequence_config(name, controls, []))


def write_simple_string_dyna_sequence(out: Path, name: str = "simple_string_dyna_sequence") -> Path:
    """Triton's ``simple_string_dyna_sequence`` contract, with implicit state.

    ``ACC`` (state) holds the sum of the sequence's inputs so far (zeros at the
    start); OUTPUT = ACC + INPUT, plus the decimal CORRID on the end request.
    """
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["ACC_IN", "INPUT"], ["ACC_OUT"]),
            helper.make_node("Cast", ["CORRID"], ["corrid"], to=INT),
            helper.make_node("Mul", ["END", "corrid"], ["ending"]),
            helper.make_node("Add", ["ACC_OUT", "ending"], ["OUTPUT"]),
        ],
        name,
        [
            _vi("INPUT", INT, ["batch", 1]),
            _vi("START", INT, ["batch", 1]),
            _vi("END", INT, ["batch", 1]),
            _vi("READY", INT, ["batch", 1]),
            _vi("CORRID", TensorProto.STRING, ["batch", 1]),
            _vi("ACC_IN", INT, ["batch", 1]),
        ],
        [_vi("OUTPUT", INT, ["batch", 1]), _vi("ACC_OUT", INT, ["batch", 1])],
    )
    controls = [
        {"kind": "start", "name": "START", "datatype": "INT32"},
        {"kind": "end", "name": "END", "datatype": "INT32"},
        {"kind": "ready", "name": "READY", "datatype": "INT32"},
        {"kind": "corrid", "name": "CORRID", "datatype": "BYTES"},
    ]
    states = [{"input": "ACC_IN", "output": "ACC_OUT", "datatype": "INT32", "shape": [1]}]
    return save_model(out, graph, _sequence_config(name, controls, states))


def write_repeat_int32(out: Path, name: str = "repeat_int32") -> Path:
    """Triton's ``repeat_int32`` contract as a decoupled model (one response per IN element)."""
    zero = helper.make_tensor("zero", TensorProto.INT64, [], [0])
    one = helper.make_tensor("one", TensorProto.INT64, [], [1])
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["IN"], ["OUT"]),
            helper.make_node("Shape", ["IN"], ["shape"]),
            helper.make_node("Gather", ["shape", "zero"], ["n"], axis=0),
            helper.make_node("Range", ["zero", "n", "one"], ["idx"]),
            helper.make_node("Cast", ["idx"], ["IDX"], to=TensorProto.UINT32),
        ],
        name,
        [
            _vi("IN", INT, ["n"]),
            _vi("DELAY", TensorProto.UINT32, ["n"]),
            _vi("WAIT", TensorProto.UINT32, [1]),
        ],
        [_vi("OUT", INT, ["n"]), _vi("IDX", TensorProto.UINT32, ["n"])],
        initializer=[zero, one],
    )
    return save_model(
        out,
        graph,
        {
            "name": name,
            "max_batch_size": 0,
            "inputs": [
                _spec("IN", "INT32", [-1]),
                _spec("DELAY", "UINT32", [-1]),
                _spec("WAIT", "UINT32", [1]),
            ],
            "outputs": [_spec("OUT", "INT32", [-1]), _spec("IDX", "UINT32", [-1])],
            "decoupled": {"axis": 0, "keep_axis": True},
        },
    )


WRITERS: dict[str, Callable[[Path], Path]] = {
    "simple": write_simple,
    "simple_string": write_simple_string,
    "simple_identity": write_simple_identity,
    "simple_sequence": write_simple_sequence,
    "simple_dyna_sequence": write_simple_dyna_sequence,
    "simple_string_dyna_sequence": write_simple_string_dyna_sequence,
    "repeat_int32": write_repeat_int32,
}
"""Model name → writer."""


def write_all(out: Path) -> dict[str, Path]:
    """Write every model into ``<out>/<name>``; returns name → folder."""
    return {name: writer(out / name) for name, writer in WRITERS.items()}
