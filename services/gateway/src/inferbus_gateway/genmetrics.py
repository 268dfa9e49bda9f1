"""Prometheus metrics of the gateway's generative path (`inferbus_gateway.generation`)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

GEN_REQUESTS = Counter(
    "inferbus_gateway_gen_requests_total",
    "Generative requests answered, by status (OK, CANCELLED or a StatusCode name).",
    ["model", "status"],
)
GEN_TTFT = Histogram(
    "inferbus_gateway_gen_time_to_first_token_seconds",
    "From the gateway receiving a generative request to its first token.",
    ["model"],
    buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0),
)
GEN_INTER_TOKEN = Histogram(
    "inferbus_gateway_gen_inter_token_seconds",
    "Time between chunks seen by the gateway, divided by the tokens they carry.",
    ["model"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
)
GEN_TOKENS = Counter(
    "inferbus_gateway_gen_tokens_total",
    "Tokens of answered generative requests, by kind (prompt, completion).",
    ["model", "kind"],
)
GEN_TOKENS_PER_SECOND = Histogram(
    "inferbus_gateway_gen_tokens_per_second",
    "Completion tokens per second of each finished stream (after its first token).",
    ["model"],
    buckets=(1, 5, 10, 25, 50, 100, 200, 400, 800, 1600, 3200),
)
GEN_CANCELS = Counter(
    "inferbus_gateway_gen_cancels_total",
    "Cancels published to workers, by why (client-gone, deadline, gap; late: sent again "
    "because the first one went out before any worker held the request).",
    ["why"],
)
GEN_GAPS = Counter(
    "inferbus_gateway_gen_stream_gaps_total",
    "Streams failed because a chunk never arrived (sequence gap).",
)

GEN_FRAMES_BAD = Counter(
    "inferbus_gateway_gen_bad_frames_total",
    "Chunk frames that could not be unpacked (their streams then fail on a gap).",
)
