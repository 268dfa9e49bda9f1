"""Triton's ModelStreamInfer: many requests and their responses on one gRPC stream.

Each request read from the stream is served in a task of its own (at most
``stream_max_in_flight`` at once per stream; beyond it the stream is not
read, and gRPC flow control holds the client back), and its responses are
written as they come, in completion order; clients match them by request
id. What a request gets depends on the model:

* an ordinary tensor model: one response, ``triton_final_response: true``;
* a decoupled tensor model (`inferbus_gateway.triton.decoupled`): 0..n responses,
  then an empty final one when the request asked for it
  (``triton_enable_empty_final_response``);
* a generative model (`inferbus_gateway.triton.llm`, Triton's vLLM backend
  contract): one response per generated chunk, or one at the end;
* a sequence model: one response; the requests of one sequence are sent in
  the order the stream delivered them (their turn is taken as they are read).

An error answers its request with ``error_message`` and the stream goes on.
A client that cancels the stream cancels every request still served
(generations are aborted in the engine). Details: docs/architecture.md
("Streaming and decoupled models").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from prometheus_client import Counter, Gauge

from inferbus_common.errors import InferbusError, Unavailable, status_of
from inferbus_gateway.canonical import InferRequest, InferResponse
from inferbus_gateway.generation import GenerationService
from inferbus_gateway.grpc_api.converters import (
    parameter_values,
    request_from_proto,
    response_to_proto,
)
from inferbus_gateway.grpc_api.tolerant import Undecodable
from inferbus_gateway.observation.access import RequestScope
from inferbus_gateway.service import InferenceService
from inferbus_gateway.triton.classification import Classifier
from inferbus_gateway.triton.decoupled import split_responses
from inferbus_gateway.triton.llm import chunk_outputs, read_call
from inferbus_gateway.triton.sequences import SequenceTurn, sequence_flags
from inferbus_proto.v2 import grpc_predict_v2_pb2 as pb

log = logging.getLogger(__name__)

FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"

STREAMS = Gauge(
    "inferbus_gateway_open_streams",
    "ModelStreamInfer streams open now.",
)
STREAM_RESPONSES = Counter(
    "inferbus_gateway_stream_responses_total",
    "Responses written on ModelStreamInfer streams, by kind (response; empty-final: "
    "the flag-only final response of a decoupled request; error).",
    ["kind"],
)


def _final(message: pb.ModelInferResponse, final: bool) -> pb.ModelStreamInferResponse:
    message.parameters[FINAL].bool_param = final
    STREAM_RESPONSES.labels("response").inc()
    return pb.ModelStreamInferResponse(infer_response=message)


def _error(request: Any, exc: BaseException) -> pb.ModelStreamInferResponse:
    """The stream message answering one request with an error."""
    _, message = status_of(exc)
    model = getattr(request, "model_name", "")
    answer = pb.ModelInferResponse(
        model_name=model if isinstance(model, str) else "",
        model_version=getattr(request, "model_version", "") or "",
        id=getattr(request, "id", "") or "",
    )
    answer.parameters[FINAL].bool_param = True
    STREAM_RESPONSES.labels("error").inc()
    return pb.ModelStreamInferResponse(error_message=message, infer_response=answer)


def scope_for(
    service: InferenceService, request: pb.ModelInferRequest, headers: dict[str, str], log: bool
) -> RequestScope:
    """The access-log and span scope of one gRPC inference request."""
    return RequestScope(
        "grpc", request.model_name, headers.get("traceparent", ""), log, service.trace
    )


async def infer_one(
    service: InferenceService,
    classifier: Classifier | None,
    request: pb.ModelInferRequest,
    headers: dict[str, str],
    context: grpc.aio.ServicerContext,
    *,
    access_log: bool,
    streaming: bool = False,
    turn: SequenceTurn | None = None,
) -> tuple[InferRequest, InferResponse]:
    """Serve one tensor request of `ModelInfer` or a stream: the request as read and
    its answer (classification applied).

    Raises:
        InferbusError: with the status the client should see.
    """
    with scope_for(service, request, headers, access_log) as scope:
        canonical = request_from_proto(request, context.time_remaining())
        canonical.traceparent = scope.traceparent
        canonical.streaming = streaming
        canonical.turn = turn
        scope.request = canonical
        response = await service.infer(canonical, "grpc", headers)
        scope.response = response
        if canonical.classification:
            if classifier is None:
                raise Unavailable("the classification extension needs the registry (labels files)")
            await classifier.apply(canonical, response)
    return canonical, response


class StreamHandler:
    """Serves ModelStreamInfer streams (see the module docstring).

    Args:
        service: the protocol-neutral gateway.
        generation: the generative path (None: generative models are refused).
        classifier: Triton's classification extension (None: refused).
        access_log: write one access-log line per request.
        max_in_flight: requests of one stream served at once.
    """

    def __init__(
        self,
        service: InferenceService,
        *,
        generation: GenerationService | None = None,
        classifier: Classifier | None = None,
        access_log: bool = True,
        max_in_flight: int = 256,
    ) -> None:
        self._service = service
        self._generation = generation
        self._classifier = classifier
        self._access_log = access_log
        self._max = max_in_flight

    async def serve(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """The response stream of one ModelStreamInfer call."""
        headers = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        out: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        room = asyncio.Semaphore(self._max)
        tasks: set[asyncio.Task[None]] = set()

        async def read() -> None:
            try:
                async for request in requests:
                    if isinstance(request, Undecodable):
                        out.put_nowait(_error(None, request.error_for_client()))
                        continue
                    await room.acquire()
                    task = asyncio.create_task(
                        self._serve_one(request, self._turn(request), headers, context, out)
                    )
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    task.add_done_callback(lambda _task: room.release())
                if tasks:
                    await asyncio.gather(*list(tasks), return_exceptions=True)
            finally:
                out.put_nowait(None)

        STREAMS.inc()
        reader = asyncio.create_task(read())
        try:
            while True:
                item = await out.get()
                if item is None:
                    break
                yield item
            await reader
        finally:
            STREAMS.dec()
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(reader, *tasks, return_exceptions=True)

    def _turn(self, request: pb.ModelInferRequest) -> SequenceTurn | None:
        """The request's place in its sequence, taken in stream order (None: not a sequence)."""
        sequences = self._service.sequences
        if sequences is None or not request.parameters:
            return None
        try:
            flags = sequence_flags(parameter_values(request.parameters))
        except InferbusError:
            return None  # refused when the request is served
        if flags is None:
            return None
        return sequences.turn(request.model_name, request.model_version, flags)

    async def _serve_one(
        self,
        request: pb.ModelInferRequest,
        turn: SequenceTurn | None,
        headers: dict[str, str],
        context: grpc.aio.ServicerContext,
        out: asyncio.Queue[pb.ModelStreamInferResponse | None],
    ) -> None:
        try:
            dv = None
            with contextlib.suppress(InferbusError):
                dv = self._service.resolve(request.model_name, request.model_version)
            if dv is not None and dv.config.generative:
                await self._generate(request, headers, context, out)
                return
            canonical, response = await infer_one(
                self._service,
                self._classifier,
                request,
                headers,
                context,
                access_log=self._access_log,
                streaming=True,
                turn=turn,
            )
            self._answer(request, canonical, response, out)
        except InferbusError as exc:
            out.put_nowait(_error(request, exc))
        except Exception as exc:  # one request's bug must not end the stream
            log.exception("unhandled error serving a stream request")
            out.put_nowait(_error(request, exc))
        finally:
            if turn is not None:
                turn.release()

    def _answer(
        self,
        request: pb.ModelInferRequest,
        canonical: InferRequest,
        response: InferResponse,
        out: asyncio.Queue[pb.ModelStreamInferResponse | None],
    ) -> None:
        dv = self._service.resolve(request.model_name, response.version)
        decoupled = dv.config.decoupled
        if decoupled is None:
            out.put_nowait(_final(response_to_proto(response), True))
            return
        for part in split_responses(decoupled, response):
            out.put_nowait(_final(response_to_proto(part), False))
        if parameter_values(request.parameters).get(EMPTY_FINAL) is True:
            empty = pb.ModelInferResponse(
                model_name=response.model, model_version=response.version, id=response.id
            )
            empty.parameters[FINAL].bool_param = True
            STREAM_RESPONSES.labels("empty-final").inc()
            out.put_nowait(pb.ModelStreamInferResponse(infer_response=empty))

    async def _generate(
        self,
        request: pb.ModelInferRequest,
        headers: dict[str, str],
        context: grpc.aio.ServicerContext,
        out: asyncio.Queue[pb.ModelStreamInferResponse | None],
    ) -> None:
        """A generative model: Triton's vLLM backend contract (`inferbus_gateway.triton.llm`)."""
        if self._generation is None:
            raise Unavailable("this gateway does not serve generative models")
        scope = scope_for(self._service, request, headers, self._access_log)
        with scope:
            canonical = request_from_proto(request, context.time_remaining())
            scope.request = canonical
            dv = self._generation.resolve(request.model_name, request.model_version)
            call = read_call(dv.config, canonical.inputs, parameter_values(request.parameters))
            request_id = canonical.id or uuid.uuid4().hex
            generation = await self._generation.open(
                request.model_name,
                call.request,
                headers,
                version=request.model_version,
                timeout_s=canonical.timeout_s,
                request_id=request_id,
                traceparent=scope.traceparent,
            )
            async for chunk in generation.chunks():
                final = chunk.finish_reason is not None
                outputs = chunk_outputs(call, chunk, final=final)
                if outputs is None:
                    continue
                answer = InferResponse(
                    model=request.model_name,
                    version=generation.version,
                    id=canonical.id,
                    outputs=outputs,
                )
                out.put_nowait(_final(response_to_proto(answer), final))
            scope.response = InferResponse(
                model=request.model_name, version=generation.version, id=canonical.id, outputs=[]
            )
