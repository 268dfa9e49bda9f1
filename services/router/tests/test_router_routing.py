"""The router's version choice: pinned → sticky → weighted."""

from __future__ import annotations

import random

import pytest

from inferbus_common.catalog import Route
from inferbus_common.errors import NotFound
from inferbus_common.protocol import headers as h
from inferbus_router.routing import (
    PINNED,
    STABLE,
    STICKY,
    STICKY_BUCKETS,
    WEIGHTED,
    Decision,
    choose_version,
    decide,
    sticky_bucket,
    wants_shadow,
)

ROUTE = Route(model="m", stable="1", versions=["1", "2"], aliases={"stable": "1", "canary": "2"})
CANARY = ROUTE.model_copy(update={"canary": "2", "canary_weight": 10.0})
GOLDEN = [1109, 8790, 2102]
"""`sticky_bucket` of model ``fraud`` and keys alice, bob, '' (fixed forever)."""


def test_unpinned_goes_to_stable() -> None:
    assert choose_version(ROUTE, "m", "") == "1"
    assert decide(ROUTE, "m", {}) == Decision("1", STABLE)


def test_pinned_version_and_alias() -> None:
    assert choose_version(ROUTE, "m", "2") == "2"
    assert choose_version(ROUTE, "m", "canary") == "2"


def test_unknown_model_and_version() -> None:
    with pytest.raises(NotFound, match="model 'x' is not deployed"):
        choose_version(None, "x", "")
    with pytest.raises(NotFound, match="no version or alias '9'"):
        choose_version(ROUTE, "m", "9")


def test_pin_wins_over_sticky_and_weight() -> None:
    route = CANARY.model_copy(update={"sticky": "tenant", "canary_weight": 100.0})
    assert decide(route, "m", {h.VERSION: "1", h.TENANT: "t"}) == Decision("1", PINNED)
    assert decide(route, "m", {h.VERSION: "stable"}).version == "1"
    assert decide(route, "m", {h.TENANT: "t"}) == Decision("2", STICKY)


def test_weighted_choice_follows_the_draw() -> None:
    assert decide(CANARY, "m", {}, draw=lambda: 0.0999) == Decision("2", WEIGHTED)
    assert decide(CANARY, "m", {}, draw=lambda: 0.1) == Decision("1", WEIGHTED)
    # The effective weight (health-scaled) replaces the configured one.
    assert decide(CANARY, "m", {}, canary_weight=5.0, draw=lambda: 0.07).version == "1"
    assert decide(CANARY, "m", {}, canary_weight=0.0, draw=lambda: 0.0) == Decision("1", STABLE)


def test_weighted_split_is_close_to_the_weight() -> None:
    rng = random.Random(7)
    n = 100_000
    hits = sum(decide(CANARY, "m", {}, draw=rng.random).version == "2" for _ in range(n))
    assert abs(hits / n - 0.10) < 0.005


def test_sticky_bucket_is_a_fixed_function_of_model_and_key() -> None:
    # Golden values: any change of the hash moves users between versions.
    assert sticky_bucket("m", "alice") == sticky_bucket("m", "alice")
    assert 0 <= sticky_bucket("m", "alice") < STICKY_BUCKETS
    assert [sticky_bucket("fraud", k) for k in ("alice", "bob", "")] == GOLDEN
    # Different models spread the same key independently.
    same = sum(sticky_bucket("a", str(k)) == sticky_bucket("b", str(k)) for k in range(1000))
    assert same < 5


def test_sticky_keys_split_by_weight_and_move_monotonically() -> None:
    route = CANARY.model_copy(update={"sticky": "tenant"})
    keys = [f"tenant-{i}" for i in range(20_000)]
    on_canary = {k for k in keys if decide(route, "m", {h.TENANT: k}).version == "2"}
    assert abs(len(on_canary) / len(keys) - 0.10) < 0.01
    # Raising the weight only adds keys to the canary; none flips back.
    wider = route.model_copy(update={"canary_weight": 25.0})
    on_canary_25 = {k for k in keys if decide(wider, "m", {h.TENANT: k}).version == "2"}
    assert on_canary <= on_canary_25


def test_sticky_header_key_and_missing_key() -> None:
    route = CANARY.model_copy(update={"sticky": "header:X-User", "canary_weight": 50.0})
    versions = {
        decide(route, "m", {h.STICKY_KEY: "u1"}, draw=random.random).version for _ in range(50)
    }
    assert len(versions) == 1
    # Without the key the request falls back to the weighted choice.
    assert decide(route, "m", {h.TENANT: "u1"}, draw=lambda: 0.0) == Decision("2", WEIGHTED)


def test_shadow_sampling() -> None:
    route = ROUTE.model_copy(update={"shadow": "2", "shadow_rate": 0.25})
    primary = Decision("1", STABLE)
    assert wants_shadow(route, primary, lambda: 0.2)
    assert not wants_shadow(route, primary, lambda: 0.25)
    assert not wants_shadow(route, Decision("2", PINNED), lambda: 0.0)
    assert not wants_shadow(ROUTE, primary, lambda: 0.0)
