"""The version choice (`inferbus_common.resolver`): pinned → sticky → weighted, the
gateway's open `SPLIT`, and the errors of pins that name nothing."""

from __future__ import annotations

import random

import pytest

from inferbus_common.catalog import Route
from inferbus_common.errors import NotFound
from inferbus_common.resolver import (
    PINNED,
    SPLIT,
    STABLE,
    STICKY,
    STICKY_BUCKETS,
    WEIGHTED,
    Decision,
    decide,
    has_shadow,
    pinned_version,
    stickiness_key,
    sticky_bucket,
    wants_shadow,
)

SEMVER = Route(
    model="m", stable="1.0.0", versions=["1.0.0", "1.1.0"], canary="1.1.0", canary_weight=0.0
)
"""The issue's route: stable 1.0.0, canary 1.1.0 at weight 0, no aliases."""
INTEGER = Route(
    model="m", stable="1", versions=["1", "2", "3"], aliases={"stable": "1", "best": "3"}
)
CANARY = INTEGER.model_copy(update={"canary": "2", "canary_weight": 10.0})
GOLDEN = [1109, 8790, 2102]
"""`sticky_bucket` of model ``fraud`` and keys alice, bob, '' (fixed forever)."""
NUMBERS = {"1": "1.0.0", "2": "1.1.0"}
"""A Triton-style version numbering of `SEMVER` (number → version)."""


@pytest.mark.parametrize(
    ("route", "pin", "numbers", "expected"),
    [
        # Semantic versions: the table.
        (SEMVER, "", None, Decision("1.0.0", STABLE)),
        (SEMVER, "canary", None, Decision("1.1.0", PINNED)),
        (SEMVER, "1.1.0", None, Decision("1.1.0", PINNED)),
        (SEMVER, "stable", None, Decision("1.0.0", PINNED)),
        (SEMVER, "1.0.0", None, Decision("1.0.0", PINNED)),
        # Version numbers map through the caller's numbering ...
        (SEMVER, "2", NUMBERS, Decision("1.1.0", PINNED)),
        (SEMVER, "1", NUMBERS, Decision("1.0.0", PINNED)),
        # ... but an exact version name wins over a number.
        (INTEGER, "2", {"2": "3"}, Decision("2", PINNED)),
        # Integer versions, aliases first.
        (INTEGER, "", None, Decision("1", STABLE)),
        (INTEGER, "3", None, Decision("3", PINNED)),
        (INTEGER, "best", None, Decision("3", PINNED)),
        (INTEGER, "stable", None, Decision("1", PINNED)),
        # An alias named like a route field wins over the field.
        (
            CANARY.model_copy(update={"aliases": {"canary": "3"}}),
            "canary",
            None,
            Decision("3", PINNED),
        ),
        (CANARY, "canary", None, Decision("2", PINNED)),
        # A route whose canary equals stable has nothing to split.
        (CANARY.model_copy(update={"canary": "1"}), "", None, Decision("1", STABLE)),
    ],
)
def test_decisions(
    route: Route, pin: str, numbers: dict[str, str] | None, expected: Decision
) -> None:
    assert decide(route, "m", pin, numbers=numbers, draw=lambda: 0.0) == expected
    # The gateway (no draw) gets the same answer whenever no split is needed.
    assert decide(route, "m", pin, numbers=numbers, draw=None) == expected


@pytest.mark.parametrize(
    ("route", "model", "pin", "numbers", "message"),
    [
        (None, "x", "", None, "Request for unknown model: 'x' is not deployed"),
        (None, "x", "1", None, "Request for unknown model: 'x' is not deployed"),
        (INTEGER, "m", "9", None, "model 'm' has no version '9' and no alias '9'"),
        (INTEGER, "m", "9", {"1": "1"}, "model 'm' has no version '9' and no alias '9'"),
        # No canary on the route and no alias of that name: nothing to pin.
        (INTEGER, "m", "canary", None, "model 'm' has no version 'canary' and no alias 'canary'"),
        (
            SEMVER,
            "m",
            "2",
            None,
            r"has no version '2' and no alias '2'; versions: \['1.0.0', '1.1.0'\]",
        ),
        (Route(model="m", stable=""), "m", "", None, "model 'm' has no stable version"),
    ],
)
def test_pins_that_name_nothing_are_not_found(
    route: Route | None, model: str, pin: str, numbers: dict[str, str] | None, message: str
) -> None:
    with pytest.raises(NotFound, match=message):
        decide(route, model, pin, numbers=numbers)
    with pytest.raises(NotFound, match=message):
        pinned_version(route, model, pin, numbers)


def test_the_gateway_leaves_a_canary_split_to_the_router() -> None:
    assert decide(CANARY, "m", draw=None) == Decision("", SPLIT)
    assert not decide(CANARY, "m", draw=None).decided
    assert decide(CANARY, "m", sticky_key="alice", draw=None) == Decision("", SPLIT)
    # A pin needs no split.
    assert decide(CANARY, "m", "3", draw=None) == Decision("3", PINNED)
    # Weight 0 (configured) cannot become more at the router: decided here.
    assert decide(CANARY.model_copy(update={"canary_weight": 0.0}), "m", draw=None).decided


def test_pin_wins_over_sticky_and_weight() -> None:
    route = CANARY.model_copy(update={"sticky": "tenant", "canary_weight": 100.0})
    assert decide(route, "m", "1", sticky_key="t") == Decision("1", PINNED)
    assert decide(route, "m", sticky_key="t") == Decision("2", STICKY)


def test_weighted_choice_follows_the_draw() -> None:
    assert decide(CANARY, "m", draw=lambda: 0.0999) == Decision("2", WEIGHTED)
    assert decide(CANARY, "m", draw=lambda: 0.1) == Decision("1", WEIGHTED)
    # The effective weight (health-scaled) replaces the configured one.
    assert decide(CANARY, "m", canary_weight=5.0, draw=lambda: 0.07).version == "1"
    assert decide(CANARY, "m", canary_weight=0.0, draw=lambda: 0.0) == Decision("1", STABLE)


def test_weighted_split_is_close_to_the_weight() -> None:
    rng = random.Random(7)
    n = 100_000
    hits = sum(decide(CANARY, "m", draw=rng.random).version == "2" for _ in range(n))
    assert abs(hits / n - 0.10) < 0.005


def test_sticky_bucket_is_a_fixed_function_of_model_and_key() -> None:
    # Golden values: any change of the hash moves users between versions.
    assert 0 <= sticky_bucket("m", "alice") < STICKY_BUCKETS
    assert [sticky_bucket("fraud", k) for k in ("alice", "bob", "")] == GOLDEN
    # Different models spread the same key independently.
    same = sum(sticky_bucket("a", str(k)) == sticky_bucket("b", str(k)) for k in range(1000))
    assert same < 5


def test_sticky_keys_split_by_weight_and_move_monotonically() -> None:
    keys = [f"tenant-{i}" for i in range(20_000)]
    on_canary = {k for k in keys if decide(CANARY, "m", sticky_key=k).version == "2"}
    assert abs(len(on_canary) / len(keys) - 0.10) < 0.01
    # Raising the weight only adds keys to the canary; none flips back.
    wider = CANARY.model_copy(update={"canary_weight": 25.0})
    on_canary_25 = {k for k in keys if decide(wider, "m", sticky_key=k).version == "2"}
    assert on_canary <= on_canary_25
    # A health-scaled weight below the configured one moves keys back to stable only.
    cut = {k for k in keys if decide(CANARY, "m", sticky_key=k, canary_weight=5.0).version == "2"}
    assert cut <= on_canary and len(cut) < len(on_canary)


@pytest.mark.parametrize(
    ("sticky", "tenant", "header", "expected"),
    [
        ("", "t", "h", ""),
        ("tenant", "t", "h", "t"),
        ("header:X-User", "t", "h", "h"),
        ("header:X-User", "t", "", ""),
        ("bogus", "t", "h", ""),
    ],
)
def test_stickiness_key(sticky: str, tenant: str, header: str, expected: str) -> None:
    route = CANARY.model_copy(update={"sticky": sticky})
    assert stickiness_key(route, tenant, header) == expected
    assert stickiness_key(None, tenant, header) == ""


def test_shadow_sampling() -> None:
    route = INTEGER.model_copy(update={"shadow": "2", "shadow_rate": 0.25})
    primary = Decision("1", STABLE)
    assert has_shadow(route) and not has_shadow(INTEGER)
    assert wants_shadow(route, primary, lambda: 0.2)
    assert not wants_shadow(route, primary, lambda: 0.25)
    assert not wants_shadow(route, Decision("2", PINNED), lambda: 0.0)
    assert not wants_shadow(INTEGER, primary, lambda: 0.0)
