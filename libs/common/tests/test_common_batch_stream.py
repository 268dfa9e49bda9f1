"""The micro-batch work-queue stream: batchers own its limits (real nats-server)."""

from __future__ import annotations

import logging

import pytest
from nats.js.api import StorageType

from inferbus_common.bus import ensure_batch_stream
from inferbus_common.subjects import Subjects


async def test_a_batcher_sets_its_limits_on_a_stream_a_worker_created(
    nats_client, caplog: pytest.LogCaptureFixture
) -> None:
    js = nats_client.jetstream()
    subjects = Subjects("bs")
    # A worker that starts first creates the stream with the defaults.
    await ensure_batch_stream(js, subjects)
    info = await js.stream_info(subjects.batch_stream)
    assert info.config.max_msgs_per_subject == 1024
    assert info.config.storage == StorageType.MEMORY

    # A batcher with its own bounds (and another storage) starts next.
    with caplog.at_level(logging.INFO, logger="inferbus_common.bus"):
        await ensure_batch_stream(
            js,
            subjects,
            storage="file",
            max_bytes=64 << 20,
            max_msgs_per_subject=8,
            reconcile=True,
        )
    info = await js.stream_info(subjects.batch_stream)
    assert (info.config.max_bytes, info.config.max_msgs_per_subject) == (64 << 20, 8)
    assert info.config.storage == StorageType.MEMORY, "storage cannot change in place"
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and f"nats stream rm {subjects.batch_stream}" in errors[0], errors

    # A later worker leaves the batcher's limits alone.
    await ensure_batch_stream(js, subjects)
    info = await js.stream_info(subjects.batch_stream)
    assert info.config.max_msgs_per_subject == 8
