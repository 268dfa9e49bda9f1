"""The sandboxed preprocessor.py pool (issue 27), without a stack: results, the
deadline, a crash, an exception, the sandbox, results checked against the config."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from inferbus_common.codec import tensor_from_numpy
from inferbus_common.modelconfig import ModelConfig
from inferbus_worker.scriptpool import (
    PRE,
    ScriptFailure,
    ScriptLimits,
    ScriptLoadError,
    ScriptPool,
    ScriptProcessing,
)

SCRIPT = """
import os, socket

def preprocess(inputs):
    x = inputs["x"]
    mark = float(x[0, 0])
    if mark == 1:
        while True:
            pass
    if mark == 2:
        os._exit(3)
    if mark == 3:
        raise ValueError("bad row")
    if mark == 4:
        socket.create_connection(("1.1.1.1", 53), timeout=1)
    if mark == 5:
        open(__file__, "a").write("#")
    if mark == 6:
        return {"x": x[:1]}
    x *= 2
    return {"x": x}
"""

CONFIG = ModelConfig.model_validate(
    {
        "name": "m",
        "max_batch_size": 8,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 3]}],
        "processing": {"python": "preprocessor.py"},
    }
)


@pytest.fixture
async def script(tmp_path: Path) -> AsyncIterator[ScriptProcessing]:
    (tmp_path / "preprocessor.py").write_text(SCRIPT)
    pool = ScriptPool(tmp_path, "preprocessor.py", "m/1", ScriptLimits(pool_size=1))
    await pool.start()
    try:
        yield ScriptProcessing(CONFIG, pool)
    finally:
        await pool.close()


def _batch(mark: float) -> dict[str, np.ndarray]:
    x = np.ones((2, 3), np.float32)
    x[0, 0] = mark
    return {"x": x}


async def test_result_and_recovery_after_each_failure(script: ScriptProcessing) -> None:
    assert script.has_pre and not script.has_post
    out = await script.pre(_batch(9), 2, time.monotonic() + 10)
    np.testing.assert_array_equal(out["x"][0], [18, 2, 2])

    t0 = time.monotonic()
    with pytest.raises(ScriptFailure, match=r"m/1: preprocessor.py preprocess\(\): timed out"):
        await script.pre(_batch(1), 2, time.monotonic() + 0.3)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(ScriptFailure, match="exited with code 3"):
        await script.pre(_batch(2), 2, time.monotonic() + 10)
    with pytest.raises(ScriptFailure, match=r"raised ValueError: bad row \(preprocessor.py:"):
        await script.pre(_batch(3), 2, time.monotonic() + 10)
    with pytest.raises(ScriptFailure, match="1 rows for a batch of 2"):
        await script.pre(_batch(6), 2, time.monotonic() + 10)
    assert script.pool.replaced == 2
    out = await script.pre(_batch(9), 2, time.monotonic() + 10)
    assert out["x"][0, 0] == 18


async def test_sandbox_blocks_network_and_writes(script: ScriptProcessing) -> None:
    if script.pool.sandbox["network"] != "isolated":
        pytest.skip(f"no namespaces here: {script.pool.sandbox['problems']}")
    with pytest.raises(ScriptFailure, match="Network is unreachable"):
        await script.pre(_batch(4), 2, time.monotonic() + 10)
    with pytest.raises(ScriptFailure, match="Read-only file system"):
        await script.pre(_batch(5), 2, time.monotonic() + 10)
    assert script.pool.sandbox["capabilities"] == "dropped"


async def test_import_error_fails_the_load(tmp_path: Path) -> None:
    (tmp_path / "preprocessor.py").write_text("import not_a_module_here\n")
    pool = ScriptPool(tmp_path, "preprocessor.py", "m/1", ScriptLimits(pool_size=1))
    with pytest.raises(ScriptLoadError, match="ModuleNotFoundError"):
        await pool.start()


async def test_environment_is_clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERBUS_SECRET_FOR_TEST", "hunter2")
    (tmp_path / "preprocessor.py").write_text(
        "import os\nimport numpy as np\n"
        "def preprocess(i):\n"
        "    return {'x': i['x'] + len(os.environ.get('INFERBUS_SECRET_FOR_TEST', ''))}\n"
    )
    pool = ScriptPool(tmp_path, "preprocessor.py", "m/1", ScriptLimits(pool_size=1))
    await pool.start()
    try:
        (out,) = await pool.call(
            PRE, [tensor_from_numpy("x", np.zeros((1, 3), np.float32))], time.monotonic() + 10
        )
    finally:
        await pool.close()
    assert out.as_numpy().sum() == 0
