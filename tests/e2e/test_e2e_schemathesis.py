"""Schemathesis against the Open Inference Protocol REST specification.

The specification is KServe's ``docs/predict-api/v2/rest_predict_v2.yaml``,
vendored unmodified in ``tests/e2e/specs`` (see its NOTICE). One adaptation
when loading it: its path templates are written ``${MODEL_NAME}``, which
OpenAPI reads as a literal ``$`` before the parameter; servers of the
protocol (Triton, KServe, inferbus) serve ``/v2/models/{name}``, so the
``$`` is dropped. Requests are generated from the schemas, valid ones
for every operation and invalid ones (schemathesis' negative mode) for
inference, the one operation with a body, once with any
model name and version and once with the stack's real model ``simple``
version ``1`` (so inference requests reach a model). Every answer must be
no server error (5xx) and, where the specification gives the response a
schema, conform to it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error, response_schema_conformance
from schemathesis.generation import GenerationMode

from inferbus_testing.stack import LocalStack
from inferbus_testing.tritonmodels import write_simple

pytestmark = pytest.mark.integration

SPEC = Path(__file__).parent / "specs" / "rest_predict_v2.yaml"
EXAMPLES = 40
"""Generated requests per operation, mode and naming (about 30 s in all)."""


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    base = tmp_path_factory.mktemp("schemathesis")
    with LocalStack(base, workers=1) as stack:
        stack.push(write_simple(base / "simple"), "simple")
        stack.wait_model_ready("simple")
        yield stack


def _schema(base_url: str) -> schemathesis.BaseSchema:
    spec = yaml.safe_load(SPEC.read_text(encoding="utf-8"))
    spec["paths"] = {path.replace("${", "{"): item for path, item in spec["paths"].items()}
    schema = schemathesis.openapi.from_dict(spec)
    schema.config.update(base_url=base_url)
    return schema


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("real_model", [False, True], ids=["any-name", "real-model"])
def test_no_server_errors_and_responses_match_the_spec(
    api: LocalStack, mode: GenerationMode, real_model: bool
) -> None:
    schema = _schema(f"http://{api.http_url}")
    names = {"MODEL_NAME": "simple", "MODEL_VERSION": "1"} if real_model else None
    checks = [not_a_server_error, response_schema_conformance]
    tested = []
    for result in schema.get_all_operations():
        operation = result.ok()
        params = names if names and "{MODEL_NAME}" in operation.path else None
        if mode is GenerationMode.NEGATIVE and not operation.body:
            continue  # only a body can be invalid (any text is a valid path parameter)
        strategy = operation.as_strategy(mode, path_parameters=params)

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=strategy)
        def run(case: schemathesis.Case) -> None:
            case.call_and_validate(checks=checks, timeout=30)

        run()
        tested.append(operation.label)
    # Every operation in the positive mode; inference alone in the negative one.
    assert len(tested) == (6 if mode is GenerationMode.POSITIVE else 1), tested
