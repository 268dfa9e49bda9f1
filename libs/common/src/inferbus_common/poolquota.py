"""A worker pool's quota: which live workers it admits, and how GPUs are counted.

Every worker computes its own admission from the heartbeats (`WorkerStatus`)
and the pool's `PoolSpec`, without talking to the others.
"""

from __future__ import annotations

from inferbus_common.catalogrecords import PoolSpec, WorkerStatus


def new_gpus(worker: WorkerStatus, seen: set[str]) -> int:
    """GPUs `worker` adds to those whose UUIDs are in `seen` (and adds its UUIDs to `seen`).

    A worker that reports no UUIDs (an older worker, or nvidia-smi without
    them) counts all its GPUs.
    """
    if not worker.gpu_uuids:
        return worker.gpu_count
    fresh = set(worker.gpu_uuids) - seen
    seen.update(fresh)
    return len(fresh)


def count_gpus(workers: list[WorkerStatus]) -> int:
    """Physical GPUs of `workers`: each UUID once, however many workers share it."""
    seen: set[str] = set()
    return sum(new_gpus(w, seen) for w in workers)


def pool_admission(pool: str, workers: list[WorkerStatus], spec: PoolSpec | None) -> dict[str, str]:
    """Which live workers of `pool` its quota admits: worker id → '' or the reason it is out.

    Workers are admitted oldest first (`joined_unix_ms`, then id), so every
    worker computes the same answer from the same heartbeats without talking
    to the others; a worker that leaves lets the next one in.
    """
    members = sorted(
        (w for w in workers if w.pool == pool), key=lambda w: (w.joined_unix_ms, w.worker_id)
    )
    out: dict[str, str] = {}
    count = gpus = 0
    seen: set[str] = set()
    for w in members:
        reason = ""
        # Only GPUs no admitted worker brought yet count (two workers on one GPU: one).
        adds = new_gpus(w, set(seen))
        if spec is not None and spec.max_workers and count + 1 > spec.max_workers:
            reason = (
                f"pool '{pool}' is full: max_workers {spec.max_workers} already admitted; "
                f"raise it with `inferbus pools set {pool} --max-workers N` or stop a worker"
            )
        elif spec is not None and spec.max_gpus and gpus + adds > spec.max_gpus:
            reason = (
                f"pool '{pool}' GPU quota exceeded: {gpus} of max_gpus {spec.max_gpus} in use, "
                f"this worker has {adds} more; raise it with `inferbus pools set {pool} "
                "--max-gpus N`"
            )
        if not reason:
            count += 1
            gpus += new_gpus(w, seen)
        out[w.worker_id] = reason
    return out
