"""``python -m inferbus_batcher`` as a real process: ports file, ops endpoints, SIGTERM drain."""

from __future__ import annotations

import asyncio
import time

import httpx
import nats
import pytest

from inferbus_common.catalog import DeployedVersion, ensure_kv
from inferbus_common.codec import Tensor
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.protocol.bundles import (
    BundledRequest,
    decode_reply_bundle,
    encode_request_bundle,
)
from inferbus_common.protocol.envelope import Envelope
from inferbus_common.protocol.microbatch import decode_batch
from inferbus_common.protocol.tensors import encode_tensors
from inferbus_common.subjects import Subjects
from inferbus_testing.fixtures import SpawnService
from inferbus_testing.servers import NatsServer

pytestmark = pytest.mark.integration

MODEL = "proc-model"
VERSION = "3"
POOL = "default"


async def _probe_intake(nc: nats.aio.client.Client, subjects: Subjects) -> None:
    # nats-server (seen with 2.15.1) can drop the first message published right
    # after a new subscription; a request bundle for an undeployed model is
    # answered NOT_FOUND once the batcher's intake really works.
    inbox = f"{subjects.prefix}.reply.probe"
    probe = encode_request_bundle(
        "not-deployed", "1", inbox, [BundledRequest(Envelope("probe", "not-deployed", 0), 1)], [()]
    )
    sub = await nc.subscribe(inbox)
    try:
        async with asyncio.timeout(10):
            while True:
                await nc.publish(subjects.infer("not-deployed", "1"), probe)
                try:
                    msg = await sub.next_msg(timeout=0.1)
                except TimeoutError:
                    continue
                assert decode_reply_bundle(msg.data).replies[0].status == "NOT_FOUND"
                return
    finally:
        await sub.unsubscribe()


async def test_process_serves_ops_and_drains_on_sigterm(
    nats_server: NatsServer, nats_client: nats.aio.client.Client, spawn_service: SpawnService
) -> None:
    subjects = Subjects("bproc")
    nc = nats_client
    js = nc.jetstream()
    cfg = ModelConfig(
        name=MODEL,
        max_batch_size=8,
        inputs=[{"name": "x", "datatype": "INT32", "shape": [-1, 2]}],
        outputs=[{"name": "y", "datatype": "INT32", "shape": [-1, 2]}],
        batching={"max_queue_delay_us": 60_000_000},
    )
    models = await ensure_kv(js, subjects.models_bucket)
    dv = DeployedVersion(model=MODEL, version=VERSION, config=cfg)
    await models.put(subjects.model_key(MODEL, VERSION), dv.model_dump_json().encode())

    proc = await spawn_service(
        "inferbus_batcher",
        env={
            "INFERBUS_BATCHER_NATS_URL": nats_server.url,
            "INFERBUS_BATCHER_SUBJECT_PREFIX": subjects.prefix,
            "INFERBUS_BATCHER_METRICS_PORT": "0",
            "INFERBUS_BATCHER_INSTANCE_ID": "batcher-proc",
            "INFERBUS_BATCHER_LOG_FORMAT": "text",
            "INFERBUS_BATCHER_STREAM_MAX_BYTES": str(8 << 20),
        },
    )
    await proc.await_ready(timeout=10)
    base = f"http://127.0.0.1:{proc.ports['metrics']}"
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"{base}/healthz")).status_code == 200
        await _probe_intake(nc, subjects)
        data = b"\x01\x00\x00\x00\x02\x00\x00\x00"
        frame = encode_tensors([Tensor("x", "INT32", (1, 2), data)])
        await nc.publish(
            subjects.infer(MODEL, VERSION),
            encode_request_bundle(
                MODEL,
                VERSION,
                "bproc.reply.x.b",
                [BundledRequest(Envelope("queued-1", MODEL, 0), 1)],
                [(frame,)],
            ),
        )
        gauge = f'inferbus_batcher_queue_depth{{model="{MODEL}",version="{VERSION}"}} 1.0'
        deadline = time.monotonic() + 5
        while gauge not in (await client.get(f"{base}/metrics")).text:
            assert time.monotonic() < deadline, "queue depth never reached 1"
            await asyncio.sleep(0.02)
    rc = await proc.aterminate(timeout=15)
    assert rc == 0, proc.log_tail()
    assert "Traceback" not in proc.log_tail(200), proc.log_tail(200)

    # The request that waited for its delay was flushed as a final batch.
    psub = await js.pull_subscribe(
        subjects.batch(POOL, MODEL, VERSION),
        durable=subjects.batch_consumer(POOL, MODEL, VERSION),
        stream=subjects.batch_stream,
    )
    (msg,) = await psub.fetch(1, timeout=5)
    mb = decode_batch(msg.data)
    assert [e.request_id for e in mb.entries] == ["queued-1"]
    assert bytes(mb.tensors[0].data) == data
    await msg.ack()
