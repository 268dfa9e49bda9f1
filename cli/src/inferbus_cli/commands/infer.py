"""``inferbus infer``: one KServe V2 gRPC ModelInfer call, outputs printed as JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import grpc
import numpy as np

from inferbus_cli.rpc import check_gateway_stack, inference_stub, open_channel, rpc_error_text
from inferbus_cli.state import default_gateway_address, expected_stack, resolve_home
from inferbus_cli.tensors import (
    build_request,
    check_datatype_known,
    parse_input_arg,
    random_array,
    response_to_json,
    to_array,
)
from inferbus_proto.v2 import grpc_predict_v2_pb2 as pb


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def run(args: argparse.Namespace) -> int:
    """Send one inference request; exit 1 with the gRPC status on failure."""
    address = args.url or default_gateway_address(resolve_home(args.home))
    if not args.input and not args.random:
        return _fail("give the inputs with --input NAME=JSON|@file.npy, or --random N")
    try:
        given = [parse_input_arg(text) for text in args.input]
    except ValueError as exc:
        return _fail(str(exc))
    stack = expected_stack(resolve_home(args.home), address)
    with open_channel(address, stack_id=stack) as channel:
        try:
            check_gateway_stack(channel, stack)
        except grpc.RpcError as exc:
            return _fail(rpc_error_text(exc, address))
        stub = inference_stub(channel)
        try:
            meta = stub.ModelMetadata(
                pb.ModelMetadataRequest(name=args.model, version=args.version or ""),
                timeout=args.timeout,
            )
        except grpc.RpcError as exc:
            return _fail(f"ModelMetadata {args.model}: {rpc_error_text(exc, address)}")
        specs = {t.name: t for t in meta.inputs}
        unknown = [a.name for a in given if a.name not in specs]
        if unknown:
            return _fail(f"{args.model} has no input(s) {unknown}; its inputs are {list(specs)}")
        values = {a.name: a.value for a in given}
        rng = np.random.default_rng(args.seed)
        arrays: list[tuple[str, np.ndarray]] = []
        try:
            for name, spec in specs.items():
                check_datatype_known(spec.datatype)
                if name in values:
                    arrays.append((name, to_array(values[name], spec.datatype)))
                elif args.random:
                    arrays.append((name, random_array(spec.datatype, spec.shape, args.random, rng)))
                else:
                    return _fail(f"missing --input {name}=... (or use --random N)")
        except ValueError as exc:
            return _fail(f"input {name}: {exc}")
        request = build_request(args.model, args.version or "", arrays, request_id=args.id)
        start = time.monotonic()
        try:
            response = stub.ModelInfer(request, timeout=args.timeout)
        except grpc.RpcError as exc:
            return _fail(f"ModelInfer {args.model}: {rpc_error_text(exc, address)}")
        elapsed_ms = (time.monotonic() - start) * 1000
    doc = response_to_json(response)
    doc["client_latency_ms"] = round(elapsed_ms, 3)
    if args.show_inputs:
        doc["inputs"] = {
            name: {"shape": list(array.shape), "data": array.tolist()}
            for name, array in arrays
            if array.dtype != object
        }
    print(json.dumps(doc) if args.compact else readable_json(doc))
    return 0


def readable_json(doc: dict[str, Any]) -> str:
    """Indented JSON, except tensors: shapes on one line, data one line per row."""
    placeholders: dict[str, str] = {}
    shown = json.loads(json.dumps(doc))
    for section in ("outputs", "inputs"):
        for name, tensor in shown.get(section, {}).items():
            key = f"@@{section}.{name}"
            placeholders[key + ".shape@@"] = json.dumps(tensor["shape"])
            data = tensor["data"]
            if isinstance(data, list) and data and isinstance(data[0], list):
                rows = ",\n        ".join(json.dumps(row) for row in data)
                placeholders[key + ".data@@"] = f"[\n        {rows}\n      ]"
            else:
                placeholders[key + ".data@@"] = json.dumps(data)
            tensor["shape"], tensor["data"] = key + ".shape@@", key + ".data@@"
    text = json.dumps(shown, indent=2)
    for key, value in placeholders.items():
        text = text.replace(json.dumps(key), value)
    return text
