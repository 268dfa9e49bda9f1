"""``inferbus models optimize`` and ``inferbus models profile`` (issue 27).

Both run where the CLI runs: the source version's artifact is downloaded
(SHA-256 checked), converted or profiled here with ONNX Runtime (a PyTorch
version with torch's profiler, `inferbus_cli.torchprofile`), and an
optimised variant is pushed back as a new version through the ordinary push
path. The registry stays a store of signed artifacts (no onnxconverter-common
or quantiser in it), the conversion costs the caller's CPU, not the
registry's, and the result is signed and verified like any pushed version.
Aliases are not moved: promotion is the usual route / rollout.

The measurement (error against the source on a sample, CPU p50 speed at batch
1 and 32) is pushed with the version as ``optimization.json``; `models get`
lists it among the files, ``models download NAME --version V --file
optimization.json`` fetches it, and this command prints it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from inferbus_cli import optimize, torchprofile
from inferbus_cli.commands import models
from inferbus_cli.rpc import registry_channel, registry_stub, rpc_error_text
from inferbus_common.modelconfig import ModelConfig
from inferbus_proto.registry import registry_pb2 as rpb

RECORD = "optimization.json"
"""The file in an optimised version that records how it was made and measured."""


def _fetch(args: argparse.Namespace, workdir: Path) -> tuple[str, dict[str, Any], Path]:
    """Download the source version's config and model file; (resolved version, config, model)."""
    address = models._registry_address(args)
    with registry_channel(address) as channel:
        stub = registry_stub(channel)
        info = stub.GetVersion(
            rpb.GetVersionRequest(model=args.name, version=args.version), timeout=args.timeout
        )
        config = json.loads(info.config_json)
        model, _ = models.download_file(
            stub,
            args.name,
            info.version,
            config.get("file", "model.onnx"),
            # The suffix tells torch's loaders a .pt from a .pt2.
            workdir / ("source" + Path(config.get("file", "model.onnx")).suffix),
            timeout=args.timeout,
            progress=False,
        )
    return info.version, config, model


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def _chunks(feeds: dict[str, np.ndarray], size: int) -> list[dict[str, np.ndarray]]:
    rows = min(len(v) for v in feeds.values())
    return [{k: v[i : i + size] for k, v in feeds.items()} for i in range(0, rows, size)]


def run_optimize(args: argparse.Namespace) -> int:
    """Make an fp16 or int8 variant of a version, measure it, push it as a new version."""
    mode = "fp16" if args.fp16 else "int8"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        try:
            source, config, src = _fetch(args, work)
        except grpc.RpcError as exc:
            return models._fail(f"{args.name} {args.version}: {rpc_error_text(exc, '')}")
        except (ValueError, OSError) as exc:
            return models._fail(str(exc))
        kind = config.get("engine", {}).get("kind", "onnxruntime")
        if kind != "onnxruntime":
            return models._fail(
                f"{args.name} {source}: models optimize converts ONNX models; this version's "
                f"engine is {kind!r} ({config.get('file')})"
            )
        target = args.to or f"{source}-{mode}"
        out = work / "version"
        out.mkdir()
        dst = out / config.get("file", "model.onnx")
        calibration = _load_npz(Path(args.calibration)) if args.calibration else None
        record: dict[str, Any] = {"source_version": source, "precision": mode}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # float16's per-constant truncation notes
            if args.fp16:
                optimize.to_fp16(src, dst)
            else:
                chunks = _chunks(calibration, 32) if calibration else None
                record["quantization"] = optimize.to_int8(src, dst, chunks)
        sample = calibration if calibration else optimize.sample_inputs(src, 256, seed=1)
        record["error"] = optimize.compare(src, dst, sample)
        record["error"]["sample"] = "calibration file" if calibration else "random normal"
        record["speed_cpu_p50_us"] = {
            "source": optimize.speed(src),
            "optimized": optimize.speed(dst),
        }
        config["name"] = args.name
        (out / "config.json").write_text(json.dumps(config, indent=2))
        (out / RECORD).write_text(json.dumps(record, indent=2))
        push = argparse.Namespace(
            path=str(out),
            name=args.name,
            version=target,
            config=None,
            alias=[],
            json=False,
            progress=False,
            registry=args.registry,
            home=args.home,
            timeout=args.timeout,
        )
        rc = models.run_push(push)
    if rc == 0:
        print(json.dumps({"model": args.name, "version": target, **record}, indent=2))
    return rc


def run_profile(args: argparse.Namespace) -> int:
    """Top operators by time per batch size: ONNX Runtime's profiler, or torch's for a
    PyTorch version (which needs torch where the CLI runs)."""
    try:
        batches = [int(b) for b in args.batch.split(",") if b]
    except ValueError:
        return models._fail(f"--batch wants sizes like 1,8,32, got {args.batch!r}")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            source, config, src = _fetch(args, Path(tmp))
        except grpc.RpcError as exc:
            return models._fail(f"{args.name} {args.version}: {rpc_error_text(exc, '')}")
        except (ValueError, OSError) as exc:
            return models._fail(str(exc))
        try:
            parsed = ModelConfig.model_validate(config)
        except ValueError as exc:
            return models._fail(f"{args.name} {source}: its config does not parse here: {exc}")
        if parsed.engine.kind == "pytorch":
            try:
                result = torchprofile.profile_batches(
                    src, parsed, batches, what=f"{args.name} {source}", top=args.top
                )
            except torchprofile.TorchMissing as exc:
                return models._fail(str(exc))
        else:
            result = {
                str(b): optimize.profile_ops(src, optimize.sample_inputs(src, b), top=args.top)
                for b in batches
            }
    if args.json:
        print(json.dumps({"model": args.name, "version": source, "batches": result}, indent=2))
        return 0
    for batch, ops in result.items():
        print(f"{args.name} {source} batch {batch}:")
        for op in ops:
            print(
                f"  {op['op']:<24} {op['per_run_us']:>10.1f} us/run "
                f"{op['share'] * 100:5.1f}%  ({op['calls']} calls)"
            )
    return 0
