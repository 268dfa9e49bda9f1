"""Live drift: sampled traffic compared with each version's reference profile.

`DriftMonitor.observe` runs on the request path: for a version that carries a
profile (`DeployedVersion.has_profile`) it draws against the sample rate and
queues references to the request's input and the answer's output tensors. A
background task turns them into numpy rows, keeps the last `window_rows` rows
per model/version/tensor (`SlidingWindow`) and, every `interval_s`, computes
PSI and KS per feature against the profile (`inferbus_common.drift`) in a
worker thread. Results are exported as gauges and written to the drift KV
bucket (key ``<model>.<version>``) so ``inferbus drift report`` can read them
without scraping any gateway.

The profile itself is read from the profiles KV bucket, where the registry
publishes the ``profile.json`` of each version that has one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable

import nats.errors
import nats.js.errors
import numpy as np
from nats.aio.client import Client
from nats.js.kv import KeyValue
from prometheus_client import Counter, Gauge

from inferbus_common.catalog import Catalog, ensure_kv
from inferbus_common.codec import Tensor
from inferbus_common.drift import (
    DriftReport,
    Profile,
    SlidingWindow,
    as_rows,
    evaluate,
    parse_profile,
    profiled_columns,
)
from inferbus_common.subjects import Subjects
from inferbus_gateway.canonical import InferRequest, InferResponse
from inferbus_gateway.observation.sampler import SampledQueue

DRIFT_PSI = Gauge(
    "inferbus_drift_psi",
    "Population stability index of a feature over the live window vs the version's profile.",
    ["model", "version", "feature"],
)
DRIFT_KS = Gauge(
    "inferbus_drift_ks",
    "Kolmogorov-Smirnov statistic of a continuous feature over the live window vs the profile.",
    ["model", "version", "feature"],
)
DRIFT_WINDOW_ROWS = Gauge(
    "inferbus_drift_window_rows",
    "Rows in the live window the drift statistics were computed over.",
    ["model", "version"],
)
DRIFT_SAMPLES = Counter(
    "inferbus_drift_samples_total",
    "Requests sampled for drift, by result: added, queue-full, no-profile, unusable.",
    ["model", "result"],
)

log = logging.getLogger(__name__)

_PROFILE_RETRY_S = 10.0


class _VersionState:
    """Windows and profile of one model version."""

    def __init__(self) -> None:
        self.windows: dict[str, SlidingWindow] = {}
        self.profile: Profile | None = None
        self.columns: dict[str, list[int]] = {}
        """Tensor → the profiled columns its window keeps."""
        self.profile_checked = -1e18
        self.evaluated_at_rows = 0

    def added(self) -> int:
        return sum(w.added for w in self.windows.values())


class DriftMonitor(SampledQueue[tuple[str, str, list[Tensor], list[Tensor]]]):
    """Samples answered requests into sliding windows and computes drift.

    Args:
        nc: connected NATS client.
        catalog: live catalog (tells which versions have a profile).
        subjects: naming scheme.
        rate: fraction (0-1) of answered requests sampled; 0 disables.
        window_rows: rows kept per model/version/tensor.
        min_rows: no statistic is computed on fewer rows.
        interval_s: how often the statistics are recomputed.
        queue_size: sampled requests waiting for the background task at most.
        draw: random source in [0, 1) (injectable for tests).
    """

    def __init__(
        self,
        nc: Client,
        catalog: Catalog,
        subjects: Subjects,
        *,
        rate: float,
        window_rows: int = 5000,
        min_rows: int = 200,
        interval_s: float = 15.0,
        queue_size: int = 1024,
        draw: Callable[[], float] = random.random,
    ) -> None:
        super().__init__(
            rate=rate,
            queue_size=queue_size,
            draw=draw,
            counter=DRIFT_SAMPLES,
            task_name="drift-monitor",
        )
        self._nc = nc
        self._catalog = catalog
        self._subjects = subjects
        self._window_rows = window_rows
        self._min_rows = min_rows
        self._interval_s = interval_s
        self._states: dict[tuple[str, str], _VersionState] = {}
        self._profiles_kv: KeyValue | None = None
        self._drift_kv: KeyValue | None = None

    def observe(self, request: InferRequest, response: InferResponse) -> None:
        """Maybe sample one answered request (cheap; never raises for a full queue)."""
        if self._rate <= 0 or response.degraded:
            return
        dv = self._catalog.versions.get((request.model, response.version))
        if dv is None or not dv.has_profile:
            return
        if not self._sampled():
            return
        self._enqueue(
            request.model, (request.model, response.version, request.inputs, response.outputs)
        )

    async def _run(self) -> None:
        next_eval = time.monotonic() + self._interval_s
        tick = min(0.25, self._interval_s)
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(tick):
                    await self._stop.wait()
            try:
                await self.ingest()
                if time.monotonic() >= next_eval:
                    next_eval = time.monotonic() + self._interval_s
                    await self.evaluate_all()
            except Exception:  # a monitoring loop outlives any one bad round
                log.exception("drift round failed; retrying in %.1f s", tick)

    async def ingest(self) -> int:
        """Move queued samples into the windows; returns the requests taken.

        Only the tensors and columns the version's profile describes are
        kept; samples of a version whose profile cannot be read (yet) are
        dropped and counted as ``no-profile``.
        """
        taken = 0
        while self._queue:
            model, version, inputs, outputs = self._queue.popleft()
            taken += 1
            state = self._states.setdefault((model, version), _VersionState())
            profile = await self._profile(model, version, state)
            if profile is None:
                DRIFT_SAMPLES.labels(model, "no-profile").inc()
                continue
            usable = False
            for tensor in (*inputs, *outputs):
                cols = state.columns.get(tensor.name)
                if cols is None or tensor.datatype == "BYTES":
                    continue
                try:
                    rows = as_rows(tensor.as_numpy())
                except (ValueError, TypeError):
                    continue
                if rows.shape[0] == 0 or rows.shape[1] <= cols[-1]:
                    continue
                window = state.windows.get(tensor.name)
                if window is None:
                    window = SlidingWindow(self._window_rows, len(cols))
                    state.windows[tensor.name] = window
                window.add(rows[:, cols].astype(np.float64))
                usable = True
            DRIFT_SAMPLES.labels(model, "added" if usable else "unusable").inc()
        return taken

    async def _profile(self, model: str, version: str, state: _VersionState) -> Profile | None:
        if state.profile is not None:
            return state.profile
        now = time.monotonic()
        if now - state.profile_checked < _PROFILE_RETRY_S:
            return None
        state.profile_checked = now
        js = self._nc.jetstream()
        if self._profiles_kv is None:
            self._profiles_kv = await ensure_kv(js, self._subjects.profiles_bucket, history=1)
        try:
            entry = await self._profiles_kv.get(self._subjects.model_key(model, version))
        except nats.js.errors.KeyNotFoundError:
            log.warning(
                "version has profile.json but none is published in %s",
                self._subjects.profiles_bucket,
                extra={"model": model, "version": version},
            )
            return None
        try:
            state.profile = parse_profile(entry.value or b"")
        except ValueError as exc:
            log.warning("unusable profile: %s", exc, extra={"model": model, "version": version})
            return None
        state.columns = profiled_columns(state.profile)
        return state.profile

    async def evaluate_all(self) -> list[DriftReport]:
        """Compute and publish drift for every version whose windows grew."""
        reports = []
        for (model, version), state in list(self._states.items()):
            added = state.added()
            if added == state.evaluated_at_rows:
                continue
            rows = min((len(w) for w in state.windows.values()), default=0)
            if rows < self._min_rows:
                continue
            profile = await self._profile(model, version, state)
            if profile is None:
                continue
            windows = {name: w.values() for name, w in state.windows.items()}
            features = await asyncio.to_thread(evaluate, profile, windows, state.columns)
            state.evaluated_at_rows = added
            report = DriftReport(
                model=model,
                version=version,
                ts_unix_ms=time.time_ns() // 1_000_000,
                rows=rows,
                features=features,
            )
            self._export(report)
            await self._store(report)
            reports.append(report)
        return reports

    def _export(self, report: DriftReport) -> None:
        DRIFT_WINDOW_ROWS.labels(report.model, report.version).set(report.rows)
        for name, fd in report.features.items():
            DRIFT_PSI.labels(report.model, report.version, name).set(fd.psi)
            if fd.ks is not None:
                DRIFT_KS.labels(report.model, report.version, name).set(fd.ks)

    async def _store(self, report: DriftReport) -> None:
        if self._drift_kv is None:
            self._drift_kv = await ensure_kv(
                self._nc.jetstream(), self._subjects.drift_bucket, history=1
            )
        key = self._subjects.model_key(report.model, report.version)
        await self._drift_kv.put(key, report.model_dump_json().encode())
