"""``inferbus models push|list|get|alias|archive|unarchive|delete|download|wait``.

The registry (versions, aliases, lifecycle, artifacts) and model readiness.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from inferbus_cli.progress import ProgressBar
from inferbus_cli.rpc import (
    check_gateway_stack,
    inference_stub,
    registry_channel,
    registry_stub,
    rpc_error_text,
)
from inferbus_cli.state import (
    default_gateway_address,
    default_registry_address,
    expected_stack,
    resolve_home,
)
from inferbus_cli.table import format_table
from inferbus_client.artifacts import PushError, VerifiedFile, collect_files, push_messages
from inferbus_common.modelconfig import ModelConfig
from inferbus_proto.registry import registry_pb2 as rpb
from inferbus_proto.registry import registry_pb2_grpc
from inferbus_proto.v2 import grpc_predict_v2_pb2 as pb


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def version_to_json(info: rpb.VersionInfo) -> dict[str, Any]:
    """A VersionInfo as a JSON-ready dict (config and manifest parsed)."""

    def parse(raw: bytes) -> Any:
        try:
            return json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return raw.decode("utf-8", errors="replace")

    return {
        "model": info.model,
        "version": info.version,
        "digest": info.digest,
        "aliases": list(info.aliases),
        "created_unix_ms": info.created_unix_ms,
        "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in info.files],
        "config": parse(info.config_json),
        "manifest": parse(info.manifest_json),
    }


def model_to_json(info: rpb.ModelInfo) -> dict[str, Any]:
    """A ModelInfo as a JSON-ready dict."""
    return {
        "name": info.name,
        "versions": list(info.versions),
        "aliases": dict(info.aliases),
        "archived": list(info.archived),
        "unloaded": info.unloaded,
        "numbers": dict(info.numbers),
    }


def _registry_address(args: argparse.Namespace) -> str:
    return args.registry or default_registry_address(resolve_home(args.home))


def _stack(args: argparse.Namespace, address: str) -> str:
    """The stack id `address` must belong to (the state file's, when it is its endpoint)."""
    return expected_stack(resolve_home(args.home), address)


def run_push(args: argparse.Namespace) -> int:
    """Upload a version; print its digest."""
    address = _registry_address(args)
    try:
        config_bytes, files = collect_files(
            Path(args.path), Path(args.config) if args.config else None, derive=True
        )
    except PushError as exc:
        return _fail(str(exc))
    total = sum(p.stat().st_size for _, p in files)
    print(
        f"pushing {args.name} version {args.version} ({len(files)} file(s), {total} bytes) "
        f"to {address}",
        file=sys.stderr,
    )
    bar = ProgressBar(total, f"push {args.name} {args.version}", enabled=_progress(args))
    with registry_channel(address, _stack(args, address)) as channel:
        try:
            info = registry_stub(channel).PushVersion(
                push_messages(
                    args.name, args.version, config_bytes, args.alias, files, bar.advance
                ),
                timeout=args.timeout,
            )
        except grpc.RpcError as exc:
            bar.close()  # end the bar's line before the error
            return _fail(f"PushVersion: {rpc_error_text(exc, address)}")
        finally:
            bar.close()
    conversion = conversion_summary(info)
    if conversion:
        print(conversion, file=sys.stderr)
    if not config_bytes:
        # Said on stderr, so --json output stays one document.
        print(derived_summary(info), file=sys.stderr)
    if args.json:
        print(json.dumps(version_to_json(info), indent=2))
    else:
        aliases = ", ".join(info.aliases) or "-"
        print(f"pushed {info.model} version {info.version} (aliases: {aliases})")
        print(f"digest: {info.digest}")
    return 0


def derived_summary(info: rpb.VersionInfo) -> str:
    """What the registry derived for a version pushed without a config, for a person."""
    config = ModelConfig.model_validate_json(info.config_json)
    lines = [f"no config given: the registry derived it from {config.file}:"]
    for kind, specs in (("input", config.inputs), ("output", config.outputs)):
        for spec in specs:
            lines.append(f"  {kind:6} {spec.name}: {spec.datatype} {spec.shape}")
    if config.max_batch_size > 0:
        lines.append(
            f"  max_batch_size {config.max_batch_size} (every tensor's first dimension is "
            f"symbolic: batched along it; dynamic batching, queue delay "
            f"{config.batching.max_queue_delay_us} us)"
        )
    else:
        lines.append("  max_batch_size 0 (no batch axis: shapes are taken literally)")
    lines.append(
        f"  see it with `inferbus models get {info.model} --version {info.version}`; push a "
        "config.json to change any of it"
    )
    return "\n".join(lines)


def conversion_summary(info: rpb.VersionInfo) -> str:
    """What converting a pushed pickle found (the manifest's ``conversion``), for a person;
    empty for a version pushed as ONNX."""
    try:
        conv = json.loads(info.manifest_json).get("conversion") if info.manifest_json else None
    except json.JSONDecodeError:
        return ""
    if not isinstance(conv, dict):
        return ""
    versions = ", ".join(f"{k} {v}" for k, v in sorted(conv.get("converter", {}).items()))
    diffs = ", ".join(f"{k} {v:.3g}" for k, v in sorted(conv.get("max_abs_diff", {}).items()))
    sample = conv.get("sample", {})
    timings = conv.get("timings_s", {})
    lines = [
        f"converted {conv.get('source')} ({conv.get('estimator')}, {conv.get('task')}, "
        f"{conv.get('n_features')} features) to model.onnx with {versions}"
        + (f" in {timings['total']:.1f} s" if "total" in timings else ""),
        f"  checked against the pickle on {sample.get('rows')} rows ({sample.get('from')}): "
        f"max abs difference {diffs} (tolerance {conv.get('tolerance')})"
        + (f", {conv['label_mismatches']} label(s) differ" if conv.get("label_mismatches") else ""),
        "  stored: model.onnx and conversion.json (the pickle is not kept)",
    ]
    for note in conv.get("warnings", []):
        lines.append(f"  warning: {note}")
    return "\n".join(lines)


def _numbered(version: str, numbers: dict[str, int]) -> str:
    """``1.0.0#1``: a version with its Triton-style number (just the version when it
    is its own number, or has none)."""
    number = numbers.get(version, 0)
    return version if not number or str(number) == version else f"{version}#{number}"


def run_list(args: argparse.Namespace) -> int:
    """List every model with its versions and aliases."""
    address = _registry_address(args)
    with registry_channel(address, _stack(args, address)) as channel:
        try:
            resp = registry_stub(channel).ListModels(rpb.ListModelsRequest(), timeout=args.timeout)
        except grpc.RpcError as exc:
            return _fail(f"ListModels: {rpc_error_text(exc, address)}")
    models = [model_to_json(m) for m in resp.models]
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    if not models:
        print("no models (push one with `inferbus models push`)")
        return 0
    rows = [
        [
            m["name"],
            # Each version with its Triton-style number, e.g. 1.0.0#1 (perf_analyzer -x 1).
            ",".join(_numbered(v, m["numbers"]) for v in m["versions"]) or "-",
            ",".join(f"{a}={v}" for a, v in sorted(m["aliases"].items())) or "-",
            ",".join(m["archived"]) or "-",
            "unloaded" if m["unloaded"] else "yes",
        ]
        for m in models
    ]
    print(format_table(["MODEL", "VERSIONS", "ALIASES", "ARCHIVED", "SERVING"], rows))
    return 0


def run_get(args: argparse.Namespace) -> int:
    """Print one version (number or alias; default `stable`) as JSON."""
    address = _registry_address(args)
    with registry_channel(address, _stack(args, address)) as channel:
        try:
            info = registry_stub(channel).GetVersion(
                rpb.GetVersionRequest(model=args.name, version=args.version or ""),
                timeout=args.timeout,
            )
        except grpc.RpcError as exc:
            return _fail(f"GetVersion {args.name}: {rpc_error_text(exc, address)}")
    print(json.dumps(version_to_json(info), indent=2))
    return 0


def run_alias(args: argparse.Namespace) -> int:
    """Point an alias at a version."""
    address = _registry_address(args)
    with registry_channel(address, _stack(args, address)) as channel:
        try:
            info = registry_stub(channel).SetAlias(
                rpb.SetAliasRequest(
                    model=args.name,
                    alias=args.alias,
                    version=args.version,
                    force=getattr(args, "force", False),
                ),
                timeout=args.timeout,
            )
        except grpc.RpcError as exc:
            return _fail(f"SetAlias {args.name}: {rpc_error_text(exc, address)}")
    aliases = ", ".join(f"{a}={v}" for a, v in sorted(info.aliases.items())) or "-"
    print(f"{info.name}: aliases {aliases}")
    return 0


def run_wait(args: argparse.Namespace) -> int:
    """Poll the gateway's ModelReady until the model is ready or the timeout passes."""
    home = resolve_home(args.home)
    address = args.url or default_gateway_address(home)
    deadline = time.monotonic() + args.timeout
    last = "not asked yet"
    with registry_channel(address, _stack(args, address)) as channel:
        try:
            check_gateway_stack(channel, _stack(args, address))
        except grpc.RpcError as exc:
            return _fail(rpc_error_text(exc, address))
        stub = inference_stub(channel)
        while True:
            try:
                resp = stub.ModelReady(
                    pb.ModelReadyRequest(name=args.name, version=args.version or ""), timeout=2.0
                )
            except grpc.RpcError as exc:
                last = rpc_error_text(exc, address)
            else:
                if resp.ready:
                    label = f"{args.name} version {args.version}" if args.version else args.name
                    print(f"{label} is ready")
                    return 0
                last = "ModelReady answered ready=false"
            if time.monotonic() > deadline:
                return _fail(
                    f"{args.name} is not ready after {args.timeout:g}s (last answer: {last}); "
                    f"look at the worker and registry logs in {home / 'logs'} "
                    f"(e.g. tail {home / 'logs' / 'worker-1.log'})"
                )
            time.sleep(args.interval)


def _progress(args: argparse.Namespace) -> bool | None:
    """True with ``--progress``, else None: draw only when stderr is a terminal."""
    return True if getattr(args, "progress", False) else None


def _lifecycle(args: argparse.Namespace, rpc: str, request: object) -> int:
    address = _registry_address(args)
    with registry_channel(address, _stack(args, address)) as channel:
        try:
            info = getattr(registry_stub(channel), rpc)(request, timeout=args.timeout)
        except grpc.RpcError as exc:
            return _fail(f"{rpc} {args.name} {args.version}: {rpc_error_text(exc, address)}")
    if args.json:
        print(json.dumps(model_to_json(info), indent=2))
        return 0
    archived = ", ".join(info.archived) or "-"
    versions = ", ".join(info.versions) or "-"
    print(f"{info.name or args.name}: versions {versions}; archived {archived}")
    return 0


def _who() -> str:
    try:
        return os.getlogin()
    except OSError:
        return os.environ.get("USER", "")


def run_archive(args: argparse.Namespace) -> int:
    """Archive a version: keep its files, take it out of serving."""
    request = rpb.ArchiveVersionRequest(model=args.name, version=args.version, requested_by=_who())
    return _lifecycle(args, "ArchiveVersion", request)


def run_unarchive(args: argparse.Namespace) -> int:
    """Unarchive a version so that it can be aliased and routed again."""
    request = rpb.ArchiveVersionRequest(model=args.name, version=args.version, requested_by=_who())
    return _lifecycle(args, "UnarchiveVersion", request)


def run_delete(args: argparse.Namespace) -> int:
    """Delete a version's files and catalog entry (asks unless --yes)."""
    if not args.yes:
        if not sys.stdin.isatty():
            return _fail("refusing to delete without --yes (stdin is not a terminal)")
        answer = input(f"delete {args.name} version {args.version} and its files? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("not deleted", file=sys.stderr)
            return 1
    request = rpb.DeleteVersionRequest(model=args.name, version=args.version, requested_by=_who())
    return _lifecycle(args, "DeleteVersion", request)


def download_file(
    stub: registry_pb2_grpc.RegistryStub,
    model: str,
    version: str,
    path: str,
    dest: Path,
    *,
    timeout: float | None,
    progress: bool | None = None,
) -> tuple[Path, ProgressBar]:
    """Stream one file of a version into `dest`, checking its SHA-256 and size
    (`inferbus_client.artifacts.VerifiedFile`). Returns `dest` and the progress
    bar (its ``done`` is the byte count received).

    Raises:
        grpc.RpcError: the registry refused or failed.
        ValueError: the bytes do not match the manifest.
    """
    info = stub.GetVersion(rpb.GetVersionRequest(model=model, version=version), timeout=timeout)
    entry = next((f for f in info.files if f.path == path), None)
    if entry is None:
        files = sorted(f.path for f in info.files)
        raise ValueError(f"{model} {info.version} has no file {path!r}; files: {files}")
    bar = ProgressBar(entry.size, f"download {path}", enabled=progress)
    request = rpb.DownloadFileRequest(model=model, version=info.version, path=path)
    with bar, VerifiedFile(dest, entry.sha256, entry.size, label=path) as out:
        for chunk in stub.DownloadFile(request, timeout=timeout):
            out.write(chunk.data)
            bar.advance(len(chunk.data))
    return dest, bar


def run_download(args: argparse.Namespace) -> int:
    """Download one artifact file of a version (default: the config's model file)."""
    address = _registry_address(args)
    with registry_channel(address, _stack(args, address)) as channel:
        stub = registry_stub(channel)
        try:
            path = args.file
            if not path:
                info = stub.GetVersion(
                    rpb.GetVersionRequest(model=args.name, version=args.version or ""),
                    timeout=args.timeout,
                )
                path = json.loads(info.config_json).get("file", "model.onnx")
            out = Path(args.output) if args.output else Path(Path(path).name)
            if out.is_dir():
                out = out / Path(path).name
            dest, bar = download_file(
                stub,
                args.name,
                args.version or "",
                path,
                out,
                timeout=args.timeout,
                progress=_progress(args),
            )
        except grpc.RpcError as exc:
            return _fail(f"DownloadFile {args.name}: {rpc_error_text(exc, address)}")
        except (ValueError, OSError) as exc:
            return _fail(str(exc))
    print(f"{dest} ({bar.done} bytes, SHA-256 checked)")
    return 0
