"""Subject, stream, consumer and bucket names (`inferbus_common.subjects`)."""

from __future__ import annotations

import re

import pytest
from nats.aio.client import Client
from nats.js.api import ConsumerConfig, StreamConfig

from inferbus_common.subjects import Subjects, name_from_token, subject_token

NAMES = [
    "fraud",
    "resnet-50_v2",
    "my.model",
    "a.b.c",
    "with space",
    "tab\there",
    "wild*card",
    "full>wild",
    "slash/and\\back",
    "eq=sign",
    "=41",
    "ünïcödé",
    "模型",
    "emoji 🚀",
    "x" * 200,
]

# NATS rules: a subject token has no '.', '*', '>' or whitespace; a stream or
# consumer name has none of those nor path separators; a KV key matches this.
_TOKEN_OK = re.compile(r"^[A-Za-z0-9_=-]+$")
_KV_KEY_OK = re.compile(r"^[-/_=.a-zA-Z0-9]+$")
_NAME_OK = re.compile(r"^[^.*>\s/\\]+$")


@pytest.mark.parametrize("name", NAMES)
def test_token_round_trip(name: str) -> None:
    token = subject_token(name)
    assert _TOKEN_OK.match(token), token
    assert name_from_token(token) == name


def test_safe_names_stay_readable() -> None:
    assert subject_token("resnet-50_v2") == "resnet-50_v2"
    assert subject_token("my.model") == "my=2Emodel"
    assert subject_token("a b") == "a=20b"
    assert subject_token("é") == "=C3=A9"


def test_tokens_are_injective() -> None:
    # The escape character itself is escaped, so no two names share a token.
    names = ["a.b", "a=2Eb", "a_b", "a-b", "a b", "a=20b"]
    tokens = [subject_token(n) for n in names]
    assert len(set(tokens)) == len(names)


def test_empty_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="empty name"):
        subject_token("")


@pytest.mark.parametrize("prefix", ["", "a.b", "a b", "x*", "ib>"])
def test_bad_prefix_is_rejected(prefix: str) -> None:
    with pytest.raises(ValueError, match="subject prefix"):
        Subjects(prefix)


@pytest.mark.parametrize("name", NAMES)
def test_subjects_have_a_fixed_number_of_tokens(name: str) -> None:
    s = Subjects("ib")
    assert s.route(name).split(".") == ["ib", "route", subject_token(name)]
    assert len(s.infer(name, name).split(".")) == 4
    assert len(s.batch(name, name, name).split(".")) == 5
    assert len(s.gen(name, "1").split(".")) == 4
    assert s.gen_route(name).split(".") == ["ib", "genroute", subject_token(name)]
    assert len(s.events(name).split(".")) == 4
    assert len(s.reply_inbox(name).split(".")) == 3
    assert _NAME_OK.match(s.batch_consumer(name, name, name))
    assert _KV_KEY_OK.match(Subjects.model_key(name))
    assert _KV_KEY_OK.match(Subjects.model_key(name, name))


def test_names_follow_the_prefix() -> None:
    s = Subjects("dev-1")
    assert s.route("m") == "dev-1.route.m"
    assert s.route_all == "dev-1.route.*"
    assert s.infer("m", "2") == "dev-1.infer.m.2"
    assert s.infer_all == "dev-1.infer.*.*"
    assert s.batch("gpu", "m", "2") == "dev-1.batch.gpu.m.2"
    assert s.batch_all == "dev-1.batch.>"
    assert s.events_all == "dev-1.events.registry.*"
    assert s.batch_stream == "DEV_1_BATCHES"
    assert s.audit_stream == "DEV_1_AUDIT"
    assert s.batch_consumer("gpu", "m", "2") == "w_gpu__m__2"
    assert (s.models_bucket, s.routes_bucket, s.workers_bucket) == (
        "dev-1_models",
        "dev-1_routes",
        "dev-1_workers",
    )
    assert Subjects.model_key("m") == "m"
    assert Subjects.model_key("m.x", "1") == "m=2Ex.1"


def test_wildcards_match_concrete_subjects() -> None:
    s = Subjects()
    assert s.route_all.split(".")[:2] == s.route("a.b").split(".")[:2]
    assert len(s.infer_all.split(".")) == len(s.infer("a.b", "c d").split("."))


@pytest.mark.integration
async def test_names_are_accepted_by_a_real_nats_server(nats_client: Client) -> None:
    s = Subjects("ib")
    js = nats_client.jetstream()
    await js.add_stream(StreamConfig(name=s.batch_stream, subjects=[s.batch_all]))
    kv = await js.create_key_value(bucket=s.models_bucket)
    routed = await nats_client.subscribe(s.route_all)
    for i, name in enumerate(NAMES):
        # Subject with wildcards in the subscription but none in the name.
        await nats_client.publish(s.route(name), name.encode())
        msg = await routed.next_msg(timeout=2)
        assert name_from_token(msg.subject.split(".")[2]) == name
        # Durable consumer named after pool/model/version, filtered on its subject.
        durable = s.batch_consumer("pool", name, str(i))
        info = await js.add_consumer(
            s.batch_stream,
            ConsumerConfig(durable_name=durable, filter_subject=s.batch("pool", name, str(i))),
        )
        assert info.name == durable
        ack = await js.publish(s.batch("pool", name, str(i)), b"x")
        assert ack.stream == s.batch_stream
        # KV key for the model version.
        await kv.put(Subjects.model_key(name, "v1"), name.encode())
        assert (await kv.get(Subjects.model_key(name, "v1"))).value == name.encode()
