"""Post-process generated `_pb2.py` files to register in inferbus's own pool.

Triton's `tritonclient` registers the same KServe message names
(`inference.ModelInferRequest`, ...) in protobuf's default descriptor pool, so
both cannot be imported into one process as generated. Registering ours in a
private pool (`inferbus_proto._pool.POOL`) lets a program (or a test suite)
use Triton's client and inferbus's stubs side by side. The wire format is
unaffected. Called by `generate.sh`.
"""

from __future__ import annotations

import sys
from pathlib import Path

DEFAULT = "_descriptor_pool.Default().AddSerializedFile("
PRIVATE = "_POOL.AddSerializedFile("
IMPORT = "from inferbus_proto._pool import POOL as _POOL\n"


def isolate(path: Path) -> None:
    """Rewrite one generated module in place (idempotent)."""
    text = path.read_text()
    if DEFAULT not in text:
        return
    text = text.replace(DEFAULT, PRIVATE)
    marker = "from google.protobuf.internal import builder as _builder\n"
    text = text.replace(marker, marker + IMPORT, 1)
    path.write_text(text)


def main(root: str) -> None:
    """Rewrite every `*_pb2.py` below `root`."""
    for path in sorted(Path(root).rglob("*_pb2.py")):
        isolate(path)


if __name__ == "__main__":
    main(sys.argv[1])
