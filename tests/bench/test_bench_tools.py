"""The benchmark's own tools: hand-written sections of the report, and the sampler.

``bench/render.py`` keeps hand-written files (findings, performance notes,
observability overhead) as marked blocks in ``docs/benchmarks.md`` so that a
re-render keeps them and ``--refresh`` updates them without a benchmark run.
``bench/sampler/sitecustomize.py`` is the in-process profiler hook that
``bench/profile_stack.py`` puts into every service.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


def _render_module():
    sys.path.insert(0, str(BENCH))
    try:
        import render
    finally:
        sys.path.remove(str(BENCH))
    return render


def test_refresh_replaces_marked_blocks_and_appends_new_ones(tmp_path: Path):
    render = _render_module()
    findings = tmp_path / "findings.md"
    notes = tmp_path / "notes.md"
    findings.write_text("## Findings\n\nold reading\n")
    page = "\n".join(
        ["# Benchmarks", "", "generated table", "", *render.hand_written(findings), "tail"]
    )
    assert "old reading" in page

    findings.write_text("## Findings\n\nnew reading\n")
    notes.write_text("## Notes\n\nmeasured\n")
    refreshed = render.refresh_hand_written(page, [findings, notes])

    assert "old reading" not in refreshed
    assert refreshed.count("new reading") == 1
    assert "generated table" in refreshed and "tail" in refreshed
    # The new file's block goes at the end; refreshing again changes nothing.
    assert refreshed.rstrip().endswith(render.HAND_WRITTEN_END.format(name=notes.name))
    assert render.refresh_hand_written(refreshed, [findings, notes]) == refreshed


def test_the_committed_page_keeps_its_hand_written_sections():
    render = _render_module()
    page = (REPO / "docs" / "benchmarks.md").read_text()
    paths = [render.DEFAULT_FINDINGS, *render.DEFAULT_APPENDIX]
    for path in paths:
        assert render.HAND_WRITTEN_BEGIN.format(name=render._label(path)) in page, path
    # The page is up to date with the hand-written files.
    assert render.refresh_hand_written(page, paths) == page


def test_sampler_reports_cpu_time_of_a_window(tmp_path: Path):
    script = "import time\nend = time.monotonic() + 3\nwhile time.monotonic() < end:\n    pass\n"
    env = {
        **os.environ,
        "PYTHONPATH": str(BENCH / "sampler"),
        "INFERBUS_SAMPLE_DIR": str(tmp_path),
        "INFERBUS_SAMPLE_MODE": "sample",
    }
    proc = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        (tmp_path / "go").write_text("w1 1.0")
        deadline = time.monotonic() + 10
        meta_path = tmp_path / f"w1-{proc.pid}.json"
        while not meta_path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()
    meta = json.loads(meta_path.read_text())
    assert meta["pid"] == proc.pid
    assert meta["wall_s"] >= 1.0
    assert meta["cpu_s"] > 0.0  # a busy loop, so the window saw CPU time
    stacks = (tmp_path / f"w1-{proc.pid}.txt").read_text()
    assert "<module>" in stacks  # the busy main thread was sampled
