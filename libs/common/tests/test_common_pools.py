"""Pool admission: who a quota lets in, computed the same way by every worker."""

from __future__ import annotations

from inferbus_common.catalogrecords import PoolSpec, WorkerStatus
from inferbus_common.poolquota import count_gpus, pool_admission
from inferbus_common.subjects import Subjects


def _w(wid: str, joined: int, gpus: int = 0, pool: str = "gpu") -> WorkerStatus:
    return WorkerStatus(worker_id=wid, pool=pool, joined_unix_ms=joined, gpu_count=gpus)


def test_no_spec_or_unlimited_admits_everyone() -> None:
    workers = [_w("a", 1), _w("b", 2)]
    assert pool_admission("gpu", workers, None) == {"a": "", "b": ""}
    assert pool_admission("gpu", workers, PoolSpec(name="gpu")) == {"a": "", "b": ""}


def test_oldest_workers_are_admitted_first_whatever_the_order_seen() -> None:
    spec = PoolSpec(name="gpu", max_workers=2)
    workers = [_w("c", 30), _w("a", 10), _w("b", 20), _w("other", 1, pool="cpu")]
    for order in (workers, list(reversed(workers))):
        out = pool_admission("gpu", order, spec)
        assert out["a"] == "" and out["b"] == ""
        assert "is full: max_workers 2" in out["c"]
        assert "other" not in out


def test_gpu_quota_sums_the_admitted_specs() -> None:
    spec = PoolSpec(name="gpu", max_gpus=4)
    out = pool_admission("gpu", [_w("a", 1, 2), _w("b", 2, 4), _w("c", 3, 2)], spec)
    # a (2) fits, b would make 6 > 4 and stays out, c makes 4 and fits.
    assert out["a"] == "" and out["c"] == ""
    assert "GPU quota exceeded: 2 of max_gpus 4 in use, this worker has 4 more" in out["b"]


def _on(wid: str, joined: int, *uuids: str) -> WorkerStatus:
    return WorkerStatus(
        worker_id=wid, pool="gpu", joined_unix_ms=joined, gpu_count=len(uuids), gpu_uuids=uuids
    )


def test_gpus_are_counted_by_uuid() -> None:
    # Two workers on one H200 use one GPU, not two.
    a, b = _on("a", 1, "GPU-1"), _on("b", 2, "GPU-1")
    c = _on("c", 3, "GPU-2", "GPU-1")
    assert count_gpus([a, b]) == 1
    assert count_gpus([a, b, c]) == 2
    # Without UUIDs (an older worker), its count is all there is to go by.
    assert count_gpus([a, _w("old", 4, 2)]) == 3
    out = pool_admission("gpu", [a, b, c], PoolSpec(name="gpu", max_gpus=1))
    assert out["a"] == "" and out["b"] == ""
    assert "1 of max_gpus 1 in use, this worker has 1 more" in out["c"]


def test_bucket_names_follow_the_prefix() -> None:
    s = Subjects("ib")
    assert (s.pools_bucket, s.rollouts_bucket) == ("ib_pools", "ib_rollouts")
