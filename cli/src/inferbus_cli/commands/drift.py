"""``inferbus drift report``: the worst-drifting features of a model, from the drift KV bucket.

Gateways with drift sampling on (``INFERBUS_GATEWAY_DRIFT_SAMPLE_RATE``)
write their latest PSI/KS per model version into ``<prefix>_drift``; this
reads it, so no Prometheus or gateway scrape is needed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import nats
import nats.errors
import nats.js.errors

from inferbus_cli.busclient import connect_nats, nats_url
from inferbus_common.drift import DriftReport
from inferbus_common.subjects import Subjects


async def load_reports(url: str, prefix: str, model: str, version: str = "") -> list[DriftReport]:
    """Every stored drift report of `model` (one per version), newest version last."""
    subjects = Subjects(prefix)
    nc = await connect_nats(url)
    try:
        try:
            kv = await nc.jetstream().key_value(subjects.drift_bucket)
        except nats.js.errors.BucketNotFoundError:
            return []
        if version:
            keys = [subjects.model_key(model, version)]
        else:
            try:
                keys = await kv.keys()
            except nats.js.errors.NoKeysError:
                return []
            head = subjects.model_key(model) + "."
            keys = [k for k in keys if k.startswith(head)]
        reports = []
        for key in keys:
            try:
                entry = await kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                continue
            if entry.value:
                reports.append(DriftReport.model_validate_json(entry.value))
        return sorted(reports, key=lambda r: r.ts_unix_ms)
    finally:
        await nc.close()


def run_report(args: argparse.Namespace) -> int:
    """Print the worst features per version; 1 when there is nothing to show."""
    try:
        reports = asyncio.run(load_reports(nats_url(args), args.prefix, args.model, args.version))
    except (nats.errors.Error, OSError) as exc:
        print(f"error: cannot read drift statistics from NATS: {exc}", file=sys.stderr)
        return 1
    if not reports:
        print(
            f"error: no drift statistics for model {args.model!r}"
            + (f" version {args.version!r}" if args.version else "")
            + "; it needs a version pushed with profile.json, gateways with "
            "INFERBUS_GATEWAY_DRIFT_SAMPLE_RATE > 0 and enough traffic (drift_min_rows)",
            file=sys.stderr,
        )
        return 1
    if args.json:
        docs = []
        for r in reports:
            doc = r.model_dump(mode="json")
            doc["worst"] = [
                {"feature": name, "psi": fd.psi, "ks": fd.ks, "drifting": fd.psi > args.threshold}
                for name, fd in r.worst(args.top)
            ]
            docs.append(doc)
        print(json.dumps(docs, indent=2))
        return 0
    for r in reports:
        age = max(0.0, time.time() - r.ts_unix_ms / 1000.0)
        drifting = sum(1 for fd in r.features.values() if fd.psi > args.threshold)
        print(
            f"{r.model} version {r.version}: {len(r.features)} features over {r.rows} rows, "
            f"{drifting} above PSI {args.threshold:g} (computed {age:.0f}s ago)"
        )
        print(f"  {'feature':<28} {'psi':>8} {'ks':>8}")
        for name, fd in r.worst(args.top):
            ks_text = f"{fd.ks:8.4f}" if fd.ks is not None else f"{'-':>8}"
            flag = "  DRIFT" if fd.psi > args.threshold else ""
            print(f"  {name:<28} {fd.psi:8.4f} {ks_text}{flag}")
    return 0
