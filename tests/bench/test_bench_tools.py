"""The benchmark's own tools: hand-written sections of the report, and the sampler.

``bench/render.py`` keeps hand-written files (findings, performance notes,
observability overhead) as marked blocks in ``docs/benchmarks.md`` so that a
re-render keeps them and ``--refresh`` updates them without a benchmark run.
``bench/sampler/sitecustomize.py`` is the in-process profiler hook that
``bench/profile_stack.py`` puts into every service.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


def _bench_module(name: str):
    """Import a script of ``bench/`` (they import each other by bare name)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


def _render_module():
    return _bench_module("render")


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


# ------------------------------------------------- CPU and bus messages per request


def test_parse_stat_splits_after_the_last_parenthesis_of_the_command_name():
    cpu_window = _bench_module("cpu_window")
    # A command name may hold spaces and parentheses; fields after it are fixed.
    line = "4242 (a (b) c) S 17 4242 4242 0 -1 4194560 1 0 0 0 750 125 3 4 20 0 3 0 9 1 1\n"
    stat = cpu_window.parse_stat(line)
    assert (stat.pid, stat.comm, stat.ppid, stat.session) == (4242, "a (b) c", 17, 4242)
    assert stat.cpu_ticks == 750 + 125  # utime + stime, not the children's 3 + 4
    for bad in ("", "4242 no parens S 1", "4242 (x) S 1 2"):
        with pytest.raises(ValueError, match="not a /proc"):
            cpu_window.parse_stat(bad)


def test_read_stat_of_this_process_and_of_a_gone_one():
    cpu_window = _bench_module("cpu_window")
    me = cpu_window.read_stat(os.getpid())
    assert me is not None and me.pid == os.getpid() and me.ppid == os.getppid()
    done = subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert done.returncode == 0
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert cpu_window.read_stat(gone.pid) is None
    with pytest.raises(ProcessLookupError):
        cpu_window.proc_cpu_s(gone.pid)


def _stat(cpu_window, pid: int, ppid: int, session: int, comm: str = "p", ticks: int = 0):
    return cpu_window.ProcStat(pid=pid, comm=comm, ppid=ppid, session=session, cpu_ticks=ticks)


def test_process_tree_follows_parents_and_the_root_s_session():
    cpu_window = _bench_module("cpu_window")
    stats = {
        s.pid: s
        for s in (
            _stat(cpu_window, 1, 0, 1),
            _stat(cpu_window, 100, 1, 100),  # the root, leads its session
            _stat(cpu_window, 101, 100, 100),
            _stat(cpu_window, 102, 101, 100),  # grandchild
            _stat(cpu_window, 103, 1, 100),  # reparented to init, same session
            _stat(cpu_window, 104, 101, 104),  # its own session, still a descendant
            _stat(cpu_window, 200, 1, 200),  # unrelated
        )
    }
    assert cpu_window.process_tree(100, stats) == [100, 101, 102, 103, 104]
    assert cpu_window.process_tree(101, stats) == [101, 102, 104]  # no session of its own
    assert cpu_window.process_tree(999, stats) == []


def test_window_figures_divide_cpu_and_messages_by_answered_requests():
    cpu_window = _bench_module("cpu_window")
    snap = cpu_window.Snapshot
    start = snap(
        t=10.0,
        procs={
            "gateway": {10: ("python", 100)},
            "nats-server": {20: ("nats-server", 0)},
            "triton": {30: ("python", 0), 31: ("tritonserver", 50), 32: ("stub", 7)},
            "gone": {40: ("python", 5)},
        },
        msgs=(1_000, 2_000),
        hz=100,
    )
    end = snap(
        t=12.0,
        procs={
            "gateway": {10: ("python", 150)},
            "nats-server": {20: ("nats-server", 25)},
            # 32 exited in the window; 33 was born in it and counts from zero.
            "triton": {30: ("python", 10), 31: ("tritonserver", 60), 33: ("stub", 5)},
            "gone": {},
        },
        msgs=(4_000, 5_600),
        hz=100,
    )
    # 500 req/s over 2 s: 1,000 requests answered.
    fig = cpu_window.window_figures(start, end, rps=500.0)
    assert fig["window_s"] == 2.0
    assert fig["cpu_us_per_req"]["gateway"] == 500.0  # 0.5 s / 1,000
    assert fig["cpu_us_per_req"]["nats-server"] == 250.0
    assert fig["cpu_us_per_req"]["triton"] == 250.0  # (10 + 10 + 5) ticks
    assert "gone" not in fig["cpu_us_per_req"]
    assert fig["busy_core"]["gateway"] == 0.25
    assert fig["total_cpu_us_per_req"] == 1000.0
    assert fig["msgs_in_per_req"] == 3.0
    assert fig["msgs_out_per_req"] == 3.6
    assert ["triton", "stub", 33, 50.0] in fig["processes"]
    assert fig["found"]["triton"] == {"python": 1, "tritonserver": 1, "stub": 1}
    assert any("stub[32] exited" in n for n in fig["notes"])
    assert any(n.startswith("gone: process not found") for n in fig["notes"])
    # Nothing answered: no per-request figure rather than a division by zero.
    idle = cpu_window.window_figures(start, end, rps=0.0)
    assert idle["total_cpu_us_per_req"] is None and "msgs_in_per_req" not in idle
    assert cpu_window.per_request_us(1.0, 0.0, 2.0) is None
    assert cpu_window.per_request_us(0.3, 100.0, 3.0) == pytest.approx(1000.0)


def test_missing_processes_names_what_a_peer_tree_lacks():
    cpu_window = _bench_module("cpu_window")
    found = {"triton": {"python": 1, "tritonserver": 1, "triton_python_b": 1}}
    expect = {"triton": {"tritonserver": 1, "triton_python_b": 2}, "mlserver": {"mlserver": 1}}
    notes = cpu_window.missing_processes(found, expect)
    assert len(notes) == 2
    assert "expected 2 'triton_python_b' process(es) in its tree, found 1" in notes[0]
    assert notes[1].startswith("mlserver: expected 1 'mlserver'") and "tree: none" in notes[1]
    # A prefix counts every command name it starts.
    assert cpu_window.missing_processes(found, {"triton": {"triton": 2}}) == []


def test_snapshot_of_a_real_process_tree_sees_a_busy_grandchild(tmp_path: Path):
    cpu_window = _bench_module("cpu_window")
    # parent → child → grandchild; the grandchild burns CPU until the file appears.
    stop = tmp_path / "stop"
    spin = (
        f"import pathlib\nwhile not pathlib.Path({str(stop)!r}).exists():\n    sum(range(10000))\n"
    )
    child = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', {!r}])\n"
    root = subprocess.Popen(
        [sys.executable, "-c", child.format(child.format(spin))], start_new_session=True
    )
    try:
        sampler = cpu_window.WindowSampler({"server": root.pid})
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            stats = cpu_window.all_stats()
            tree = cpu_window.process_tree(root.pid, stats)
            if len(tree) == 3:
                break
            time.sleep(0.05)
        assert len(tree) == 3
        (grandchild,) = [p for p in tree[1:] if stats[p].ppid != root.pid]
        sampler.mark("measured")  # an end without a start is ignored
        assert sampler.figures(100.0) is None
        sampler.mark("measuring")
        start_ticks = sampler.start.procs["server"][grandchild][1]
        while time.monotonic() < deadline:
            stat = cpu_window.read_stat(grandchild)
            if stat is not None and stat.cpu_ticks > start_ticks:
                break
            time.sleep(0.05)
        sampler.mark("measured")
    finally:
        stop.write_text("")
        assert root.wait(timeout=20) == 0
    fig = sampler.figures(100.0)
    assert fig is not None
    assert fig["found"]["server"] and sum(fig["found"]["server"].values()) == 3
    assert fig["cpu_us_per_req"]["server"] > 0
    assert any(pid == grandchild for _, _, pid, _ in fig["processes"])


def test_sampler_says_when_nats_server_could_not_be_read():
    cpu_window = _bench_module("cpu_window")
    sampler = cpu_window.WindowSampler({"me": os.getpid(), "gone": 0}, msgs=lambda: None)
    sampler.mark("measuring")
    sampler.mark("measured")
    fig = sampler.figures(10.0)
    assert fig is not None and "msgs_in_per_req" not in fig
    assert "gone: process not found at the end" in fig["notes"]
    assert fig["notes"][-1] == "nats-server's /varz was unreadable: no bus message figures"
    assert fig["found"]["me"]  # this process, whatever its command name


def test_run_json_reports_marks_as_they_come_and_kills_on_timeout(tmp_path: Path):
    run_all = _bench_module("run_all")
    loadgen = _bench_module("loadgen")
    runner = run_all.Runner(tmp_path / "r.jsonl", run_all.QUICK)
    script = (
        "import sys\n"
        f"print({loadgen.MARK!r} + 'measuring', file=sys.stderr, flush=True)\n"
        "print('some log line', file=sys.stderr)\n"
        "print('{\"ok\": 1}')\n"
        f"print({loadgen.MARK!r} + 'measured', file=sys.stderr, flush=True)\n"
    )
    marks: list[str] = []
    lines = runner.run_json([sys.executable, "-c", script], on_mark=marks.append)
    assert lines == [{"ok": 1}]
    assert marks == ["measuring", "measured"]
    failing = "import sys\nprint('boom', file=sys.stderr)\nsys.exit(3)\n"
    with pytest.raises(RuntimeError, match="boom"):
        runner.run_json([sys.executable, "-c", failing])
    with pytest.raises(subprocess.TimeoutExpired):
        runner.run_json([sys.executable, "-c", "import time\ntime.sleep(60)"], timeout=0.5)


# ------------------------------------------------------------- issue 18 targets


def _loadgen(target: str, model: str, c: int, rps: float, p50: float, p99: float) -> dict:
    return {
        "kind": "loadgen",
        "target": target,
        "model": model,
        "concurrency": c,
        "label": f"{target}/{model}/c{c}",
        "throughput_rps": rps,
        "throughput_rows_s": rps,
        "errors": {},
        "window_s": 3.0,
        "latency_ms": {"mean": p50, "p50": p50, "p90": p99, "p99": p99, "max": p99},
        "stages": {},
        "machine": {},
    }


def _cpu(target: str, model: str, c: int, groups: dict[str, float], **extra) -> dict:
    return {
        "kind": "platform_cpu",
        "target": target,
        "model": model,
        "concurrency": c,
        "label": f"{target}/{model}/c{c}",
        "window_s": 3.0,
        "cpu_us_per_req": groups,
        "busy_core": {g: round(us * 1e-6 * 1000, 3) for g, us in groups.items()},
        "total_cpu_us_per_req": sum(groups.values()),
        "processes": [[g, g, i, us] for i, (g, us) in enumerate(groups.items())],
        "notes": [],
    } | extra


def _synthetic_results(path: Path) -> Path:
    raw = {
        "kind": "raw_ort",
        "threads": 1,
        "threads_effective": 1,
        "batch1": {"latency_ms": {"p50": 0.1, "p99": 0.2}, "throughput_rps": 9000.0},
        "batched": {"throughput_rows_s": 90000.0, "latency_ms": {"p50": 0.3, "p99": 0.4}},
    }
    records = [
        {"kind": "run", "command": "synthetic", "plan": {}, "machine": {}},
        raw | {"model": "fraud"},
        raw | {"model": "heavy"},
        # fraud: ahead of Triton on throughput and p99, behind at c=1.
        _loadgen("inferbus", "fraud", 1, 900.0, 0.6, 1.0),
        _loadgen("inferbus", "fraud", 64, 3000.0, 18.0, 40.0),
        _loadgen("triton", "fraud", 1, 1000.0, 0.5, 0.9),
        _loadgen("triton", "fraud", 64, 2500.0, 20.0, 50.0),
        _loadgen("mlserver", "fraud", 64, 1000.0, 60.0, 90.0),
        # heavy: behind Triton, no MLServer and no c=1 runs.
        _loadgen("inferbus", "heavy", 64, 1500.0, 40.0, 80.0),
        _loadgen("triton", "heavy", 64, 2000.0, 30.0, 60.0),
        *(
            _cpu(
                "inferbus",
                model,
                64,
                dict(zip(("gateway", "batcher", "worker0", "nats-server"), us, strict=True)),
                msgs_in_per_req=msgs_in,
                msgs_out_per_req=msgs_out,
            )
            for model, us, msgs_in, msgs_out in (
                ("fraud", (250.0, 100.0, 80.0, 70.0), 0.8, 0.9),  # 500 µs/req
                ("heavy", (400.0, 150.0, 200.0, 90.0), 1.4, 1.2),  # 840 µs/req
            )
        ),
        _cpu("triton", "fraud", 64, {"triton": 550.0}),
        _cpu("triton", "heavy", 64, {"triton": 700.0}, notes=["triton: a note"]),
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_targets_table_says_which_of_issue_18_s_targets_a_run_met(tmp_path: Path):
    render = _render_module()
    res = render.Results(render.load(_synthetic_results(tmp_path / "run.jsonl")))
    rows = {(r.model, r.target): r for r in render.target_rows(res)}
    met = {key: (r.met, r.measured) for key, r in rows.items()}

    assert met[("fraud", "c=64 throughput ≥ 1.0× Triton's")] == (True, True)
    assert "1.20×" in rows[("fraud", "c=64 throughput ≥ 1.0× Triton's")].inferbus
    assert met[("heavy", "c=64 throughput ≥ 1.0× Triton's")] == (False, True)
    assert met[("fraud", "c=64 p99 ≤ Triton's")] == (True, True)
    assert met[("heavy", "c=64 p99 ≤ Triton's")] == (False, True)
    assert met[("fraud", "c=64 throughput ≥ 2.0× MLServer's")] == (True, True)
    assert met[("heavy", "c=64 throughput ≥ 2.0× MLServer's")] == (None, False)
    cpu_fraud = rows[("fraud", "platform CPU per request at c=64 ≤ 600 µs")]
    assert (cpu_fraud.met, cpu_fraud.inferbus) == (True, "**500 µs/req**")
    assert "Triton 550 µs/req" in cpu_fraud.compared
    assert "MLServer not measured" in cpu_fraud.compared
    assert met[("heavy", "platform CPU per request at c=64 ≤ 600 µs")] == (False, True)
    msgs = "bus messages per request at c=64 ≤ 1.0 (published to nats-server)"
    assert met[("fraud", msgs)] == (True, True)
    assert "0.90 delivered" in rows[("fraud", msgs)].compared
    assert met[("heavy", msgs)] == (False, True)
    assert met[("fraud", "c=1 p50 ≤ Triton's")] == (False, True)
    assert met[("heavy", "c=1 p50 ≤ Triton's")] == (None, False)
    added = rows[("fraud", "c=1 added p50 over raw onnxruntime (reported)")]
    assert (added.met, added.measured, added.inferbus) == (None, True, "+0.500 ms")

    table = "\n".join(render.section_targets(res))
    assert "| c=64 throughput ≥ 1.0× Triton's | heavy |" in table
    body = table.split("|---|---|---|---|---|\n", 1)[1].splitlines()
    verdicts = Counter(line.rsplit("|", 2)[1].strip() for line in body)
    assert verdicts == {"**no**": 5, "yes": 5, "not measured": 3, "reported": 1}
    # A CPU figure that misses a process says so.
    res.cpu[("inferbus", "heavy", 64)]["notes"] = ["worker1: process not found at the end"]
    (heavy_cpu,) = [r for r in render.target_rows(res) if r.model == "heavy" and "CPU" in r.target]
    assert heavy_cpu.inferbus.startswith("**840 µs/req** (incomplete")
    summary = render.target_summary(res)
    assert len(summary) == 14 and summary[0].startswith("yes ")


def test_rendered_page_opens_with_the_targets_and_the_per_process_cpu(tmp_path: Path):
    render = _render_module()
    records = render.load(_synthetic_results(tmp_path / "run.jsonl"))
    page = render.render(records, tmp_path / "benchmarks.md")
    targets = page.index("## Targets (issue 18) in this run")
    cpu = page.index("## CPU per request at c=64, by process")
    assert targets < cpu < page.index("## Machine and run") < page.index("## Serving")
    cpu_section = page[cpu : page.index("## Machine and run")]
    assert "| gateway | 250 | 0.25 | 400 | 0.40 |" in cpu_section
    assert "| **inferbus total** | **500** |" in cpu_section
    assert "| Triton (whole tree) | 550 |" in cpu_section
    assert "* Triton heavy: triton: a note" in cpu_section
    # The serving table carries CPU and bus messages per request.
    assert "| fraud | inferbus | 64 | 3,000.0 |" in page
    assert "| 500 | 0.80 / 0.90 |" in page
    # An old results file without CPU records still renders.
    old = [r for r in records if r["kind"] != "platform_cpu"]
    old_page = render.render(old, tmp_path / "old.md")
    assert "## CPU per request at c=64, by process\n\nNot measured in this run." in old_page
    assert "not measured" in old_page


def test_chunk_frames_bench_delivers_every_chunk_both_ways(nats_server) -> None:
    """`bench/chunk_frames.py`: every stream reads all its chunks, in order, whether
    the publisher sends one message per chunk or one frame per step (the run
    asserts the counts), and the figure is a CPU time per chunk."""
    import asyncio

    frames = _bench_module("chunk_frames")
    for n, arm in enumerate(("single", "frames")):
        us = asyncio.run(frames.one_run(nats_server.url, arm, 3, 20, 1000 + n))
        assert 0 < us < 1e5, (arm, us)
