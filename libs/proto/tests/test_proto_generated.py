"""The committed generated protobuf code equals what `generate.sh` produces now.

Runs the real `libs/proto/generate.sh` (grpc_tools.protoc plus the
descriptor-pool post-processing) on a copy of the protos in a temp dir and
compares every output file byte for byte, so a `.proto` edit without
regeneration, or a hand edit of generated code, fails here.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROTO_ROOT = Path(__file__).resolve().parents[1]
COMMITTED = PROTO_ROOT / "src"


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of libs/proto with src/ regenerated from scratch; returns its src/."""
    work = tmp_path_factory.mktemp("proto")
    for name in ("generate.sh", "isolate_pool.py"):
        if (PROTO_ROOT / name).exists():
            shutil.copy2(PROTO_ROOT / name, work / name)
    shutil.copytree(PROTO_ROOT / "protos", work / "protos")
    (work / "src").mkdir()
    result = subprocess.run(
        ["bash", str(work / "generate.sh")],
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"generate.sh failed:\n{result.stdout}\n{result.stderr}"
    return work / "src"


def _generated_files(src: Path) -> list[Path]:
    return sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file())


def test_generation_produces_stubs_for_every_proto(regenerated: Path) -> None:
    protos = sorted((PROTO_ROOT / "protos").rglob("*.proto"))
    assert protos, "no .proto files found"
    files = {str(p) for p in _generated_files(regenerated)}
    for proto in protos:
        stem = str(proto.relative_to(PROTO_ROOT / "protos").with_suffix(""))
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert stem + suffix in files


def test_committed_generated_code_matches(regenerated: Path) -> None:
    stale = []
    for rel in _generated_files(regenerated):
        committed = COMMITTED / rel
        if not committed.exists():
            stale.append(f"{rel}: missing from the repo")
        elif committed.read_bytes() != (regenerated / rel).read_bytes():
            stale.append(f"{rel}: differs")
    assert not stale, "generated code is out of date; run `bash libs/proto/generate.sh`:\n" + (
        "\n".join(stale)
    )


def test_no_orphan_generated_files(regenerated: Path) -> None:
    # A deleted .proto must not leave its old stubs behind in the repo.
    expected = {str(p) for p in _generated_files(regenerated)}
    orphans = [
        str(p.relative_to(COMMITTED))
        for p in COMMITTED.rglob("*_pb2*.py*")
        if "__pycache__" not in p.parts and str(p.relative_to(COMMITTED)) not in expected
    ]
    assert not orphans, f"generated files without a .proto: {orphans}"
