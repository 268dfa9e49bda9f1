"""The container stack for real (issues #20, #28): images built from the repository's
Dockerfiles, `up` through scripts/compose.sh (the Compose v2 binary, and the
healthcheck runner Podman lacks) under Podman with a three-node NATS cluster and
two CPU workers, a push meant for another stack refused, a model pushed with the
CLI through the published ports, correct predictions over gRPC and HTTP and
through the compiled gRPC edge's container (a unary call and a stream), the
CPU workers scaled 2 -> 1 -> 2 -> 1 under closed-loop load with the documented
command (no request fails, no other container is recreated: same ids and
creation times), a worker and the gateway killed (SIGKILL of their process)
coming back and serving, the only worker killed through the engine answered
UNAVAILABLE "no worker" within 1 s by the gateway and the edge, the workers
upgraded to a new image under load with no failure, a second stack
beside the first keeping its pushes to itself, no container of the data path
running as root, and `down` leaving nothing behind.

One stack for the module, the tests in order. Skipped, with the reason, where
Podman cannot run (not Linux, not root, tools missing, `podman info` failing, or
a container that cannot start); on a root Debian machine after
scripts/bootstrap-containers.sh (CI) it runs. Builds are cached in
``$INFERBUS_CONTAINER_CACHE`` (default ``~/.cache/inferbus/podman``): the Debian
base is made once per machine, image layers are reused. Build and start times
are printed (`-s`) and kept in docs/operations.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from inferbus_common.catalog import Catalog
from inferbus_common.subjects import Subjects
from inferbus_testing.chaos import ClosedLoad
from inferbus_testing.containers import (
    REPO,
    ComposeProject,
    ContainerError,
    PodmanService,
    podman_unavailable,
)
from inferbus_testing.examples import make_fraud_model

pytestmark = [pytest.mark.containers, pytest.mark.slow, pytest.mark.timeout(1800)]

MODEL = "fraud"
FEATURES = 64

REPO_NAME = "localhost/inferbus"
"""Image repository of the test images (fully qualified: no short-name lookup)."""
BASE_IMAGE = "localhost/inferbus-base:bookworm"
COMPOSE = REPO / "compose"
IMAGES = ["gateway", "router", "batcher", "registry", "worker", "edge", "nats", "redis", "s3"]
"""What the stack below needs (not the Prometheus stand-in)."""
SERVICES = [
    "nats-1", "nats-2", "nats-3", "redis", "minio", "minio-init",
    "registry", "router", "batcher", "worker-cpu", "gateway", "edge",
]  # fmt: skip
"""Started by `up`: the data path, the registry and what they need."""

# Host ports chosen by the engine (never the defaults, which a developer's own
# stack may hold); read back with `docker compose port`.
PORTS_OVERRIDE = """\
services:
  nats-1:
    ports: !override
      - "127.0.0.1::4222"
  minio:
    ports: !reset []
  registry:
    ports: !override
      - "127.0.0.1::8070"
  gateway:
    ports: !override
      - "127.0.0.1::8000"
      - "127.0.0.1::8001"
  edge:
    ports: !override
      - "127.0.0.1::8003"
      - "127.0.0.1::8004"
"""


@dataclass
class ContainerStack:
    """The running compose project and where to reach it from the host."""

    podman: PodmanService
    project: ComposeProject
    grpc_url: str
    http_url: str
    edge_url: str
    """The compiled gRPC edge's port (services/edge)."""
    registry_url: str
    nats_url: str
    model_dir: Path
    files: list[Path]
    """The compose files of the project (a second stack uses the same)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per phase: base image, builds, up, first prediction ..."""


def _model(base: Path) -> Path:
    """The example fraud model, placed on the compose stack's CPU pool."""
    out = base / "fraud"
    make_fraud_model(out)
    config = json.loads((out / "config.json").read_text())
    config["pool"] = "cpu"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _env_file(path: Path) -> Path:
    path.write_text(
        "\n".join(
            [
                f"INFERBUS_IMAGE_REPO={REPO_NAME}",
                "INFERBUS_VERSION=dev",
                "GIT_COMMIT=test",
                "INFERBUS_BIND=127.0.0.1",
                "MINIO_ROOT_USER=inferbus",
                f"MINIO_ROOT_PASSWORD={secrets.token_urlsafe(18)}",
                "INFERBUS_S3_BUCKET=inferbus",
                f"REDIS_PASSWORD={secrets.token_urlsafe(18)}",
                "GRAFANA_ADMIN_USER=admin",
                f"GRAFANA_ADMIN_PASSWORD={secrets.token_urlsafe(18)}",
                "INFERBUS_LOG_LEVEL=INFO",
                "",
            ]
        )
    )
    return path


def _wait_http_ok(url: str, timeout: float) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready after {timeout}s")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def container_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ContainerStack]:
    """Images built, the stack up under Podman with a 3-node NATS cluster; down after."""
    reason = podman_unavailable()
    if reason:
        pytest.skip(f"containers cannot run here: {reason}")
    base = tmp_path_factory.mktemp("containers")
    cache = Path(
        os.environ.get("INFERBUS_CONTAINER_CACHE", Path.home() / ".cache" / "inferbus" / "podman")
    )
    timings: dict[str, float] = {}
    podman = PodmanService(cache, base / "podman")
    try:
        podman.start()
    except ContainerError as exc:
        pytest.skip(f"podman cannot run here: {exc}")
    try:
        t0 = time.monotonic()
        out = subprocess.run(
            ["bash", str(REPO / "scripts" / "base-image.sh"), "--tag", BASE_IMAGE],
            env=podman.env,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        assert out.returncode == 0, f"scripts/base-image.sh failed:\n{out.stderr[-3000:]}"
        timings["base image"] = time.monotonic() - t0
        try:
            podman.podman("run", "--rm", "--network", "none", BASE_IMAGE, "true", timeout=120)
        except ContainerError as exc:
            pytest.skip(f"podman cannot start a container here: {exc}")
        t0 = time.monotonic()
        podman.build_images(IMAGES, repo=REPO_NAME, log=base / "images.log")
        timings["images"] = time.monotonic() - t0

        override = base / "ports.yml"
        override.write_text(PORTS_OVERRIDE)
        files = [
            REPO / "compose/docker-compose.yml",
            REPO / "compose/docker-compose.local.yml",
            override,
        ]
        project = ComposeProject(
            podman,
            f"ibtest{os.getpid()}",
            files,
            _env_file(base / "test.env"),
            profiles=["cpu"],
        )
        try:
            t0 = time.monotonic()
            project.run("up", "-d", "--no-build", "--pull", "never", *SERVICES)
            http_port = project.port("gateway", 8000)
            _wait_http_ok(f"http://127.0.0.1:{http_port}/v2/health/ready", 120)
            timings["up"] = time.monotonic() - t0
            yield ContainerStack(
                podman=podman,
                project=project,
                grpc_url=f"127.0.0.1:{project.port('gateway', 8001)}",
                http_url=f"127.0.0.1:{http_port}",
                edge_url=f"127.0.0.1:{project.port('edge', 8003)}",
                registry_url=f"127.0.0.1:{project.port('registry', 8070)}",
                nats_url=f"nats://127.0.0.1:{project.port('nats-1', 4222)}",
                model_dir=_model(base),
                files=files,
                timings=timings,
            )
        finally:
            try:
                project.run("down", "-v", "--remove-orphans", "-t", "30")
            except ContainerError as exc:
                print(f"compose down failed: {exc}")
    finally:
        podman.stop()


def _reference(stack: ContainerStack, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(
        str(stack.model_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    return session.run(None, {"input": x})[0]


def _wait_model_ready(client: grpcclient.InferenceServerClient, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not client.is_model_ready(MODEL):
        assert time.monotonic() < deadline, f"model not ready after {timeout} s"
        time.sleep(0.1)


def _push(
    stack: ContainerStack, stack_id: str, *, registry: str = "", version: str = "1"
) -> subprocess.CompletedProcess[str]:
    """`inferbus models push` through the published registry port (`registry`, default
    the stack's), expecting `stack_id` (as compose/push-example.sh does; the stack's
    id is its project name)."""
    argv = [sys.executable, "-m", "inferbus_cli", "models", "push", str(stack.model_dir)]
    argv += ["--name", MODEL, "--version", version, "--alias", "stable"]
    argv += ["--registry", registry or stack.registry_url]
    env = {**os.environ, "INFERBUS_STACK_ID": stack_id}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)


async def _wait_ready_workers(
    stack: ContainerStack, count: int, timeout: float, *, exact: bool = False
) -> None:
    """Until `count` live workers (exactly `count` with `exact`) report the model ready
    in the catalog (NATS KV)."""
    import nats

    nc = await nats.connect(stack.nats_url, connect_timeout=5)
    try:
        async with Catalog(nc.jetstream(), Subjects()) as catalog:
            await catalog.wait_loaded()

            def enough() -> bool:
                ready = len(catalog.ready_workers(MODEL, "1"))
                return ready == count if exact else ready >= count

            ok = await catalog.wait_for(enough, timeout)
            assert ok, f"{count} workers not ready: {sorted(catalog.workers)}"
    finally:
        await nc.close()


def test_pushed_model_answers_correctly_over_grpc_and_http(
    container_stack: ContainerStack,
) -> None:
    stack = container_stack
    # A push meant for another stack is refused by this one's registry.
    misled = _push(stack, "another-stack")
    assert misled.returncode == 1, misled.stdout
    assert f"belongs to stack {stack.project.name}, not to stack another-stack" in misled.stderr
    t0 = time.monotonic()
    pushed = _push(stack, stack.project.name)
    assert pushed.returncode == 0, pushed.stderr
    grpc = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        _wait_model_ready(grpc, 120)
        x = np.random.default_rng(1).standard_normal((4, FEATURES)).astype(np.float32)
        inp = grpcclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        got = grpc.infer(MODEL, [inp]).as_numpy("probabilities")
        stack.timings["push to first prediction"] = time.monotonic() - t0
        np.testing.assert_allclose(got, _reference(stack, x), rtol=1e-5, atol=1e-6)
    finally:
        grpc.close()
    # The edge container: unary calls over NATS to the gateway, a stream through
    # to the gateway's own port; same answers.
    edge = grpcclient.InferenceServerClient(stack.edge_url)
    try:
        x = np.random.default_rng(4).standard_normal((5, FEATURES)).astype(np.float32)
        inp = grpcclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        got = edge.infer(MODEL, [inp], client_timeout=30).as_numpy("probabilities")
        np.testing.assert_allclose(got, _reference(stack, x), rtol=1e-5, atol=1e-6)
        answers: queue.Queue = queue.Queue()
        edge.start_stream(callback=lambda result, error: answers.put((result, error)))
        edge.async_stream_infer(MODEL, [inp], request_id="edge-stream")
        result, error = answers.get(timeout=30)
        edge.stop_stream()
        assert error is None, error
        np.testing.assert_allclose(
            result.as_numpy("probabilities"), _reference(stack, x), rtol=1e-5, atol=1e-6
        )
    finally:
        edge.close()
    http = httpclient.InferenceServerClient(stack.http_url)
    try:
        x = np.random.default_rng(2).standard_normal((3, FEATURES)).astype(np.float32)
        inp = httpclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=False)
        got = http.infer(MODEL, [inp]).as_numpy("probabilities")
        np.testing.assert_allclose(got, _reference(stack, x), rtol=1e-5, atol=1e-6)
    finally:
        http.close()
    sizes = {ref: stack.podman.image_size(ref) for ref in _image_refs()}
    print("\nimage sizes:", *(f"  {r} {s / 1e6:.0f} MB" for r, s in sizes.items()), sep="\n")
    print("timings:", *(f"  {k}: {v:.1f} s" for k, v in stack.timings.items()), sep="\n")


def _image_refs() -> list[str]:
    stand_ins = ("nats", "redis", "s3")
    return [f"{REPO_NAME}{'-local' if n in stand_ins else ''}/{n}:dev" for n in IMAGES]


def _all_ok(load: ClosedLoad) -> dict[str, int]:
    """The load's requests by status; asserts there were enough and every one was OK."""
    statuses: dict[str, int] = {}
    for a in load.attempts:
        statuses[a.status] = statuses.get(a.status, 0) + 1
    assert len(load.attempts) > 50, statuses
    assert statuses == {"OK": len(load.attempts)}, sorted({a.message for a in load.attempts})
    return statuses


def _scale_command(replicas: int) -> list[str]:
    """The documented scaling command (docs/operations.md, "First hour"): only the
    worker-cpu containers are added or removed; nothing else is touched."""
    return [
        "up", "-d", "--no-build", "--no-deps", "--no-recreate",
        "--scale", f"worker-cpu={replicas}", "worker-cpu",
    ]  # fmt: skip


def _containers(stack: ContainerStack) -> dict[str, tuple[str, str]]:
    """Every container of the project (running or not): name -> (id, created)."""
    return {
        c["Names"][0]: (c["Id"], str(c["Created"]))
        for c in stack.podman.containers(stack.project.name, all_states=True)
    }


async def test_workers_scale_1_2_1_under_load_with_no_failure_and_nothing_else_recreated(
    container_stack: ContainerStack,
) -> None:
    stack = container_stack
    workers = stack.project.container_names("worker-cpu")
    assert len(workers) == 2, f"the default stack runs two CPU workers: {workers}"
    await _wait_ready_workers(stack, 2, timeout=120)
    before = _containers(stack)
    removed = workers[-1]
    load = ClosedLoad([stack.grpc_url], stack.model_dir, concurrency=4, deadline_s=5.0)
    steps: list[str] = []
    async with load:
        await asyncio.sleep(2.0)
        for replicas in (1, 2, 1):
            t0 = time.monotonic()
            await asyncio.to_thread(stack.project.run, *_scale_command(replicas))
            took = time.monotonic() - t0
            assert len(stack.project.container_names("worker-cpu")) == replicas
            # Removed workers leave the catalog; an added one loads the model.
            await _wait_ready_workers(stack, replicas, timeout=120, exact=True)
            steps.append(f"{replicas}: {took:.1f} s, ready {time.monotonic() - t0:.1f} s")
            stack.timings[f"scale worker-cpu to {replicas}"] = took
        await asyncio.sleep(2.0)
    after = _containers(stack)
    print(f"\nscaled worker-cpu 2 -> {', '.join(steps)}; requests {_all_ok(load)}")
    # Nothing but the scaled workers was touched: same containers, same ids and
    # creation times; the worker removed first (and its later twin) are gone.
    assert after == {name: v for name, v in before.items() if name != removed}


async def test_a_killed_worker_and_gateway_come_back_and_serve(
    container_stack: ContainerStack,
) -> None:
    """A container whose process dies (an OOM kill, a crash: SIGKILL from outside
    the engine) is started again by its restart policy and serves."""
    stack = container_stack
    victims = [stack.project.container_names("worker-cpu")[0]]
    victims += stack.project.container_names("gateway")
    before = {}
    for name in victims:
        state = stack.podman.podman("inspect", "-f", "{{.Id}} {{.RestartCount}}", name).split()
        before[name] = (state[0], int(state[1]))
        pid = int(stack.podman.podman("inspect", "-f", "{{.State.Pid}}", name).strip())
        os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    for name, (cid, restarts) in before.items():
        deadline = time.monotonic() + 60
        while True:
            state = stack.podman.podman(
                "inspect", "-f", "{{.Id}} {{.RestartCount}} {{.State.Status}}", name
            ).split()
            if state[0] == cid and int(state[1]) > restarts and state[2] == "running":
                break
            assert time.monotonic() < deadline, f"{name} not restarted: {state}"
            await asyncio.sleep(0.2)
    restarted_s = time.monotonic() - t0
    await _wait_ready_workers(stack, 1, timeout=120)
    x = np.random.default_rng(3).standard_normal((2, FEATURES)).astype(np.float32)
    grpc = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                inp = grpcclient.InferInput("input", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                got = grpc.infer(MODEL, [inp], client_timeout=5).as_numpy("probabilities")
                break
            except InferenceServerException:
                assert time.monotonic() < deadline, "no answer 60 s after the kill"
                await asyncio.sleep(0.5)
    finally:
        grpc.close()
    serving_s = time.monotonic() - t0
    stack.timings["killed worker + gateway: restarted"] = restarted_s
    stack.timings["killed worker + gateway: serving again"] = serving_s
    print(f"\nkilled {victims}: restarted in {restarted_s:.1f} s, serving in {serving_s:.1f} s")
    np.testing.assert_allclose(got, _reference(stack, x), rtol=1e-5, atol=1e-6)


async def _infer_once(client: grpcaio.InferenceServerClient, deadline_s: float) -> tuple[str, str]:
    x = np.random.default_rng().standard_normal((1, FEATURES)).astype(np.float32)
    inp = grpcaio.InferInput("input", [1, FEATURES], "FP32")
    inp.set_data_from_numpy(x)
    try:
        await asyncio.wait_for(
            client.infer(MODEL, [inp], client_timeout=deadline_s), deadline_s + 5
        )
    except TimeoutError:
        return "HANG", ""
    except InferenceServerException as exc:
        return str(exc.status()), str(exc.message())
    return "OK", ""


async def test_the_only_worker_killed_is_answered_unavailable_within_a_second(
    container_stack: ContainerStack,
) -> None:
    """`podman kill` of the only worker container (an engine kill: it stays down,
    docs/operations.md "First hour"): clients of the gateway and of the edge get
    UNAVAILABLE naming "no worker" within 1 s, none hangs; `up -d` brings the
    worker back and it serves."""
    stack = container_stack
    await _wait_ready_workers(stack, 1, timeout=120, exact=True)
    (victim,) = stack.project.container_names("worker-cpu")
    deadline_s = 8.0
    clients = {
        "gateway": grpcaio.InferenceServerClient(stack.grpc_url),
        "edge": grpcaio.InferenceServerClient(stack.edge_url),
    }
    outcomes: list[tuple[str, float, float, str, str]] = []
    stop = asyncio.Event()

    async def sender(via: str) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            status, message = await _infer_once(clients[via], deadline_s)
            outcomes.append((via, t0, time.monotonic(), status, message))
            await asyncio.sleep(0.01)

    try:
        for client in clients.values():
            assert await _infer_once(client, deadline_s) == ("OK", "")
        tasks = [asyncio.ensure_future(sender(via)) for via in (*clients, *clients)]
        await asyncio.sleep(1.0)
        t_kill = time.monotonic()
        stack.podman.podman("kill", victim, timeout=60)
        await asyncio.sleep(3.0)
        stop.set()
        await asyncio.gather(*tasks)
        statuses = {o[3] for o in outcomes}
        assert "HANG" not in statuses, "a request hung"
        assert statuses <= {"OK", "StatusCode.UNAVAILABLE"}, statuses
        for via, _sent, _done, status, message in outcomes:
            if status != "OK":
                assert "no worker serves it" in message, (via, message)
                assert f"model '{MODEL}' version '1'" in message, (via, message)
        for via in clients:
            mine = [o for o in outcomes if o[0] == via]
            first = min(o[2] for o in mine if o[3] != "OK")
            assert first - t_kill <= 1.0, (via, first - t_kill)
            late = [o for o in mine if o[1] >= t_kill + 1.0]
            assert late and all(o[3] != "OK" for o in late), (via, late[:3])
            assert max(o[2] - o[1] for o in late) < deadline_s / 2, via
            stack.timings[f"only worker killed: first UNAVAILABLE via {via}"] = first - t_kill

        # The operator starts it again (an engine kill is the operator's stop).
        t0 = time.monotonic()
        stack.project.run(
            "up", "-d", "--no-build", "--no-deps", "--no-recreate", "worker-cpu", timeout=120
        )
        # (Not `exact`: the killed worker's heartbeat stays in the catalog until it
        # goes stale; the gateways know it dead from their probes.)
        await _wait_ready_workers(stack, 1, timeout=120)
        for via, client in clients.items():
            ok = ("", "")
            while time.monotonic() - t0 < 120 and ok[0] != "OK":
                ok = await _infer_once(client, deadline_s)
            assert ok == ("OK", ""), (via, ok)
        stack.timings["only worker killed: serving again after up -d"] = time.monotonic() - t0
    finally:
        stop.set()
        for client in clients.values():
            await client.close()


def test_no_container_of_the_data_path_runs_as_root(container_stack: ContainerStack) -> None:
    stack = container_stack
    uids = {}
    for service in ("nats-1", "minio", "redis", "registry", "gateway", "worker-cpu"):
        name = stack.project.container_names(service)[0]
        uids[service] = stack.podman.podman("exec", name, "id", "-u", timeout=60).strip()
    # The edge's image is its binary alone (no `id`): the uid of its process.
    name = stack.project.container_names("edge")[0]
    pid = int(stack.podman.podman("inspect", "-f", "{{.State.Pid}}", name).strip())
    status = Path(f"/proc/{pid}/status").read_text()
    uids["edge"] = next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Uid:"))
    assert "0" not in uids.values(), uids


async def _wait_hosts_ready(stack: ContainerStack, hosts: set[str], timeout: float) -> None:
    """Until workers on each of `hosts` (container hostnames: short ids) report the
    model ready in the catalog."""
    import nats

    nc = await nats.connect(stack.nats_url, connect_timeout=5)
    try:
        async with Catalog(nc.jetstream(), Subjects()) as catalog:
            await catalog.wait_loaded()

            def ready() -> bool:
                return hosts <= {w.host for w in catalog.ready_workers(MODEL, "1")}

            assert await catalog.wait_for(ready, timeout), f"not ready: {hosts}"
    finally:
        await nc.close()


async def test_workers_upgrade_to_a_new_image_under_load_with_no_failure(
    container_stack: ContainerStack, tmp_path: Path
) -> None:
    """The documented worker upgrade (docs/operations.md, "Upgrade"): a new image
    under the same tag, scale out with `--no-recreate` (the new containers take it),
    then retire the old containers by name with a stop (SIGTERM: they drain).
    Under closed-loop load through the gateway and the edge: no request fails,
    and nothing but the workers is touched."""
    stack = container_stack
    ref = f"{REPO_NAME}/worker:dev"
    old_workers = stack.project.container_names("worker-cpu")
    old_image = stack.podman.podman("image", "inspect", "-f", "{{.Id}}", ref).strip()
    before = _containers(stack)
    # The new image: the same build with one more label (what a rebuild of a new
    # commit under the same tag amounts to, for the engine).
    (tmp_path / "Containerfile").write_text(f"FROM {ref}\nLABEL inferbus.test.upgrade=1\n")
    stack.podman.podman(
        "build", "--format", "docker", "-t", ref, "-f", str(tmp_path / "Containerfile"),
        str(tmp_path), timeout=300,
    )  # fmt: skip
    new_image = stack.podman.podman("image", "inspect", "-f", "{{.Id}}", ref).strip()
    assert new_image != old_image
    scale_out = 2 * len(old_workers)
    load = ClosedLoad(
        [stack.grpc_url, stack.edge_url], stack.model_dir, concurrency=4, deadline_s=5.0
    )
    t0 = time.monotonic()
    async with load:
        await asyncio.sleep(2.0)
        await asyncio.to_thread(stack.project.run, *_scale_command(scale_out))
        new_workers = [
            n for n in stack.project.container_names("worker-cpu") if n not in old_workers
        ]
        assert len(new_workers) == len(old_workers), new_workers
        hosts = {
            stack.podman.podman("inspect", "-f", "{{.Config.Hostname}}", n).strip()
            for n in new_workers
        }
        await _wait_hosts_ready(stack, hosts, timeout=120)
        await asyncio.to_thread(stack.podman.podman, "stop", "-t", "30", *old_workers, timeout=120)
        await asyncio.to_thread(stack.podman.podman, "rm", *old_workers, timeout=60)
        await asyncio.sleep(2.0)
    stack.timings["worker upgrade under load"] = time.monotonic() - t0
    print(f"\nupgraded {old_workers} -> {new_workers}; requests {_all_ok(load)}")
    for name in stack.project.container_names("worker-cpu"):
        image = stack.podman.podman("inspect", "-f", "{{.Image}}", name).strip()
        assert image == new_image, (name, image)
    after = _containers(stack)
    untouched = {n: v for n, v in before.items() if n not in old_workers}
    assert {n: v for n, v in after.items() if n not in new_workers} == untouched


async def _versions(registry_url: str) -> dict[str, list[str]]:
    from inferbus_client.registry import RegistryClient

    async with RegistryClient(registry_url) as client:
        return {m.name: sorted(m.versions) for m in await client.list_models()}


async def test_a_second_stack_beside_the_first_keeps_to_itself(
    container_stack: ContainerStack, tmp_path: Path
) -> None:
    """A second project on other host ports (engine-chosen here; `.env` ports in
    the docs) with its own volumes: a push aimed at one stack never lands in the
    other, each serves its own versions, and its `down` leaves the first serving."""
    stack = container_stack
    second = ComposeProject(
        stack.podman,
        f"{stack.project.name}b",
        stack.files,
        _env_file(tmp_path / "second.env"),
        profiles=["cpu"],
    )
    t0 = time.monotonic()
    try:
        second.run(
            "up",
            "-d",
            "--no-build",
            "--pull",
            "never",
            *(s for s in SERVICES if s != "edge"),
            timeout=600,
        )
        http_port = second.port("gateway", 8000)
        _wait_http_ok(f"http://127.0.0.1:{http_port}/v2/health/ready", 120)
        stack.timings["second stack: up"] = time.monotonic() - t0
        registry_b = f"127.0.0.1:{second.port('registry', 8070)}"
        assert registry_b != stack.registry_url
        # Aimed at the first stack, sent to the second's port: refused.
        misled = _push(stack, stack.project.name, registry=registry_b, version="2")
        assert misled.returncode == 1, misled.stdout
        assert f"belongs to stack {second.name}, not to stack {stack.project.name}" in (
            misled.stderr
        )
        pushed = _push(stack, second.name, registry=registry_b, version="2")
        assert pushed.returncode == 0, pushed.stderr
        assert await _versions(registry_b) == {MODEL: ["2"]}
        assert await _versions(stack.registry_url) == {MODEL: ["1"]}, "it landed in the first"
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{second.port('gateway', 8001)}")
        try:
            _wait_model_ready(client, 120)
            x = np.random.default_rng(5).standard_normal((2, FEATURES)).astype(np.float32)
            inp = grpcclient.InferInput("input", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            got = client.infer(MODEL, [inp], client_timeout=30)
            assert got.get_response().model_version == "2"
            np.testing.assert_allclose(
                got.as_numpy("probabilities"), _reference(stack, x), rtol=1e-5, atol=1e-6
            )
        finally:
            client.close()
    finally:
        second.run("down", "-v", "--remove-orphans", "-t", "30")
    assert second.leftovers() == {"containers": [], "volumes": [], "networks": []}
    stack.timings["second stack: up, push, serve, down"] = time.monotonic() - t0
    # The first stack still serves its own version.
    first = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        x = np.random.default_rng(6).standard_normal((1, FEATURES)).astype(np.float32)
        inp = grpcclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        assert first.infer(MODEL, [inp], client_timeout=30).get_response().model_version == "1"
    finally:
        first.close()


def test_compose_down_leaves_nothing(container_stack: ContainerStack) -> None:
    stack = container_stack
    t0 = time.monotonic()
    stack.project.run("down", "-v", "--remove-orphans", "-t", "30")
    stack.timings["down"] = time.monotonic() - t0
    assert stack.project.leftovers() == {"containers": [], "volumes": [], "networks": []}
    print("\ntimings:", *(f"  {k}: {v:.1f} s" for k, v in stack.timings.items()), sep="\n")
