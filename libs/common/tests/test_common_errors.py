"""The error hierarchy and its status mapping (`inferbus_common.errors`)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from inferbus_common import errors
from inferbus_common.errors import (
    InferbusError,
    ResourceExhausted,
    StatusCode,
    error_from_status,
    status_of,
)

ERROR_CLASSES = [
    cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, InferbusError) and cls is not InferbusError
]


@pytest.mark.parametrize("code", list(StatusCode))
def test_every_code_has_a_grpc_name_and_an_http_code(code: StatusCode) -> None:
    assert code.grpc_name == code.name
    assert grpc.StatusCode[code.grpc_name] is not None  # a real gRPC status name
    assert 200 <= code.http_status <= 599
    assert isinstance(code.retryable, bool)


def test_http_codes() -> None:
    assert {c.name: c.http_status for c in StatusCode} == {
        "OK": 200,
        "INVALID_ARGUMENT": 400,
        "NOT_FOUND": 404,
        "UNAUTHENTICATED": 401,
        "PERMISSION_DENIED": 403,
        "FAILED_PRECONDITION": 400,
        "RESOURCE_EXHAUSTED": 429,
        "DEADLINE_EXCEEDED": 504,
        "UNAVAILABLE": 503,
        "CANCELLED": 499,
        "UNIMPLEMENTED": 400,
        "INTERNAL": 500,
    }


def test_only_unavailable_and_resource_exhausted_are_retryable() -> None:
    assert {c for c in StatusCode if c.retryable} == {
        StatusCode.UNAVAILABLE,
        StatusCode.RESOURCE_EXHAUSTED,
    }


def test_from_name() -> None:
    assert StatusCode.from_name("NOT_FOUND") is StatusCode.NOT_FOUND
    assert StatusCode.from_name("nonsense") is StatusCode.INTERNAL
    assert StatusCode.from_name("") is StatusCode.INTERNAL


def test_each_error_class_has_its_own_code() -> None:
    codes = [cls.code for cls in ERROR_CLASSES]
    assert len(codes) == len(set(codes))
    assert set(codes) == set(StatusCode) - {StatusCode.OK}


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_error_from_status_round_trip(cls: type[InferbusError]) -> None:
    for code in (cls.code, cls.code.name):
        err = error_from_status(code, "what went wrong")
        assert type(err) is cls
        assert status_of(err) == (cls.code, "what went wrong")
        assert str(err) == "what went wrong"


def test_unknown_status_name_becomes_internal() -> None:
    err = error_from_status("TEAPOT", "short and stout")
    assert type(err) is errors.Internal
    assert status_of(err) == (StatusCode.INTERNAL, "short and stout")


def test_ok_is_not_an_error_class() -> None:
    assert type(error_from_status(StatusCode.OK, "?")) is errors.Internal


@pytest.mark.parametrize(
    "exc", [ValueError("db password is hunter2"), KeyError("secret"), asyncio.CancelledError()]
)
def test_status_of_hides_non_inferbus_errors(exc: BaseException) -> None:
    code, message = status_of(exc)
    assert code is StatusCode.INTERNAL
    assert message == "internal error (see service logs)"
    assert str(exc) not in message or not str(exc)


def test_subclasses_are_found_through_the_mro() -> None:
    class QueueFull(ResourceExhausted):
        pass

    err = QueueFull("queue of fraud/1 is full", reason="queue-full", retry_after_s=0.5)
    assert status_of(err) == (StatusCode.RESOURCE_EXHAUSTED, "queue of fraud/1 is full")
    assert (err.reason, err.retry_after_s) == ("queue-full", 0.5)
    assert err.args == ("queue of fraud/1 is full",)
    assert isinstance(err, InferbusError)
