"""A keeper's budget of threads for its replicas' merges: how many merges run at once, with how
many of torch's threads each, and that the budget holds under concurrent merges (real threads)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_diffckpt.merge_threads import MergeThreads


@pytest.mark.parametrize(
    ("threads", "shards", "concurrent", "per_merge"),
    [(16, 8, 8, 2), (8, 8, 8, 1), (4, 8, 4, 1), (1, 8, 1, 1), (6, 1, 1, 6), (7, 2, 2, 3)],
)
def test_the_budget_splits_into_merges_and_threads(threads, shards, concurrent, per_merge):
    budget = MergeThreads(threads, shards)
    assert (budget.concurrent, budget.per_merge) == (concurrent, per_merge)
    assert budget.concurrent * budget.per_merge <= max(threads, 1)


def test_a_bad_budget_is_refused():
    with pytest.raises(ValueError, match="threads and shards must be >= 1, got 0 and 8"):
        MergeThreads(0, 8)


def test_concurrent_merges_stay_within_the_budget_and_each_runs_with_its_threads():
    budget = MergeThreads(threads=2, shards=6)  # 2 merges at a time, 1 thread each
    inside, peak, seen = 0, 0, []
    lock = threading.Lock()

    def merge() -> None:
        nonlocal inside, peak
        with budget.merging():
            with lock:
                inside += 1
                peak = max(peak, inside)
            seen.append(torch.get_num_threads())
            time.sleep(0.05)
            with lock:
                inside -= 1

    workers = [threading.Thread(target=merge) for _ in range(6)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert peak == 2 and seen == [1] * 6


def test_the_host_merge_benchmark_runs_and_writes_its_figures(tmp_path):
    """The benchmark at a toy size: every kernel, the node's shards, both bounds, in its JSON."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "host_merge.json"
    cmd = [sys.executable, str(root / "benchmarks" / "host_merge.py"), "--shard-mparams", "0.2",
           "--node-shard-mparams", "0.05", "--shards", "2", "--threads", "1", "--repeats", "1",
           "--tensors", "3", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    result = json.loads(out.read_text())
    assert [r["kernel"] for r in result["kernels"]] == ["exact (for-loop)", "exact (foreach)",
                                                        "exact (blocked)", "fused"]  # fmt: skip
    assert result["tensors"] == 3 and abs(result["kernels"][0]["params"] - 200_000) < 3
    assert all(r["gparams_per_s"] > 0 and r["share_of_update_bound"] > 0 for r in result["kernels"])
    assert result["node"][0]["budget"].startswith("1 thread(s) for 2 replica(s)")
    assert set(result["copy_bound_gb_per_s"]) == set(result["update_bound_gb_per_s"]) == {"1"}
