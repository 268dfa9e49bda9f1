"""The gateway dispatcher's metrics (`inferbus_gateway.dispatch.dispatcher`): bundles
sent and received, how many collected requests, requests in flight, the CPU reading."""

from __future__ import annotations

from prometheus_client import Gauge

from inferbus_common.loopmetrics import LoopCounter, LoopGauge, LoopHistogram

DUPLICATE_REPLIES = LoopCounter(
    "inferbus_gateway_duplicate_replies_total",
    "Replies dropped because the request was already answered (or given up).",
)
BUNDLE_REQUESTS = LoopHistogram(
    "inferbus_gateway_bundle_requests",
    "Requests per request bundle the gateway sent.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
REPLY_BUNDLES = LoopCounter(
    "inferbus_gateway_reply_bundles_total",
    "Reply bundles received (each answers one or more requests).",
)
HELD_BUNDLES = LoopCounter(
    "inferbus_gateway_held_bundles_total",
    "Bundles that collected requests for the bundle window (CPU was short), as opposed "
    "to going at the end of the loop turn that opened them.",
)
RELEASED_BUNDLES = LoopCounter(
    "inferbus_gateway_released_bundles_total",
    "Held bundles sent before their window ended because a reply bundle for the same "
    "subject came back (an execution slot finished a batch).",
)
IN_FLIGHT = LoopGauge(
    "inferbus_gateway_dispatch_in_flight",
    "Requests sent into the platform (or waiting in an open bundle) and not answered yet.",
)
CPU_BUSY = Gauge(
    "inferbus_gateway_cpu_busy",
    "Busy share (moving average) of the machine's CPUs, the cgroup's quota or the "
    "gateway's event loop, whichever is highest: from bundle_busy_cpu on, bundles "
    "collect requests for the bundle window.",
)
