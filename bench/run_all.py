"""Run the whole benchmark on this machine and write ``docs/benchmarks.md``.

One command, side by side in one run, so the ratios compare like with like on
a machine whose load changes:

1. raw onnxruntime in-process (``bench/raw_ort.py``): the limit;
2. the inferbus stack as processes (nats-server, registry, router, batcher,
   two workers, gateway), the example fraud MLP and the heavy MLP, the load
   generator at each concurrency; dynamic batching against a copy of the heavy
   model with ``max_batch_size: 1``; the cold start (push → first prediction);
   a py-spy profile of every service during a c=64 run;
3. the peers, each installed into its own virtualenv under ``bench/.venvs/``:
   Triton (NVIDIA's ``nvidia-pytriton`` wheel) and MLServer, serving the same
   ONNX files with dynamic/adaptive batching, measured by the same client;
4. ``bench/render.py`` turns the results into ``docs/benchmarks.md`` and a plot,
   and the run ends by printing issue 18's targets and whether each was met.

Every measured run also records the server's CPU per answered request over the
load generator's measured window (``kind: platform_cpu``, `cpu_window.py`):
for inferbus each service but the registry and nats-server, plus bus messages
per request from nats-server's ``/varz``; for a peer its whole process tree.

A peer that cannot be installed or started is recorded with the reason and
the run goes on. Results: ``bench/results/run-<timestamp>.jsonl``.

Usage::

    uv run python bench/run_all.py            # full run (about 6-8 minutes)
    uv run python bench/run_all.py --quick    # shorter runs (about 3-4 minutes)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import perf_analyzer as pa
from cpu_window import WindowSampler, missing_processes, nats_msgs
from loadgen import MARK
from record import BENCH_DIR, REPO, RESULTS_DIR, append_result, machine_info
from render import Results, cpu_summary, load, summarize_collapsed, target_summary
from stack import BenchStack

from inferbus_testing.edge import edge_process, find_edge_binary
from inferbus_testing.processes import ServiceError

VENVS = BENCH_DIR / ".venvs"
PYTHON = sys.executable
MODELS = ("fraud", "heavy")
PEER_PACKAGES = {
    # Both peers run the model with onnxruntime; tritonclient is not needed there.
    "pytriton": ["nvidia-pytriton==0.7.0", "onnxruntime", "numpy"],
    # MLServer 1.7's parallel workers break with uvloop 0.22+.
    "mlserver": ["mlserver==1.7.1", "onnxruntime", "numpy", "uvloop<0.22"],
    "tools": ["py-spy"],
}
ENGINE_INSTANCES = 2
"""inferbus workers, Triton model instances, MLServer parallel workers: the same
two engine threads for every server."""
PEER_PROCESSES = {
    # pytriton_server.py (runs the model callables) starts tritonserver, which
    # starts one Python-backend stub per model instance (the stub's name is cut
    # to 15 characters in /proc).
    "triton": {"tritonserver": 1, "triton_python_b": ENGINE_INSTANCES * len(MODELS)},
    # `mlserver start` and its parallel workers (spawned Pythons), which run the model.
    "mlserver": {"mlserver": 1, "python": ENGINE_INSTANCES},
}
"""Processes each peer's tree must hold for its CPU figure to be whole (command
name prefix → at least how many); a shortfall is recorded as a note."""
PYTRITON_HANDSHAKE_S = 10.0
"""PyTriton 0.7.0 gives its Python-backend stub 1 s to hand-shake with the proxy;
on a loaded 2-core machine that fails at random, so the throwaway venv gets 10 s."""


@dataclass(frozen=True)
class Plan:
    """Durations and load levels of one run."""

    duration_s: float
    warmup_s: float
    concurrencies: tuple[int, ...]
    raw_seconds: float
    profile_s: float
    pa_window_ms: int = 4000
    """perf_analyzer's measurement window (``-p``)."""


FULL = Plan(duration_s=8.0, warmup_s=2.0, concurrencies=(1, 16, 64), raw_seconds=2.0, profile_s=6)
QUICK = Plan(
    duration_s=3.0,
    warmup_s=1.0,
    concurrencies=(1, 64),
    raw_seconds=1.0,
    profile_s=3,
    pa_window_ms=2000,
)
VERSION = "1.0.0"
"""The version every inferbus model is pushed as: a semantic version, as the docs show."""
PA_STABILITY = ("--stability-percentage", "20", "--max-trials", "8")
"""perf_analyzer's stability rule for every server alike: three windows in a row
within 20 % of each other, at most 8 windows (its default 10 % rarely settles on a
shared 2-core machine, for any server)."""


class Runner:
    """Runs commands, logs them and appends every result to one JSONL file."""

    def __init__(self, out: Path, plan: Plan) -> None:
        self.out = out
        self.plan = plan
        self.commands: list[str] = []
        self.t0 = time.monotonic()
        self.raw_p50_ms: dict[str, float] = {}
        """Raw onnxruntime batch-1 p50 (1 thread) by model, for the added latency."""

    def log(self, message: str) -> None:
        """Progress line on stderr with the elapsed time."""
        print(f"[{time.monotonic() - self.t0:6.1f}s] {message}", file=sys.stderr, flush=True)

    def record(self, record: dict[str, Any]) -> None:
        """Append a result line."""
        append_result(self.out, record)

    def run_json(
        self,
        argv: Sequence[str],
        timeout: float = 300.0,
        on_mark: Callable[[str], None] | None = None,
    ) -> list[dict[str, Any]]:
        """Run a bench script that prints JSON lines; return them (it appends them itself).

        Args:
            argv: the command.
            timeout: seconds before it is killed (`subprocess.TimeoutExpired`).
            on_mark: called, as they come, with the word after `loadgen.MARK`
                of each mark line the script writes on stderr.
        """
        self.commands.append(shlex.join(argv))
        stderr: list[str] = []
        expired = threading.Event()
        with (
            tempfile.TemporaryFile("w+") as stdout,
            subprocess.Popen(
                argv, stdout=stdout, stderr=subprocess.PIPE, text=True, cwd=REPO
            ) as proc,
        ):

            def expire() -> None:
                expired.set()
                proc.kill()

            timer = threading.Timer(timeout, expire)
            timer.start()
            try:
                assert proc.stderr is not None
                for text in proc.stderr:
                    if not text.startswith(MARK):
                        stderr.append(text)
                    elif on_mark is not None:
                        on_mark(text[len(MARK) :].strip())
            finally:
                timer.cancel()
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            if expired.is_set():
                raise subprocess.TimeoutExpired(list(argv), timeout)
            stdout.seek(0)
            lines = [json.loads(x) for x in stdout.read().splitlines() if x.startswith("{")]
        if proc.returncode != 0 and not lines:
            raise RuntimeError(f"{shlex.join(argv)} failed:\n{''.join(stderr)[-2000:]}")
        return lines

    def loadgen(
        self,
        target: str,
        url: str,
        model: str,
        concurrency: int,
        label: str = "",
        sampler: WindowSampler | None = None,
    ) -> dict[str, Any] | None:
        """One closed-loop run of ``bench/loadgen.py``; None when it produced nothing.

        With a `sampler`, the server's CPU (and bus messages) over the measured
        window are recorded as a ``platform_cpu`` result and printed.
        """
        argv = [
            PYTHON,
            "bench/loadgen.py",
            "--target",
            target,
            "--url",
            url,
            "--model",
            model,
            "--concurrency",
            str(concurrency),
            "--duration",
            str(self.plan.duration_s),
            "--warmup",
            str(self.plan.warmup_s),
            "--label",
            label or f"{target}/{model}/c{concurrency}",
            "--out",
            str(self.out),
            *(["--marks"] if sampler is not None else []),
        ]
        on_mark = sampler.mark if sampler is not None else None
        try:
            (line,) = self.run_json(argv, timeout=self.plan.duration_s * 4 + 60, on_mark=on_mark)
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
            self.log(f"loadgen failed: {exc}")
            self.record({"kind": "error", "target": target, "stage": "loadgen", "error": str(exc)})
            return None
        lat = line["latency_ms"]
        self.log(
            f"{target:9s} {model:9s} c={concurrency:<3d} {line['throughput_rps']:8.1f} req/s"
            f"  p50 {lat['p50']} ms  p99 {lat['p99']} ms  errors {line['errors']}"
        )
        if sampler is not None:
            self.record_cpu(line, sampler)
        return line

    def record_cpu(self, line: dict[str, Any], sampler: WindowSampler) -> None:
        """Record and print the server's CPU and bus messages per request of one run."""
        record: dict[str, Any] = {
            "kind": "platform_cpu",
            "label": line["label"],
            "target": line["target"],
            "model": line["model"],
            "concurrency": line["concurrency"],
            "throughput_rps": line["throughput_rps"],
            "loadgen_window_s": line["window_s"],
        }
        figures = sampler.figures(line["throughput_rps"])
        if figures is None:
            record["error"] = "the load generator gave no warm-up/end marks: CPU not measured"
            self.log(f"  {record['error']}")
            self.record(record)
            return
        record |= figures
        record["notes"] = [*figures["notes"], *missing_processes(figures["found"], sampler.expect)]
        self.record(record)
        self.log(f"  {cpu_summary(record)}")
        for note in record["notes"]:
            self.log(f"  note: {note}")


# ----------------------------------------------------------------- models


HEAVY_VARIANTS: dict[str, dict[str, Any]] = {
    # Batching off: the baseline of the >= 3x batching target.
    "heavy_b1": {"max_batch_size": 1},
    # The peers' queue delay (1 ms), and a longer one: how much the fill depends on it.
    "heavy_d1ms": {"batching": {"max_queue_delay_us": 1000}},
    "heavy_d4ms": {"batching": {"max_queue_delay_us": 4000}},
}
"""Copies of the heavy model with other batching settings, measured at c=64."""


def make_models(work: Path) -> dict[str, Path]:
    """Write fraud, heavy and the `HEAVY_VARIANTS` copies of heavy."""
    dirs = {name: work / name for name in (*MODELS, *HEAVY_VARIANTS)}
    subprocess.run(
        [PYTHON, "examples/fraud/make_model.py", "--out", str(dirs["fraud"])],
        check=True,
        capture_output=True,
        cwd=REPO,
    )
    subprocess.run(
        [PYTHON, "bench/models/make_heavy.py", "--out", str(dirs["heavy"])],
        check=True,
        capture_output=True,
        cwd=REPO,
    )
    for name, change in HEAVY_VARIANTS.items():
        shutil.copytree(dirs["heavy"], dirs[name])
        cfg_path = dirs[name] / "config.json"
        cfg = json.loads(cfg_path.read_text())
        # Same ONNX file and engine; only batching differs (batch dims stay -1).
        cfg["name"] = name
        for key, value in change.items():
            if isinstance(value, dict):
                cfg[key].update(value)
            else:
                cfg[key] = value
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return dirs


# ---------------------------------------------------------------- inferbus


def first_prediction_s(stack: BenchStack, model_dir: Path, model: str, timeout: float) -> float:
    """Seconds from the start of `push` until the gateway answers a prediction."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    width = json.loads((model_dir / "config.json").read_text())["inputs"][0]["shape"][-1]
    inp = grpcclient.InferInput("input", [1, width], "FP32")
    inp.set_data_from_numpy(np.ones((1, width), dtype=np.float32))
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    t0 = time.monotonic()
    try:
        stack.push(model_dir, model, version=VERSION)
        while time.monotonic() - t0 < timeout:
            try:
                client.infer(model, [inp], client_timeout=5.0)
                return time.monotonic() - t0
            except InferenceServerException:
                time.sleep(0.01)
    finally:
        client.close()
    raise TimeoutError(f"{model}: no prediction {timeout}s after push")


def ensure_venv(name: str, runner: Runner) -> Path:
    """Create ``bench/.venvs/<name>`` with its packages (once); return its python."""
    venv = VENVS / name
    py = venv / "bin" / "python"
    marker = venv / ".installed"
    wanted = " ".join(PEER_PACKAGES[name])
    if marker.exists() and marker.read_text() == wanted:
        return py
    runner.log(f"installing {name} into {venv}: {wanted}")
    cmds = [
        ["uv", "venv", "-q", "--allow-existing", "--python", PYTHON, str(venv)],
        ["uv", "pip", "install", "-q", "--python", str(py), *PEER_PACKAGES[name]],
    ]
    for argv in cmds:
        runner.commands.append(shlex.join(argv))
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)}: {proc.stderr.strip()[-1500:]}")
    marker.write_text(wanted)
    return py


def profile_services(stack: BenchStack, runner: Runner, work: Path) -> None:
    """py-spy every service during a fraud c=64 run; record the top frames."""
    try:
        tools = ensure_venv("tools", runner)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        runner.record({"kind": "error", "target": "py-spy", "stage": "install", "error": str(exc)})
        return
    py_spy = tools.parent / "py-spy"
    prof_dir = RESULTS_DIR / f"profile-{runner.out.stem}"
    prof_dir.mkdir(parents=True, exist_ok=True)
    spies: dict[str, subprocess.Popen[bytes]] = {}
    seconds = int(runner.plan.profile_s)
    for name, pid in stack.pids().items():
        if name == "registry" or name == "worker1":
            continue
        argv = [
            str(py_spy),
            "record",
            "--nonblocking",
            "--format",
            "raw",
            "--rate",
            "100",
            "--duration",
            str(seconds),
            "--pid",
            str(pid),
            "--output",
            str(prof_dir / f"{name}.txt"),
        ]
        runner.commands.append(shlex.join(argv))
        spies[name] = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=(work / f"py-spy-{name}.log").open("wb")
        )
    try:
        plan = runner.plan
        runner.plan = dataclasses.replace(plan, duration_s=seconds, warmup_s=0.5)
        runner.loadgen("inferbus", stack.grpc_url, "fraud", 64, label="profile/fraud/c64")
        runner.plan = plan
    finally:
        for proc in spies.values():
            try:
                proc.wait(timeout=seconds + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    for name in spies:
        path = prof_dir / f"{name}.txt"
        if not path.exists():
            err = (work / f"py-spy-{name}.log").read_text(errors="replace")[-500:]
            runner.record(
                {"kind": "error", "target": "py-spy", "stage": name, "error": err or "no output"}
            )
            continue
        runner.record(
            {
                "kind": "profile",
                "service": name,
                "file": str(path.relative_to(REPO)),
                "rate_hz": 100,
                "seconds": seconds,
            }
            | summarize_collapsed(path.read_text())
        )


def perf_analyzer_points(runner: Runner, target: str, url: str) -> None:
    """Triton's perf_analyzer, unmodified, against one server's gRPC port: batch 1,
    every model and concurrency of the plan, one ``perf_analyzer`` record each.

    A point whose measurement does not settle (perf_analyzer exits non-zero) is
    recorded as ``stable: false`` with its last lines, and the run goes on.
    """
    binary = pa.default_binary()
    if not binary.exists():
        runner.record(
            {
                "kind": "error",
                "target": target,
                "stage": "perf_analyzer",
                "error": f"no perf_analyzer at {binary}: run scripts/install-perf-analyzer.sh",
            }
        )
        return
    extra = ["-b", "1", "-p", str(runner.plan.pa_window_ms), *PA_STABILITY]
    for model in MODELS:
        for c in runner.plan.concurrencies:
            record: dict[str, Any] = {
                "kind": "perf_analyzer",
                "target": target,
                "model": model,
                "concurrency": c,
                "window_ms": runner.plan.pa_window_ms,
            }
            try:
                row, argv, _ = pa.run_one(binary, "grpc", url, model, c, extra, timeout_s=300)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                text = str(exc)
                runner.commands.append(text.splitlines()[0])
                runner.record(record | {"stable": False, "error": text[-1500:]})
                reason = "no stable figure" if "stable" in text else "failed"
                runner.log(f"  perf_analyzer {target} {model} c={c}: {reason}")
                continue
            runner.commands.append(shlex.join(argv))
            runner.record(record | {"stable": True} | dataclasses.asdict(row))
            runner.log(
                f"  perf_analyzer {target} {model} c={c}: {row.throughput:,.0f} infer/s,"
                f" p50 {row.p50_us / 1000:.2f} ms, p99 {row.p99_us / 1000:.2f} ms"
            )


def edge_points(runner: Runner, stack: BenchStack, work: Path) -> None:
    """perf_analyzer through the gRPC edge (services/edge) in front of the same
    gateway: target ``inferbus-edge``. Recorded as an error when it is not built."""
    if find_edge_binary() is None:
        runner.record(
            {
                "kind": "error",
                "target": "inferbus-edge",
                "stage": "start",
                "error": "inferbus-edge is not built: run scripts/build-edge.sh --install-deps",
            }
        )
        return
    edge = edge_process(stack.nats_url, stack.grpc_url, work / "edge")
    try:
        edge.start()
        edge.wait_ready()
        perf_analyzer_points(runner, "inferbus-edge", f"127.0.0.1:{edge.ports['grpc']}")
    finally:
        edge.cleanup()


def platform_sampler(stack: BenchStack) -> WindowSampler:
    """CPU of every service but the registry (off the data path), and of nats-server."""
    groups = {name: pid for name, pid in stack.pids().items() if name != "registry"}
    nats = stack.nats
    # pid 0 is never in /proc: a nats-server that is not running shows as a note.
    groups["nats-server"] = (nats.pid if nats is not None else None) or 0
    port = nats.monitor_port if nats is not None else 0
    return WindowSampler(groups, msgs=lambda: nats_msgs(port))


def bench_inferbus(runner: Runner, models: dict[str, Path], work: Path, profile: bool) -> None:
    """Start the stack, measure cold start, every model and concurrency, batching on/off."""
    runner.log(f"starting the inferbus stack ({ENGINE_INSTANCES} workers)")
    t = time.monotonic()
    with BenchStack(work / "stack", workers=ENGINE_INSTANCES) as stack:
        runner.log(f"stack up in {time.monotonic() - t:.1f}s")
        cold = first_prediction_s(stack, models["fraud"], "fraud", timeout=120)
        runner.log(f"cold start fraud: {cold:.2f}s from push to first prediction")
        runner.record({"kind": "cold_start", "target": "inferbus", "model": "fraud", "s": cold})
        for name in ("heavy", *HEAVY_VARIANTS):
            stack.push(models[name], name, version=VERSION)
        for name in ("heavy", *HEAVY_VARIANTS):
            stack.wait_model_ready(name)

        def measured(model: str, concurrency: int) -> None:
            before = stack.batch_rows(), stack.engine_rows()
            line = runner.loadgen(
                "inferbus", stack.grpc_url, model, concurrency, sampler=platform_sampler(stack)
            )
            raw = runner.raw_p50_ms.get(model)
            if line is not None and concurrency == 1 and raw is not None:
                p50 = line["latency_ms"]["p50"]
                runner.log(
                    f"  added p50 over raw onnxruntime (batch 1, 1 thread, {raw:.3f} ms):"
                    f" {p50 - raw:.3f} ms"
                )
            after = stack.batch_rows(), stack.engine_rows()
            batches = after[0][1] - before[0][1]
            runs = after[1][1] - before[1][1]
            if line is not None and batches > 0:
                runner.record(
                    {
                        "kind": "batch_fill",
                        "label": line["label"],
                        "batches": batches,
                        "mean_rows": round((after[0][0] - before[0][0]) / batches, 2),
                        "engine_runs": runs,
                        "engine_rows": (
                            round((after[1][0] - before[1][0]) / runs, 2) if runs > 0 else None
                        ),
                    }
                )

        for model in MODELS:
            for c in runner.plan.concurrencies:
                measured(model, c)
        for name in HEAVY_VARIANTS:
            measured(name, 64)
        perf_analyzer_points(runner, "inferbus", stack.grpc_url)
        edge_points(runner, stack, work)
        if profile:
            profile_services(stack, runner, work)


# ------------------------------------------------------------------- peers


@contextmanager
def peer_process(
    name: str,
    argv_for_ports: Callable[[int], list[str]],
    env: dict[str, str],
    cwd: Path,
    runner: Runner,
    log: Path,
) -> Iterator[tuple[str, int]]:
    """Start a peer server; yield its gRPC address and pid once both models are ready.

    Triton and MLServer cannot bind port 0 and report it, so three ports are
    drawn at random below the ephemeral range and the start is retried when the
    server dies (for example because a port was taken). Readiness is proven by
    our own process being alive and answering ModelReady for every model.
    """
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    last_error = ""
    for _attempt in range(3):
        base = random.randint(10_000, 31_990)
        argv = argv_for_ports(base)
        runner.commands.append(shlex.join(argv))
        with log.open("ab") as fh:
            proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env={**os.environ, **env},
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        url = f"127.0.0.1:{base + 1}"
        deadline = time.monotonic() + 180
        ready = False
        try:
            client = grpcclient.InferenceServerClient(url)
            try:
                while proc.poll() is None and time.monotonic() < deadline:
                    try:
                        if all(client.is_model_ready(m) for m in MODELS):
                            ready = True
                            break
                    except InferenceServerException:
                        pass  # not listening yet: poll again
                    time.sleep(0.1)
            finally:
                client.close()
            if ready:
                runner.log(f"{name} ready at {url}")
                yield url, proc.pid
                return
            last_error = log.read_text(errors="replace")[-1500:]
            runner.log(f"{name} did not start (exit {proc.poll()}); retrying")
            runner.record(
                {"kind": "retry", "target": name, "exit": proc.poll(), "log_tail": last_error}
            )
        finally:
            # The server forks (tritonserver, stubs, MLServer workers): stop the group.
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            else:
                # The leader exited; children may still hold the group.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    raise RuntimeError(f"{name} never became ready; log tail:\n{last_error}")


def patch_pytriton_handshake(py: Path) -> None:
    """Raise PyTriton's 1 s stub handshake timeout in the throwaway venv (see constant)."""
    out = subprocess.run(
        [str(py), "-c", "import pytriton.proxy.communication as m; print(m.__file__)"],
        capture_output=True,
        text=True,
        check=True,
    )
    path = Path(out.stdout.strip())
    text = path.read_text()
    old = "def get_config_from_handshake_server(socket_path: pathlib.Path, timeout_s: float = 1.0)"
    new = old.replace("1.0", str(PYTRITON_HANDSHAKE_S))
    if old in text:
        path.write_text(text.replace(old, new))


def bench_peer(name: str, runner: Runner, models: dict[str, Path], work: Path) -> None:
    """Install, start and measure one peer; record why when it cannot."""
    try:
        py = ensure_venv(name, runner)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        runner.log(f"{name}: install failed")
        runner.record({"kind": "error", "target": name, "stage": "install", "error": str(exc)})
        return
    log = work / f"{name}.log"
    if name == "pytriton":
        patch_pytriton_handshake(py)
        # Triton's Python backend stub links libpython: point it at this interpreter's.
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        paths = (libdir, os.environ.get("LD_LIBRARY_PATH"))
        env = {"LD_LIBRARY_PATH": ":".join(x for x in paths if x)}

        def argv(base: int) -> list[str]:
            cmd = [str(py), str(BENCH_DIR / "peers" / "pytriton_server.py")]
            for m in MODELS:
                cmd += ["--model-dir", str(models[m])]
            return [
                *cmd,
                "--http-port",
                str(base),
                "--grpc-port",
                str(base + 1),
                "--metrics-port",
                str(base + 2),
                "--instances",
                str(ENGINE_INSTANCES),
                "--max-batch",
                "32",
                "--delay-us",
                "1000",
            ]

        cwd = REPO
        target = "triton"
    else:
        repo = work / "mlserver-repo"
        write_mlserver_repo(repo, models)
        env = {"PYTHONPATH": str(BENCH_DIR / "peers")}

        def argv(base: int) -> list[str]:
            settings = {
                "host": "127.0.0.1",
                "http_port": base,
                "grpc_port": base + 1,
                "metrics_port": base + 2,
                "parallel_workers": ENGINE_INSTANCES,
            }
            (repo / "settings.json").write_text(json.dumps(settings))
            return [str(py.parent / "mlserver"), "start", str(repo)]

        cwd = repo
        target = "mlserver"
    try:
        with peer_process(name, argv, env, cwd, runner, log) as (url, pid):
            for model in MODELS:
                for c in runner.plan.concurrencies:
                    # The whole process tree is the server (see PEER_PROCESSES).
                    sampler = WindowSampler({target: pid}, expect={target: PEER_PROCESSES[target]})
                    runner.loadgen(target, url, model, c, sampler=sampler)
            perf_analyzer_points(runner, target, url)
    except RuntimeError as exc:
        runner.log(f"{name}: {str(exc)[:200]}")
        runner.record({"kind": "error", "target": target, "stage": "start", "error": str(exc)})


def write_mlserver_repo(repo: Path, models: dict[str, Path]) -> None:
    """model-settings.json per model: our ONNX runtime, adaptive batching 32 / 1 ms."""
    for m in MODELS:
        cfg = json.loads((models[m] / "config.json").read_text())
        folder = repo / m
        folder.mkdir(parents=True, exist_ok=True)
        settings = {
            "name": m,
            "implementation": "mlserver_model.OnnxModel",
            "max_batch_size": 32,
            "max_batch_time": 0.001,
            "parameters": {"uri": str(models[m] / cfg["file"]), "extra": {"threads": 1}},
            "inputs": cfg["inputs"],
            "outputs": cfg["outputs"],
        }
        (folder / "model-settings.json").write_text(json.dumps(settings, indent=2))


# -------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Run everything, then render the report."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter runs, concurrency 1 and 64 only")
    p.add_argument("--skip-peers", action="store_true", help="inferbus and raw ORT only")
    p.add_argument("--no-profile", action="store_true", help="skip the py-spy profile")
    p.add_argument(
        "--doc", type=Path, default=REPO / "docs" / "benchmarks.md", help="report to write"
    )
    p.add_argument(
        "--findings",
        type=Path,
        default=None,
        help="hand-written reading of this run to include in the report (markdown)",
    )
    args = p.parse_args(argv)
    plan = QUICK if args.quick else FULL
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = RESULTS_DIR / f"run-{stamp}.jsonl"
    runner = Runner(out, plan)
    runner.record(
        {
            "kind": "run",
            "command": " ".join(["uv run python bench/run_all.py", *map(shlex.quote, argv)]),
            "quick": args.quick,
            "plan": plan.__dict__,
            "machine": machine_info(),
        }
    )
    runner.log(f"results → {out}")
    with tempfile.TemporaryDirectory(prefix="inferbus-bench-") as tmp:
        work = Path(tmp)
        models = make_models(work)
        for m in MODELS:
            runner.log(f"raw onnxruntime: {m}")
            raw = runner.run_json(
                [
                    PYTHON,
                    "bench/raw_ort.py",
                    "--model-dir",
                    str(models[m]),
                    "--threads",
                    "1",
                    "0",
                    "--batch",
                    "32",
                    "--seconds",
                    str(plan.raw_seconds),
                    "--out",
                    str(out),
                ]
            )
            for r in raw:
                if r["threads"] == 1:
                    runner.raw_p50_ms[m] = r["batch1"]["latency_ms"]["p50"]
        try:
            bench_inferbus(runner, models, work, profile=not args.no_profile)
        except (ServiceError, TimeoutError, RuntimeError) as exc:
            # Still measure the peers and write the report, with the reason in it.
            runner.log(f"inferbus failed: {str(exc)[:300]}")
            runner.record(
                {"kind": "error", "target": "inferbus", "stage": "stack", "error": str(exc)}
            )
        if not args.skip_peers:
            for peer in ("pytriton", "mlserver"):
                bench_peer(peer, runner, models, work)
    runner.record({"kind": "commands", "commands": runner.commands})
    runner.record({"kind": "done", "elapsed_s": round(time.monotonic() - runner.t0, 1)})
    runner.log("issue 18 targets in this run:")
    for line in target_summary(Results(load(out))):
        runner.log(f"  {line}")
    render = [PYTHON, "bench/render.py", "--results", str(out), "--out", str(args.doc)]
    if args.findings is not None:
        render += ["--findings", str(args.findings)]
    subprocess.run(render, check=True, cwd=REPO)
    runner.log(f"done in {time.monotonic() - runner.t0:.0f}s; wrote {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
