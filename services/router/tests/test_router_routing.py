"""The router's version choice."""

from __future__ import annotations

import pytest

from inferbus_common.catalog import Route
from inferbus_common.errors import NotFound
from inferbus_router.routing import choose_version

ROUTE = Route(model="m", stable="1", versions=["1", "2"], aliases={"stable": "1", "canary": "2"})


def test_unpinned_goes_to_stable() -> None:
    assert choose_version(ROUTE, "m", "") == "1"


def test_pinned_version_and_alias() -> None:
    assert choose_version(ROUTE, "m", "2") == "2"
    assert choose_version(ROUTE, "m", "canary") == "2"


def test_unknown_model_and_version() -> None:
    with pytest.raises(NotFound, match="model 'x' is not deployed"):
        choose_version(None, "x", "")
    with pytest.raises(NotFound, match="no version or alias '9'"):
        choose_version(ROUTE, "m", "9")
