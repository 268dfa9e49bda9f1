"""Prometheus metrics of the LLM worker (process-wide, default registry).

vLLM's own ``vllm:*`` metrics (KV cache usage, running/waiting requests, its
TTFT histogram ...) land in the same registry and are exported next to these.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LABELS = ("model", "version")
_LATENCY = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)

REQUESTS = Counter(
    "inferbus_llm_requests",
    "Generation requests answered, by status (OK, a StatusCode name, or ABORTED).",
    [*_LABELS, "status"],
)
REJECTED = Counter(
    "inferbus_llm_rejected",
    "Requests refused at once because running + waiting reached the bound (429).",
    _LABELS,
)
HANDED_OFF = Counter(
    "inferbus_llm_handed_off",
    "Requests a full (or stopping) worker published back to the version's subject for a "
    "worker with room (it had withdrawn from the queue group; they were on their way).",
    _LABELS,
)
ABORTED = Counter(
    "inferbus_llm_aborted",
    "Requests aborted in the engine, by why (cancelled, deadline, shutdown, engine-dead, publish).",
    [*_LABELS, "why"],
)
ENGINE_RESTARTS = Counter(
    "inferbus_llm_engine_restarts",
    "Restarts of a dead vLLM engine inside the worker, by result (ok, failed).",
    [*_LABELS, "result"],
)
ARTIFACTS_REJECTED = Counter(
    "inferbus_llm_artifacts_rejected",
    "Versions refused before loading, by reason (signature, digest).",
    ["reason"],
)
IN_FLIGHT = Gauge(
    "inferbus_llm_in_flight",
    "Requests this worker holds in its engine (running + waiting).",
    _LABELS,
)
ENGINE_UNFINISHED = Gauge(
    "inferbus_llm_engine_unfinished_requests",
    "Unfinished requests inside vLLM (read from the engine every 0.25 s; 0 when dead).",
    _LABELS,
)
RUNNING_SEQS = Gauge(
    "inferbus_llm_running_sequences",
    "Sequences vLLM's scheduler runs (last engine step with stats).",
    _LABELS,
)
WAITING_SEQS = Gauge(
    "inferbus_llm_waiting_sequences",
    "Sequences waiting in vLLM's scheduler (last engine step with stats).",
    _LABELS,
)
KV_CACHE_USAGE = Gauge(
    "inferbus_llm_kv_cache_usage_ratio",
    "Share of the KV cache in use, 0..1 (vLLM scheduler stats).",
    _LABELS,
)
REFUSED_LATE = Counter(
    "inferbus_llm_refused_late",
    "Requests refused (429 llm-late) because, waiting behind the worker's queue, they "
    "would have ended past their deadline by the worker's recent timings.",
    _LABELS,
)
ESTIMATED_WAIT = Gauge(
    "inferbus_llm_estimated_wait_seconds",
    "Estimated wait for a running slot of the last request that arrived (0 while a "
    "slot is free); deadline admission refuses what would end past its deadline.",
    _LABELS,
)
PREFIX_QUERIED = Counter(
    "inferbus_llm_prefix_cache_queried_tokens",
    "Prompt tokens vLLM looked up in its prefix cache.",
    _LABELS,
)
PREFIX_HITS = Counter(
    "inferbus_llm_prefix_cache_hit_tokens",
    "Prompt tokens found in vLLM's prefix cache (prefill skipped); divided by "
    "inferbus_llm_prefix_cache_queried_tokens it is the hit rate.",
    _LABELS,
)
PROMPT_TOKENS = Counter("inferbus_llm_prompt_tokens", "Prompt tokens processed.", _LABELS)
GENERATED_TOKENS = Counter(
    "inferbus_llm_generated_tokens",
    "Completion tokens generated (rate() of it is the worker's tokens/s).",
    _LABELS,
)
TTFT_SECONDS = Histogram(
    "inferbus_llm_time_to_first_token_seconds",
    "From the request reaching the worker to its first token.",
    _LABELS,
    buckets=_LATENCY,
)
INTER_TOKEN_SECONDS = Histogram(
    "inferbus_llm_inter_token_seconds",
    "Time between streamed chunks divided by the tokens they carry.",
    _LABELS,
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
)
QUEUE_SECONDS = Histogram(
    "inferbus_llm_queue_seconds",
    "Time a request waited in vLLM's scheduler before it first ran.",
    _LABELS,
    buckets=_LATENCY,
)
TOKENS_PER_SECOND = Histogram(
    "inferbus_llm_request_tokens_per_second",
    "Decode speed of each finished request (completion tokens / time after the first).",
    _LABELS,
    buckets=(1, 5, 10, 25, 50, 100, 200, 400, 800, 1600, 3200),
)
CHUNK_MESSAGES = Counter(
    "inferbus_llm_chunk_messages",
    "Messages that carried chunks to gateways, by how (frame: the chunks of several "
    "streams for one gateway; single: one chunk, e.g. an error or a gateway without frames).",
    [*_LABELS, "how"],
)
FRAMED_CHUNKS = Counter(
    "inferbus_llm_framed_chunks",
    "Chunks sent inside frames (÷ frame messages = chunks per frame).",
    _LABELS,
)
