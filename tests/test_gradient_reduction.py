"""Data-parallel training is the same computation as single-process training.

Ranks agreeing with each other is not enough (a run whose gradients are never reduced keeps its
ranks apart, but one that reduces the wrong thing can agree and be wrong): DP=2 with the
distributed optimizer must match DP=1 with two micro-batches on the same global batch. Reduction
order differs, so equality holds to float32 rounding; an unreduced step would be off by the
learning rate's scale (1e-3).
"""

from __future__ import annotations

import pytest
import torch
from launch import TINY_GPT, load_dumps, run_gpt

ITERS = 3


@pytest.mark.distributed
def test_data_parallel_matches_single_process(tmp_path):
    # Dropout off: DP=1 draws the masks of both micro-batches from one stream, DP=2 from two.
    common = (
        *TINY_GPT,
        "--train-iters",
        str(ITERS),
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
    )
    run_gpt(1, *common, "--dump-state", str(tmp_path / "dp1"))
    run_gpt(2, *common, "--use-distributed-optimizer", "--dump-state", str(tmp_path / "dp2"))
    (single,) = load_dumps(tmp_path / "dp1", 1)
    dp = load_dumps(tmp_path / "dp2", 2)

    for name, expected in single["params"].items():
        for rank in range(2):
            got = dp[rank]["params"][name]
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5, msg=name)
        assert torch.equal(dp[0]["params"][name], dp[1]["params"][name]), name
    for rank in range(2):
        assert dp[rank]["losses"] == pytest.approx(single["losses"], rel=1e-5)
