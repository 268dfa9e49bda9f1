"""Turn one ``bench/run_all.py`` results file into ``docs/benchmarks.md`` and a plot.

Every number in the report comes from the one JSONL file given, so ratios
always compare measurements taken in the same run.

Usage::

    uv run python bench/render.py --results bench/results/run-<stamp>.jsonl \
        --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TARGETS = ("inferbus", "triton", "mlserver")
BATCHING_TARGET = 3.0
"""Issue target: dynamic batching gives at least 3x over max_batch_size 1 (heavy, c=64)."""
HIGH_CONCURRENCY = 64
"""The concurrency issue 18's throughput, p99, CPU and message targets are set at."""
CPU_TARGET_US = 600.0
"""Issue 18: platform CPU (services + nats-server) per request at c=64, at most."""
MSGS_TARGET = 1.0
"""Issue 18: messages published to nats-server per request at c=64, at most."""

_FRAME_RE = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
_ENTRY_FRAMES = re.compile(
    r"^(_run_module_as_main|_run_code|<module>|main|run|Runner\.run|_bootstrap|_bootstrap_inner"
    r"|Thread\.run|Thread\._bootstrap|Thread\._bootstrap_inner"
    r"|BaseEventLoop\.run_forever|BaseEventLoop\.run_until_complete) "
)
"""Frames that sit under everything (interpreter start, the loop, thread start):
they say nothing about where the time goes, so the inclusive list skips them."""
EVENT_LOOP_FRAME = "Runner.run (asyncio/runners.py)"
"""With uvloop, time spent inside the loop's C code (epoll, socket reads and
writes, scheduling) shows up as this Python frame, the one that entered it."""


# ---------------------------------------------------------------- profiles


def _short_frame(frame: str) -> str:
    """``func (path/to/pkg/mod.py:12)`` → ``func (pkg/mod.py)``, so lines aggregate."""
    m = _FRAME_RE.match(frame.strip())
    if not m:
        return frame.strip()
    parts = Path(m.group("file")).parts
    return f"{m.group('func')} ({'/'.join(parts[-2:])})"


def summarize_collapsed(text: str, top: int = 8) -> dict[str, Any]:
    """Top frames of a py-spy ``--format raw`` (collapsed stacks) profile.

    Args:
        text: lines ``frame;frame;...;frame <count>``, root first.
        top: how many frames to keep in each list.

    Returns:
        ``samples`` (total), ``top_self`` (leaf frames: where the CPU is spent)
        and ``top_inclusive`` (frames anywhere on the stack, minus those on
        nearly every sample such as the event loop itself), each a list of
        ``[frame, share]`` with share in percent.
    """
    self_counts: Counter[str] = Counter()
    incl_counts: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        count = int(count_s)
        frames = [_short_frame(f) for f in stack.split(";") if f]
        if not frames:
            continue
        total += count
        self_counts[frames[-1]] += count
        for f in set(frames):
            incl_counts[f] += count
    if total == 0:
        return {"samples": 0, "top_self": [], "top_inclusive": []}

    def share(n: int) -> float:
        return round(100.0 * n / total, 1)

    def ranked(counts: Counter[str]) -> list[tuple[str, int]]:
        # Ties by name: a set's order (hash-seeded) must not reorder the page.
        return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))

    inclusive = [
        (f, share(n))
        for f, n in ranked(incl_counts)
        if share(n) < 90.0 and not _ENTRY_FRAMES.match(f)
    ]
    return {
        "samples": total,
        "top_self": [[f, share(n)] for f, n in ranked(self_counts)[:top]],
        "top_inclusive": [[f, s] for f, s in inclusive[:top]],
    }


# ----------------------------------------------------------------- loading


def load(path: Path) -> list[dict[str, Any]]:
    """Every JSON line of a results file."""
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _fmt(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "–"
    return f"{x:,.{digits}f}"


def _fill(fill: dict[str, Any] | None) -> str:
    """``micro-batch rows / engine rows`` (engine rows when workers merge batches)."""
    if not fill:
        return "–"
    engine = fill.get("engine_rows")
    return f"{fill['mean_rows']:.2f}" + (f" / {engine:.2f}" if engine is not None else "")


def _ratio(a: float | None, b: float | None) -> str:
    if not a or not b:
        return "–"
    return f"{a / b:.2f}×"


def _resummarize(profile: dict[str, Any]) -> dict[str, Any]:
    """Recompute a profile's summary from its collapsed-stack file when it is still there."""
    path = REPO / profile["file"]
    if path.exists():
        return profile | summarize_collapsed(path.read_text())
    return profile


class Results:
    """Index over one run's records."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records
        self.run = next((r for r in records if r.get("kind") == "run"), {})
        self.raw = [r for r in records if r.get("kind") == "raw_ort"]
        self.load = [
            r
            for r in records
            if r.get("kind") == "loadgen" and not str(r.get("label", "")).startswith("profile/")
        ]
        self.fill = {r["label"]: r for r in records if r.get("kind") == "batch_fill"}
        self.cpu = {
            (r["target"], r["model"], r["concurrency"]): r
            for r in records
            if r.get("kind") == "platform_cpu"
        }
        self.errors = [r for r in records if r.get("kind") == "error"]
        self.profiles = [_resummarize(r) for r in records if r.get("kind") == "profile"]
        self.cold = [r for r in records if r.get("kind") == "cold_start"]
        self.pa = {
            (r["target"], r["model"], r["concurrency"]): r
            for r in records
            if r.get("kind") == "perf_analyzer"
        }
        cmds = next((r for r in records if r.get("kind") == "commands"), {})
        self.commands: list[str] = cmds.get("commands", [])
        done = next((r for r in records if r.get("kind") == "done"), {})
        self.elapsed_s = done.get("elapsed_s")

    def get(self, target: str, model: str, concurrency: int) -> dict[str, Any] | None:
        """The loadgen record for one cell, if measured."""
        for r in self.load:
            if (r["target"], r["model"], r["concurrency"]) == (target, model, concurrency):
                return r
        return None

    def cpu_for(self, target: str, model: str, concurrency: int) -> dict[str, Any] | None:
        """The ``platform_cpu`` record of one cell, if measured."""
        return self.cpu.get((target, model, concurrency))

    def raw_for(self, model: str, threads: int) -> dict[str, Any] | None:
        """Raw ORT record for a model and thread setting (0 = all cores)."""
        for r in self.raw:
            if r["model"] == model and r["threads"] == threads:
                return r
        return None

    def raw_limit(self, model: str) -> float | None:
        """Best raw ORT batch-32 rows/s over the thread settings measured."""
        rates = [r["batched"]["throughput_rows_s"] for r in self.raw if r["model"] == model]
        return max(rates) if rates else None

    def models(self) -> list[str]:
        """Models measured through a server, in first-seen order."""
        return list(dict.fromkeys(r["model"] for r in self.load))

    def concurrencies(self) -> list[int]:
        """Concurrency levels measured, ascending."""
        return sorted({r["concurrency"] for r in self.load if r["concurrency"]})


# ----------------------------------------------------------------- targets


@dataclass(frozen=True, slots=True)
class TargetRow:
    """One of issue 18's targets for one model, as this run measured it."""

    target: str
    model: str
    inferbus: str
    """What inferbus measured (text)."""
    compared: str
    """What it is compared with (a peer's figure, the limit), text."""
    met: bool | None
    """None: not measured in this run, or a figure that is reported, not judged."""
    measured: bool = True


def _cpu_text(rec: dict[str, Any] | None) -> str:
    if rec is None or rec.get("total_cpu_us_per_req") is None:
        return "not measured"
    return f"{rec['total_cpu_us_per_req']:,.0f} µs/req"


def _throughput_target(
    model: str,
    c: int,
    ib: dict[str, Any] | None,
    peer: dict[str, Any] | None,
    label: str,
    at_least: float,
) -> TargetRow:
    """inferbus' requests/s at least `at_least` times a peer's."""
    name = f"c={c} throughput ≥ {at_least:.1f}× {label}'s"
    if not (ib and peer and peer["throughput_rps"]):
        return TargetRow(name, model, "not measured", f"inferbus and {label} at c={c}", None, False)
    ratio = ib["throughput_rps"] / peer["throughput_rps"]
    return TargetRow(
        name,
        model,
        f"{ib['throughput_rps']:,.0f} req/s = **{ratio:.2f}×**",
        f"{label} {peer['throughput_rps']:,.0f} req/s",
        ratio >= at_least,
    )


def _ms(x: float) -> str:
    """Three significant digits, without an exponent for large values."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _latency_target(
    model: str, c: int, ib: dict[str, Any] | None, peer: dict[str, Any] | None, pct: str
) -> TargetRow:
    """inferbus' latency percentile `pct` no higher than Triton's."""
    name = f"c={c} {pct} ≤ Triton's"
    ours = ib["latency_ms"][pct] if ib else None
    theirs = peer["latency_ms"][pct] if peer else None
    if ours is None or not theirs:
        return TargetRow(name, model, "not measured", f"inferbus and Triton at c={c}", None, False)
    return TargetRow(name, model, f"{_ms(ours)} ms", f"Triton {_ms(theirs)} ms", ours <= theirs)


def target_rows(res: Results) -> list[TargetRow]:
    """Issue 18's targets, one row per target and example model, from this run only."""
    c = HIGH_CONCURRENCY
    rows: list[TargetRow] = []
    for model in ("fraud", "heavy"):
        ib, tr, ml = (res.get(t, model, c) for t in TARGETS)
        rows += [
            _throughput_target(model, c, ib, tr, "Triton", 1.0),
            _latency_target(model, c, ib, tr, "p99"),
            _throughput_target(model, c, ib, ml, "MLServer", 2.0),
        ]
        name = f"platform CPU per request at c={c} ≤ {CPU_TARGET_US:.0f} µs"
        cpu = res.cpu_for("inferbus", model, c) or {}
        total = cpu.get("total_cpu_us_per_req")
        if total is not None:
            peers = "; ".join(
                f"{label} {_cpu_text(res.cpu_for(t, model, c))}"
                for t, label in (("triton", "Triton"), ("mlserver", "MLServer"))
            )
            ours = f"**{total:,.0f} µs/req**"
            if cpu.get("notes"):
                ours += " (incomplete: see the notes under the CPU table)"
            rows.append(TargetRow(name, model, ours, peers, total <= CPU_TARGET_US))
        else:
            rows.append(TargetRow(name, model, "not measured", "inferbus' CPU", None, False))
        name = f"bus messages per request at c={c} ≤ {MSGS_TARGET:.1f} (published to nats-server)"
        if cpu.get("msgs_in_per_req") is not None:
            rows.append(
                TargetRow(
                    name,
                    model,
                    f"**{cpu['msgs_in_per_req']:.2f}** published",
                    f"{cpu['msgs_out_per_req']:.2f} delivered by nats-server (out)",
                    cpu["msgs_in_per_req"] <= MSGS_TARGET,
                )
            )
        else:
            rows.append(TargetRow(name, model, "not measured", "nats-server's /varz", None, False))
        ib1 = res.get("inferbus", model, 1)
        rows.append(_latency_target(model, 1, ib1, res.get("triton", model, 1), "p50"))
        name = "c=1 added p50 over raw onnxruntime (reported)"
        raw = res.raw_for(model, 1)
        if ib1 and raw and ib1["latency_ms"]["p50"] is not None:
            raw_p50 = raw["batch1"]["latency_ms"]["p50"]
            added = f"+{ib1['latency_ms']['p50'] - raw_p50:.3f} ms"
            limit = f"raw ORT batch-1 p50 {raw_p50:.3f} ms (1 thread)"
            rows.append(TargetRow(name, model, added, limit, None))
        else:
            rows.append(
                TargetRow(name, model, "not measured", "inferbus at c=1 and raw ORT", None, False)
            )
    return rows


def _verdict(row: TargetRow) -> str:
    if not row.measured:
        return "not measured"
    if row.met is None:
        return "reported"
    return "yes" if row.met else "**no**"


def section_targets(res: Results) -> list[str]:
    """Issue 18's targets and whether this run met each."""
    lines = [
        "## Targets (issue 18) in this run",
        "",
        "Every figure below comes from this one run (the tables further down show where)."
        " Platform CPU = user + system CPU of the gateway, router, batcher, workers and"
        " nats-server (registry left out: it is off the data path) over the load"
        " generator's measured window, ÷ requests answered in it; the peers' figure is"
        " their whole process tree. Bus messages = nats-server's `/varz` `in_msgs`"
        " (published to it) over the same window ÷ requests answered; `out_msgs`"
        " (delivered) beside it.",
        "",
        "| target | model | inferbus | compared with | met? |",
        "|---|---|---|---|---|",
    ]
    for r in target_rows(res):
        lines.append(f"| {r.target} | {r.model} | {r.inferbus} | {r.compared} | {_verdict(r)} |")
    return [*lines, ""]


# ------------------------------------------------------ perf_analyzer (issue 31)

V3_CPU_TARGET_US = 300.0
"""Issue 31: platform CPU per request at c=64."""
V3_ADDED_P50_MS = 1.0
"""Issue 31: added p50 over raw onnxruntime at concurrency 1."""


def _pa_cell(rec: dict[str, Any] | None) -> str:
    if rec is None:
        return "not run"
    if not rec.get("stable"):
        # perf_analyzer's own words when a figure does not settle; anything else
        # (a server without the model configuration extension) is a failure.
        return "unstable" if "stable" in rec.get("error", "") else "failed"
    return f"{rec['throughput']:,.0f}"


def _pa_latency(rec: dict[str, Any] | None) -> str:
    if rec is None or not rec.get("stable"):
        return "–"
    return f"{rec['p50_us'] / 1000:.2f} / {rec['p99_us'] / 1000:.2f}"


def pa_verdicts(res: Results) -> list[tuple[str, str, int, bool | None]]:
    """(model, what, concurrency, met) for issue 31's perf_analyzer targets: infer/s
    ≥ 1.0× Triton's at every point, p99 at the highest concurrency ≤ Triton's;
    None where either side has no stable figure."""
    out: list[tuple[str, str, int, bool | None]] = []
    levels = sorted({k[2] for k in res.pa})
    entries = [t for t in ("inferbus", "inferbus-edge") if any(k[0] == t for k in res.pa)]
    for model in dict.fromkeys(k[1] for k in res.pa):
        for entry in entries:
            via = " (through the edge)" if entry == "inferbus-edge" else ""
            for c in levels:
                ib, tr = res.pa.get((entry, model, c)), res.pa.get(("triton", model, c))
                both = bool(ib and tr and ib.get("stable") and tr.get("stable"))
                ratio_ok = ib["throughput"] >= tr["throughput"] if both and ib and tr else None
                out.append((model, f"infer/s ≥ 1.0× Triton's{via}", c, ratio_ok))
                if c == levels[-1]:
                    p99_ok = ib["p99_us"] <= tr["p99_us"] if both and ib and tr else None
                    out.append((model, f"p99 ≤ Triton's{via}", c, p99_ok))
    return out


def section_perf_analyzer(res: Results) -> list[str]:
    """perf_analyzer's figures for every server of the run, and issue 31's targets."""
    title = "## perf_analyzer beside Triton and MLServer (issue 31 targets)"
    if not res.pa:
        return [title, "", "Not measured in this run.", ""]
    window = next(iter(res.pa.values())).get("window_ms")
    lines = [
        title,
        "",
        "Triton's own load tool (`perf_analyzer`, from `scripts/install-perf-analyzer.sh`),"
        f" unmodified, gRPC, batch 1, {window} ms windows, stability: three windows in a row"
        " within 20 %, at most 8 windows (`PA_STABILITY` in `bench/run_all.py`), one server"
        " after the other in this run. inferbus serves both models as version `1.0.0`."
        " `unstable`: perf_analyzer found no stable figure; `failed`: it could not run against"
        ' that server (MLServer answers `ModelConfig` with "Method not found": it has no'
        " model configuration extension, which perf_analyzer needs); the errors are in the"
        " results file.",
        "",
        "`edge`: the same stack through the gRPC edge (`inferbus-edge`, services/edge),"
        " which carries each call to the gateway over NATS (docs/architecture.md).",
        "",
        "| model | c | inferbus infer/s | edge infer/s | Triton infer/s | inferbus / Triton"
        " | edge / Triton | MLServer infer/s | inferbus p50 / p99 ms | edge p50 / p99 ms"
        " | Triton p50 / p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
        if a and b and a.get("stable") and b.get("stable") and b["throughput"]:
            return f"**{a['throughput'] / b['throughput']:.2f}×**"
        return "–"

    for model, c in sorted({(k[1], k[2]) for k in res.pa}):
        ib, tr, ml = (res.pa.get((t, model, c)) for t in TARGETS)
        edge = res.pa.get(("inferbus-edge", model, c))
        lines.append(
            f"| {model} | {c} | {_pa_cell(ib)} | {_pa_cell(edge)} | {_pa_cell(tr)}"
            f" | {ratio(ib, tr)} | {ratio(edge, tr)} | {_pa_cell(ml)}"
            f" | {_pa_latency(ib)} | {_pa_latency(edge)} | {_pa_latency(tr)} |"
        )
    lines += ["", "| issue 31 target | model | met? |", "|---|---|---|"]
    for model, what, c, met in pa_verdicts(res):
        verdict = "no stable figure" if met is None else ("yes" if met else "**no**")
        lines.append(f"| perf_analyzer c={c}: {what} | {model} | {verdict} |")
    for model in dict.fromkeys(k[1] for k in res.pa):
        cpu = (res.cpu_for("inferbus", model, HIGH_CONCURRENCY) or {}).get("total_cpu_us_per_req")
        if cpu is not None:
            met = "yes" if cpu <= V3_CPU_TARGET_US else "**no**"
            lines.append(
                f"| platform CPU per request at c={HIGH_CONCURRENCY} ≤ {V3_CPU_TARGET_US:.0f} µs"
                f" ({cpu:,.0f} µs) | {model} | {met} |"
            )
        ib1, raw = res.get("inferbus", model, 1), res.raw_for(model, 1)
        if ib1 and raw and ib1["latency_ms"]["p50"] is not None:
            added = ib1["latency_ms"]["p50"] - raw["batch1"]["latency_ms"]["p50"]
            met = "yes" if added <= V3_ADDED_P50_MS else "**no**"
            lines.append(
                f"| c=1 added p50 over raw onnxruntime ≤ {V3_ADDED_P50_MS:.1f} ms"
                f" (+{added:.3f} ms, bench/loadgen.py) | {model} | {met} |"
            )
    return [*lines, ""]


def target_summary(res: Results) -> list[str]:
    """The targets as plain text lines, for the benchmark's own output."""
    return [
        f"{_verdict(r).strip('*'):12s} {r.model:6s} {r.target}: {r.inferbus.replace('**', '')}"
        f" (vs {r.compared})"
        for r in target_rows(res)
    ]


def cpu_by_command(rec: dict[str, Any]) -> dict[str, tuple[float, int]]:
    """µs/req and process count by command name over a ``platform_cpu`` record's processes."""
    out: dict[str, tuple[float, int]] = {}
    for _group, comm, _pid, us in rec.get("processes", []):
        total, n = out.get(comm, (0.0, 0))
        out[comm] = (total + us, n + 1)
    return out


_PATH_ORDER = {"gateway": 0, "router": 1, "batcher": 2, "worker": 3, "nats-server": 4}
"""Processes in the order a request meets them (the results file sorts keys)."""


def _path_key(name: str) -> tuple[int, str]:
    return _PATH_ORDER.get(name.rstrip("0123456789"), len(_PATH_ORDER)), name


def cpu_summary(rec: dict[str, Any]) -> str:
    """One line: total CPU per request, its parts and the bus messages of one run."""
    groups = rec.get("cpu_us_per_req", {})
    if len(groups) > 1:
        parts = [f"{name} {_fmt(groups[name], 0)}" for name in sorted(groups, key=_path_key)]
    else:
        parts = [
            f"{comm} {us:,.0f}" + (f" ({n} procs)" if n > 1 else "")
            for comm, (us, n) in sorted(cpu_by_command(rec).items(), key=lambda kv: -kv[1][0])
        ]
    text = (
        f"CPU {_fmt(rec.get('total_cpu_us_per_req'), 0)} µs/req"
        f" over {rec.get('window_s')} s: {', '.join(parts)}"
    )
    if rec.get("msgs_in_per_req") is not None:
        text += (
            f"; bus messages/req {rec['msgs_in_per_req']:.2f} published,"
            f" {rec['msgs_out_per_req']:.2f} delivered"
        )
    return text


def section_cpu(res: Results) -> list[str]:
    """CPU per request by process at c=64, inferbus and the peers."""
    c = HIGH_CONCURRENCY
    recs = {
        m: r
        for m in ("fraud", "heavy")
        if (r := res.cpu_for("inferbus", m, c)) and r.get("total_cpu_us_per_req") is not None
    }
    models = list(recs)
    if not models:
        return [f"## CPU per request at c={c}, by process", "", "Not measured in this run.", ""]
    seen = {p for r in recs.values() for p in r.get("cpu_us_per_req", {})}
    procs = sorted(seen, key=_path_key)
    head = " | ".join(f"{m} µs/req | {m} busy cores" for m in models)
    tick = recs[models[0]].get("tick_s", 0.01)
    lines = [
        f"## CPU per request at c={c}, by process",
        "",
        "User + system CPU from `/proc/<pid>/stat` (every thread) between the end of the"
        " load generator's warm-up and its last answer, ÷ (req/s × that window); busy"
        " cores = CPU seconds ÷ window. The peers' rows sum their whole process tree"
        " (by command: the processes that used CPU). The kernel counts CPU in clock ticks"
        f" ({1000 * tick:g} ms), so each process' figure is ± one tick over the window.",
        "",
        f"| process | {head} |",
        "|---|" + "---|" * (2 * len(models)),
    ]
    for p in procs:
        cells = " | ".join(
            f"{_fmt(recs[m]['cpu_us_per_req'].get(p), 0)} | {_fmt(recs[m]['busy_core'].get(p), 2)}"
            for m in models
        )
        lines.append(f"| {p} | {cells} |")
    cells = " | ".join(
        f"**{_fmt(recs[m].get('total_cpu_us_per_req'), 0)}**"
        f" | {_fmt(sum(v or 0 for v in recs[m]['busy_core'].values()), 2)}"
        for m in models
    )
    lines.append(f"| **inferbus total** | {cells} |")
    notes: list[str] = [f"inferbus {m}: {n}" for m in models for n in recs[m].get("notes", [])]
    for target, label in (("triton", "Triton"), ("mlserver", "MLServer")):
        peer = {m: res.cpu_for(target, m, c) for m in models}
        if not any(peer.values()):
            continue
        cells = " | ".join(
            f"{_fmt(r.get('total_cpu_us_per_req'), 0)}"
            f" | {_fmt(sum(v or 0 for v in r.get('busy_core', {}).values()), 2)}"
            if r
            else "– | –"
            for r in peer.values()
        )
        lines.append(f"| {label} (whole tree) | {cells} |")
        for m, r in peer.items():
            if not r:
                continue
            parts = ", ".join(
                f"`{comm}` {us:,.0f}" + (f" ({n} processes)" if n > 1 else "")
                for comm, (us, n) in sorted(cpu_by_command(r).items(), key=lambda kv: -kv[1][0])
            )
            notes.append(f"{label} {m}, by command: {parts or 'no process used CPU'}")
            notes += [f"{label} {m}: {n}" for n in r.get("notes", [])]
            if r.get("error"):
                notes.append(f"{label} {m}: {r['error']}")
    lines.append("")
    lines += [f"* {n}" for n in notes]
    return [*lines, ""]


# ---------------------------------------------------------------- sections


def _steal_line(first: dict[str, Any], last: dict[str, Any]) -> list[str]:
    """The share of the CPUs' time the VM's host took away between two readings."""
    a, b = first.get("cpu_jiffies"), last.get("cpu_jiffies")
    if not a or not b or b[1] <= a[1]:
        return []
    share = (b[0] - a[0]) / (b[1] - a[1])
    return [
        f"* CPU steal (time this virtual machine's host gave its CPUs to others) from the"
        f" start to the last run: {100 * share:.1f} % of the CPU time; above a few per cent"
        " the run measured a machine that was not all there."
    ]


def section_machine(res: Results) -> list[str]:
    """Machine, command, load and noise note."""
    m = res.run.get("machine", {})
    last = res.load[-1]["machine"] if res.load else m
    return [
        "## Machine and run",
        "",
        f"* CPU: {m.get('cpu')}, {m.get('cpus')} logical CPUs usable, {m.get('mem_gib')} GiB RAM;"
        f" {m.get('os')}",
        f"* Python {m.get('python')}, onnxruntime {m.get('onnxruntime')}, git {m.get('git')}",
        f"* Command: `{res.run.get('command')}` (plan: {res.run.get('plan')}),"
        f" took {_fmt(res.elapsed_s, 0)} s",
        f"* Load average (1/5/15 min) at start {m.get('loadavg')}, at the last run"
        f" {last.get('loadavg')}.",
        *_steal_line(m, last),
        "",
        "**Noise.** This machine is shared: other engineers' test suites ran while this was"
        " measured, and the load generator itself (Python, one process) runs on the same"
        " 2 cores as the servers it measures. Absolute numbers are therefore noisy and low;"
        " the ratios below compare servers measured minutes apart in the same run with the"
        " same client, which is what they are for. Compare ratios, not absolute values,"
        " across runs.",
        "",
    ]


def section_raw(res: Results) -> list[str]:
    """The limit: raw onnxruntime in-process."""
    lines = [
        "## The limit: raw onnxruntime in-process",
        "",
        "Same `model.onnx`, `session.run` back to back in one process, no server"
        " (`bench/raw_ort.py`). Threads 0 = one per core.",
        "",
        "| model | threads | batch-1 p50 ms | batch-1 p99 ms | batch-1 req/s |"
        " batch-32 rows/s | batch-32 p50 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res.raw:
        b1, bb = r["batch1"], r["batched"]
        lines.append(
            f"| {r['model']} | {r['threads']} ({r['threads_effective']}) |"
            f" {_fmt(b1['latency_ms']['p50'], 3)} | {_fmt(b1['latency_ms']['p99'], 3)} |"
            f" {_fmt(b1['throughput_rps'])} | {_fmt(bb['throughput_rows_s'])} |"
            f" {_fmt(bb['latency_ms']['p50'], 3)} |"
        )
    return [*lines, ""]


def section_serving(res: Results) -> list[str]:
    """Throughput and latency of every server, model and concurrency."""
    lines = [
        "## Serving: throughput and latency",
        "",
        "Closed loop, one row per request, KServe V2 gRPC with `tritonclient.grpc.aio`"
        " (`bench/loadgen.py`), warm-up excluded. Batch fill (inferbus only) = mean rows"
        " per micro-batch cut by the batcher (`inferbus_batcher_batch_rows`) / mean rows"
        " per engine execution in the workers (`inferbus_worker_batch_size`; larger when"
        " workers merge waiting micro-batches). CPU = the server's CPU µs per request"
        " over the measured window (inferbus: services + nats-server; peers: whole process"
        " tree); bus msgs = published / delivered by nats-server per request.",
        "",
        "| model | server | conc. | req/s | p50 ms | p90 ms | p99 ms | max ms | errors |"
        " batch fill | CPU µs/req | bus msgs/req |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res.load:
        lat = r["latency_ms"]
        fill = res.fill.get(r["label"])
        errors = ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "0"
        cpu = res.cpu_for(r["target"], r["model"], r["concurrency"]) or {}
        msgs = (
            f"{cpu['msgs_in_per_req']:.2f} / {cpu['msgs_out_per_req']:.2f}"
            if cpu.get("msgs_in_per_req") is not None
            else "–"
        )
        lines.append(
            f"| {r['model']} | {r['target']} | {r['concurrency']} |"
            f" {_fmt(r['throughput_rps'])} | {_fmt(lat['p50'], 2)} | {_fmt(lat['p90'], 2)} |"
            f" {_fmt(lat['p99'], 2)} | {_fmt(lat['max'], 2)} | {errors} |"
            f" {_fill(fill)} | {_fmt(cpu.get('total_cpu_us_per_req'), 0)} | {msgs} |"
        )
    return [*lines, ""]


def section_ratios(res: Results) -> list[str]:
    """inferbus against each peer and against the raw engine, same run."""
    lines = [
        "## Ratios within this run",
        "",
        "Throughput ratio > 1 means inferbus served more; p50 ratio > 1 means inferbus"
        " was slower. Raw-ORT efficiency = inferbus rows/s ÷ the best raw onnxruntime"
        " batch-32 rows/s of the thread settings above (the most this machine gave this"
        " model with no server at all). For the tiny fraud model it is near zero by"
        " nature: the model costs microseconds, so every server measures only its own"
        " overhead there.",
        "",
        "| model | conc. | inferbus/Triton req/s | inferbus/MLServer req/s |"
        " inferbus/Triton p50 | inferbus/MLServer p50 | inferbus/raw-ORT efficiency |",
        "|---|---|---|---|---|---|---|",
    ]
    for model in res.models():
        if model not in ("fraud", "heavy"):
            continue
        limit = res.raw_limit(model)
        for c in res.concurrencies():
            ib = res.get("inferbus", model, c)
            if ib is None:
                continue
            tr = res.get("triton", model, c)
            ml = res.get("mlserver", model, c)
            eff = f"{100 * ib['throughput_rows_s'] / limit:.3g} %" if limit else "–"
            lines.append(
                f"| {model} | {c} |"
                f" {_ratio(ib['throughput_rps'], tr and tr['throughput_rps'])} |"
                f" {_ratio(ib['throughput_rps'], ml and ml['throughput_rps'])} |"
                f" {_ratio(ib['latency_ms']['p50'], tr and tr['latency_ms']['p50'])} |"
                f" {_ratio(ib['latency_ms']['p50'], ml and ml['latency_ms']['p50'])} |"
                f" {eff} |"
            )
    return [*lines, ""]


def section_added_latency(res: Results) -> list[str]:
    """inferbus' added latency over the raw engine at concurrency 1, with stages."""
    lines = [
        "## inferbus' added latency over raw onnxruntime (concurrency 1)",
        "",
        "Added = client-observed p50 through inferbus − raw ORT batch-1 p50 (1 thread)."
        " Stages are the means the gateway reports in `ModelInferResponse.parameters`:"
        " `gateway` = time in the gateway's own code (decode, validate, encode),"
        " `queue` = batcher accepted → worker starts the engine (batching delay, JetStream"
        " work queue, the worker's pull), `compute` = engine run in the worker,"
        " `total` = gateway receive → gateway send. Client − total = gRPC client,"
        " HTTP/2 and the gateway's gRPC server.",
        "",
        "| model | raw ORT p50 ms | inferbus p50 ms | added ms | gateway ms | queue ms |"
        " compute ms | server total ms | client − total ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model in ("fraud", "heavy"):
        ib = res.get("inferbus", model, 1)
        raw = res.raw_for(model, 1)
        if ib is None or raw is None:
            continue
        raw_p50 = raw["batch1"]["latency_ms"]["p50"]
        st = {k: v["mean_us"] / 1000.0 for k, v in ib.get("stages", {}).items()}
        total = st.get("total")
        client_minus = ib["latency_ms"]["mean"] - total if total is not None else None
        lines.append(
            f"| {model} | {_fmt(raw_p50, 3)} | {_fmt(ib['latency_ms']['p50'], 2)} |"
            f" {_fmt(ib['latency_ms']['p50'] - raw_p50, 2)} | {_fmt(st.get('gateway'), 2)} |"
            f" {_fmt(st.get('queue'), 2)} | {_fmt(st.get('compute'), 2)} | {_fmt(total, 2)} |"
            f" {_fmt(client_minus, 2)} |"
        )
    lines += [
        "",
        "Stage breakdown at every concurrency (means, ms):",
        "",
        "| model | conc. | client mean | server total | gateway | queue | compute |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res.load:
        if r["target"] != "inferbus" or not r.get("stages"):
            continue
        st = {k: v["mean_us"] / 1000.0 for k, v in r["stages"].items()}
        lines.append(
            f"| {r['model']} | {r['concurrency']} | {_fmt(r['latency_ms']['mean'], 2)} |"
            f" {_fmt(st.get('total'), 2)} | {_fmt(st.get('gateway'), 2)} |"
            f" {_fmt(st.get('queue'), 2)} | {_fmt(st.get('compute'), 2)} |"
        )
    return [*lines, ""]


BATCHING_ROWS = {
    "heavy": "max_batch_size 32, max_queue_delay_us 500 (as shipped)",
    "heavy_d1ms": "max_batch_size 32, max_queue_delay_us 1000 (the peers' delay)",
    "heavy_d4ms": "max_batch_size 32, max_queue_delay_us 4000",
    "heavy_b1": "max_batch_size 1 (batching off)",
}


def section_batching(res: Results) -> list[str]:
    """Dynamic batching against max_batch_size 1, and the cold start."""
    lines = ["## Dynamic batching and cold start", ""]
    off = res.get("inferbus", "heavy_b1", 64)
    rows = [(m, res.get("inferbus", m, 64)) for m in BATCHING_ROWS]
    if off and off["throughput_rps"] and any(r for m, r in rows if m != "heavy_b1"):
        lines += [
            "Heavy model at concurrency 64, the same ONNX file pushed under several names"
            " that differ only in batching (batch dims stay -1 everywhere). Gain ="
            " throughput ÷ the `max_batch_size: 1` throughput; the issue's target is ≥ 3×"
            " with the shipped config.",
            "",
            "| model | config | req/s | p50 ms | p99 ms | batch fill | gain |",
            "|---|---|---|---|---|---|---|",
        ]
        for model, r in rows:
            if r is None:
                continue
            fill = res.fill.get(r["label"])
            lines.append(
                f"| {model} | {BATCHING_ROWS[model]} | {_fmt(r['throughput_rps'])} |"
                f" {_fmt(r['latency_ms']['p50'], 2)} | {_fmt(r['latency_ms']['p99'], 2)} |"
                f" {_fill(fill)} |"
                f" {r['throughput_rps'] / off['throughput_rps']:.2f}× |"
            )
        on = res.get("inferbus", "heavy", 64)
        if on:
            gain = on["throughput_rps"] / off["throughput_rps"]
            verdict = "**met**" if gain >= BATCHING_TARGET else "**not met**"
            lines += [
                "",
                f"Shipped config: **{gain:.2f}×**; target ≥ {BATCHING_TARGET:.0f}×: {verdict}.",
            ]
        lines.append("")
    else:
        lines += ["Dynamic batching comparison: not measured in this run.", ""]
    for c in res.cold:
        lines.append(
            f"Cold start ({c['model']}): **{c['s']:.2f} s** from the start of `push`"
            " (upload to the registry) to the first prediction served through the gateway"
            " (includes the workers noticing the route, downloading and checking the"
            " artifact, creating the session and warming up)."
        )
    return [*lines, ""]


def section_errors(res: Results) -> list[str]:
    """Peers or tools that could not be installed or started, with the reason."""
    retries = [r for r in res.records if r.get("kind") == "retry"]
    lines = ["## Failures", ""]
    for r in retries:
        tail = "\n    ".join(str(r.get("log_tail", "")).strip().splitlines()[-6:])
        lines += [
            f"* {r['target']}: one start attempt failed (exit {r.get('exit')}) and was"
            " retried; last log lines:",
            "",
            f"    {tail}",
            "",
        ]
    if not res.errors:
        return [*lines, "No server or tool failed for good." if retries else "None.", ""]
    for e in res.errors:
        err = str(e.get("error", "")).strip().replace("\n", "\n    ")
        lines += [f"* {e.get('target')} ({e.get('stage')}):", "", f"    {err[-1500:]}", ""]
    return lines


def section_profile(res: Results) -> list[str]:
    """Top frames per service from py-spy."""
    if not res.profiles:
        return []
    lines = [
        "## Where the CPU goes (py-spy, fraud model, concurrency 64)",
        "",
        "`py-spy record --nonblocking --format raw --rate 100` on each service process"
        " during a separate c=64 run (not one of the measured runs above). Self = the"
        " leaf frame (where the time is really spent); inclusive = anywhere on the"
        " stack (entry frames such as `main` and the event loop are left out). With uvloop,"
        f" time inside the loop's C code (epoll, socket I/O, scheduling) shows up as the"
        f" self frame `{EVENT_LOOP_FRAME}`."
        " Idle time is not sampled, so shares are of busy time.",
        "",
    ]
    for p in res.profiles:
        rate = p.get("rate_hz", 100)
        seconds = p.get("seconds") or res.run.get("plan", {}).get("profile_s")
        busy = (
            f", busy ≈ {100 * p['samples'] / (rate * seconds):.0f} % of one core" if seconds else ""
        )
        lines += [f"### {p['service']} ({p['samples']} samples{busy}, `{p['file']}`)", ""]
        lines += ["| self | % | inclusive | % |", "|---|---|---|---|"]
        rows = max(len(p["top_self"]), len(p["top_inclusive"]))
        for i in range(rows):
            s = p["top_self"][i] if i < len(p["top_self"]) else ["", None]
            n = p["top_inclusive"][i] if i < len(p["top_inclusive"]) else ["", None]
            lines.append(
                f"| `{s[0]}` | {_fmt(s[1])} | `{n[0]}` | {_fmt(n[1])} |"
                if s[0] or n[0]
                else "| | | | |"
            )
        lines.append("")
    return lines


def section_commands(res: Results) -> list[str]:
    """Every command the run executed, in order."""
    lines = ["## Exact commands of this run", "", "```"]
    lines += res.commands
    return [*lines, "```", ""]


# -------------------------------------------------------------------- plot


def plot(res: Results, png: Path) -> bool:
    """Latency (p50 solid, p99 dashed) against throughput, one panel per model."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = [m for m in res.models() if m in ("fraud", "heavy")]
    if not models:
        return False
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    colors = {"inferbus": "tab:blue", "triton": "tab:green", "mlserver": "tab:orange"}
    for ax, model in zip(axes[0], models, strict=True):
        for target in TARGETS:
            pts = sorted(
                (r for r in res.load if r["target"] == target and r["model"] == model),
                key=lambda r: r["concurrency"],
            )
            if not pts:
                continue
            x = [r["throughput_rps"] for r in pts]
            color = colors[target]
            ax.plot(x, [r["latency_ms"]["p50"] for r in pts], "o-", color=color, label=target)
            ax.plot(x, [r["latency_ms"]["p99"] for r in pts], "x--", color=color, alpha=0.6)
            for r in pts:
                ax.annotate(
                    f"c{r['concurrency']}",
                    (r["throughput_rps"], r["latency_ms"]["p50"]),
                    fontsize=7,
                    xytext=(3, 3),
                    textcoords="offset points",
                )
        ax.set_title(f"{model}: latency vs throughput (p50 solid, p99 dashed)")
        ax.set_xlabel("throughput (req/s, 1 row each)")
        ax.set_ylabel("latency (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


# -------------------------------------------------------------------- main


HAND_WRITTEN_BEGIN = "<!-- hand-written: {name} (edit that file, then render.py --refresh) -->"
HAND_WRITTEN_END = "<!-- end hand-written: {name} -->"
BENCH = Path(__file__).resolve().parent
DEFAULT_FINDINGS = BENCH / "findings.md"
DEFAULT_APPENDIX = (
    BENCH / "performance.md",
    BENCH / "observability.md",
    BENCH / "perf_analyzer.md",
    BENCH / "llm_vs_vllm.md",
)
"""Hand-written sections placed after the generated ones, in this order."""


def _label(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(BENCH.parent))
    except ValueError:
        return path.name


def hand_written(path: Path | None) -> list[str]:
    """A hand-written markdown file as a block between markers, so that
    `refresh_hand_written` can replace it in a page without re-rendering the tables."""
    if path is None or not path.exists():
        return []
    name = _label(path)
    return [
        HAND_WRITTEN_BEGIN.format(name=name),
        "",
        path.read_text().rstrip(),
        "",
        HAND_WRITTEN_END.format(name=name),
        "",
    ]


def section_findings(path: Path | None) -> list[str]:
    """The hand-written reading of the numbers, when there is one."""
    return hand_written(path)


def refresh_hand_written(page: str, paths: Sequence[Path]) -> str:
    """`page` with each hand-written block replaced by its file's current text.

    A block that the page does not have yet is appended at the end, so a new
    hand-written file (or a page rendered before the markers existed) gets its
    section without a full benchmark run.
    """
    for path in paths:
        block = "\n".join(hand_written(path))
        if not block:
            continue
        name = _label(path)
        begin = HAND_WRITTEN_BEGIN.format(name=name)
        end = HAND_WRITTEN_END.format(name=name)
        i = page.find(begin)
        j = page.find(end, i) if i >= 0 else -1
        if i >= 0 and j >= 0:
            page = page[:i] + block.rstrip("\n") + page[j + len(end) :]
        else:
            page = page.rstrip("\n") + "\n\n" + block
    return page.rstrip("\n") + "\n"


def render(
    records: list[dict[str, Any]],
    out: Path,
    findings: Path | None = None,
    appendix: Sequence[Path] = (),
) -> str:
    """Build the markdown report (and the PNG beside it); return the markdown.

    Args:
        records: every line of one results file.
        out: the markdown path; the plot is written beside it as ``.png``.
        findings: optional hand-written markdown inserted after the machine section.
        appendix: hand-written markdown files placed after the generated sections
            (e.g. `bench/performance.md`, `bench/observability.md`).
    """
    res = Results(records)
    png = out.with_suffix(".png")
    has_plot = plot(res, png)
    lines = [
        "# Benchmarks",
        "",
        "Generated by `uv run python bench/run_all.py` → `bench/render.py` from one results"
        " file; edit the scripts, not this page. How to run: see the end of this page.",
        "",
        *section_targets(res),
        *section_perf_analyzer(res),
        *section_cpu(res),
        *section_machine(res),
        *section_findings(findings),
        *section_batching(res),
        *section_ratios(res),
        *section_serving(res),
    ]
    if has_plot:
        lines += [f"![latency vs throughput]({png.name})", ""]
    lines += [
        *section_raw(res),
        *section_added_latency(res),
        *section_errors(res),
        *section_profile(res),
        "## How to run",
        "",
        "```",
        "uv run python bench/run_all.py            # everything, writes this page",
        "uv run python bench/run_all.py --quick    # shorter runs, c=1 and c=64 only",
        "uv run python bench/loadgen.py --url 127.0.0.1:8001 --model fraud --concurrency 64",
        "uv run python bench/loadgen.py --protocol rest --url 127.0.0.1:8000 --model fraud"
        " --rate 200 --arrival poisson",
        "uv run python bench/raw_ort.py --model-dir bench/models/heavy --threads 1 0",
        "```",
        "",
        "Peers are installed by `run_all.py` into `bench/.venvs/pytriton` (nvidia-pytriton"
        " 0.7.0, Triton 2.51 inside the wheel) and `bench/.venvs/mlserver` (mlserver 1.7.1,"
        " uvloop<0.22), py-spy into `bench/.venvs/tools`, each with `uv venv` + `uv pip"
        " install` (the packages are listed in `PEER_PACKAGES` in `bench/run_all.py`)."
        " PyTriton's Python-backend stub gets this interpreter's LIBDIR first on"
        " `LD_LIBRARY_PATH`, and its hard-coded 1 s stub handshake timeout is raised to"
        " 10 s in that throwaway venv (it timed out at random on this loaded machine)."
        " Triton and MLServer cannot bind port 0 and report it, so their ports are drawn"
        " at random below the ephemeral range and a failed start is retried."
        " Triton: dynamic batching, max batch"
        " 32, 1 ms queue delay, 2 model instances of an onnxruntime callable (1 thread each)."
        " MLServer: a small custom `MLModel` running onnxruntime (`bench/peers/"
        "mlserver_model.py`; MLServer has no ONNX runtime), adaptive batching max 32 / 1 ms,"
        " 2 parallel workers (1 thread each). inferbus: 2 workers, engine 1 intra-op thread"
        " each. So every server gets the same two engine threads.",
        "",
        *section_commands(res),
    ]
    for path in appendix:
        lines += hand_written(path)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, help="results file to render (not with --refresh)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--findings",
        type=Path,
        default=DEFAULT_FINDINGS,
        help="hand-written markdown after the machine section (default bench/findings.md)",
    )
    p.add_argument(
        "--appendix",
        type=Path,
        action="append",
        default=None,
        help="hand-written markdown after the generated sections (repeatable; default"
        " bench/performance.md, bench/observability.md, bench/perf_analyzer.md,"
        " bench/llm_vs_vllm.md)",
    )
    p.add_argument(
        "--refresh",
        action="store_true",
        help="only replace the hand-written blocks of the existing --out page",
    )
    args = p.parse_args(argv)
    appendix = list(DEFAULT_APPENDIX) if args.appendix is None else args.appendix
    if args.refresh:
        text = refresh_hand_written(args.out.read_text(), [args.findings, *appendix])
    else:
        if args.results is None:
            p.error("--results is required unless --refresh is given")
        text = render(load(args.results), args.out, args.findings, appendix)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
