"""The compressed data-parallel exchange inside megatron DDP, in real training runs.

- ``--diffckpt-topk-ratio 1.0`` keeps every entry: training must match megatron's own dense
  reduction. The only difference allowed is the order of the floating-point additions of the
  ranks' contributions (the exchange adds them in rank order; gloo's reduce-scatter and all-reduce
  choose their own order), so parameters are compared to float32 rounding (rtol 1e-5, atol 1e-6
  after a few Adam steps; with two data-parallel ranks ``a + b == b + a`` and the runs are
  usually identical). An exchange that dropped, doubled or misplaced entries would be off by the
  learning rate's scale.
- ``--diffckpt-topk-ratio 0.01``: the loss still falls, and every rank's optimizer input is sparse.

Layouts: overlapped reduction with the distributed optimizer, plain synchronous reduction with
megatron's plain optimizer, and tensor and pipeline parallelism (each with DP=2).
"""

from __future__ import annotations

import re

import pytest
import torch
from launch import TINY_GPT, load_dumps, run_gpt

ITERS = 4

LAYOUTS = {
    "dp2-distopt-overlap": (2, "--use-distributed-optimizer --overlap-grad-reduce"),
    "dp2-plain-sync": (2, ""),
    "tp2-dp2-distopt": (4, "--tensor-model-parallel-size 2 --use-distributed-optimizer"),
    "pp2-dp2-overlap": (4, "--pipeline-model-parallel-size 2 --overlap-grad-reduce"),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_ratio_one_matches_megatrons_dense_reduction(tmp_path, layout):
    nproc, flags = LAYOUTS[layout]
    common = (*TINY_GPT, *flags.split(), "--train-iters", str(ITERS))
    run_gpt(nproc, *common, "--dump-state", str(tmp_path / "dense"))
    run_gpt(
        nproc,
        *common,
        "--diffckpt-compressor",
        "topk",
        "--diffckpt-topk-ratio",
        "1.0",
        "--dump-state",
        str(tmp_path / "topk"),
    )
    dense, topk = load_dumps(tmp_path / "dense", nproc), load_dumps(tmp_path / "topk", nproc)
    for rank in range(nproc):
        a, b = dense[rank], topk[rank]
        assert b["losses"] == pytest.approx(a["losses"], rel=1e-5)
        for name, value in a["params"].items():
            torch.testing.assert_close(b["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)
        for x, y in zip(a["optimizer"], b["optimizer"], strict=True):
            for key in ("main_param", "exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(y[key], x[key], rtol=1e-5, atol=1e-6)
    # The updates are not negligible next to that tolerance.
    assert dense[0]["losses"][-1] < dense[0]["losses"][0] - 0.05


@pytest.mark.distributed
def test_one_percent_trains_and_its_differentials_are_sparse(tmp_path):
    iters = 30
    common = (
        *TINY_GPT,
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--train-iters",
        str(iters),
        "--lr",
        "3e-3",
    )
    ckpt = tmp_path / "ckpt"
    run_gpt(
        2,
        *common,
        "--diffckpt-compressor",
        "topk",
        "--diffckpt-topk-ratio",
        "0.01",
        "--diffckpt-mode",
        "lowdiff",
        "--save",
        str(ckpt),
        "--save-interval",
        str(iters),
        "--dump-state",
        str(tmp_path / "topk"),
    )
    losses = load_dumps(tmp_path / "topk", 2)[0]["losses"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses

    params = sum(v.numel() for v in load_dumps(tmp_path / "topk", 2)[0]["params"].values())
    for rank_dir in sorted((ckpt / "diffckpt").glob("rank_*")):
        written = sum(p.stat().st_size for p in rank_dir.glob("seg_*.bin"))
        dense_shard = 4 * params / 2 * iters
        # At most 2 ranks x 1% of the entries land in a shard, 8 bytes each, plus record headers
        # and RNG states: far below the dense shard.
        assert written < dense_shard / 5, (rank_dir.name, written, dense_shard)


@pytest.mark.distributed
def test_resume_under_another_data_parallel_size_starts_residuals_from_zero(tmp_path):
    """Residuals belong to one rank of one layout: under another DP size they cannot be mapped,
    so they start from zero, with a warning, and training goes on (the model and optimizer
    reshard along DP as stock megatron does)."""
    ckpt = str(tmp_path / "ckpt")
    topk = ["--diffckpt-compressor", "topk", "--diffckpt-topk-ratio", "0.05"]
    common = [*TINY_GPT, "--use-distributed-optimizer", "--lr-decay-iters", "100", *topk]
    run_gpt(2, *common, "--train-iters", "6", "--save", ckpt, "--exit-interval", "3")
    resumed = run_gpt(1, *common, "--train-iters", "5", "--load", ckpt, "--save", ckpt)
    log = resumed.stdout + resumed.stderr
    assert "holds no error-feedback residuals for this layout: they start from zero" in log
    assert re.search(r"iteration +5/", log)
