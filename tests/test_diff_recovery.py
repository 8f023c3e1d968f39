"""Recovery from a base plus differentials after a SIGKILL is bit-exact, for three layouts.

A run with ``--diffckpt-mode lowdiff`` is killed (SIGKILL, all ranks) while training, after its
newest base; new processes load the base, replay the differentials every rank holds durably, and
train on. Their final parameters, optimizer state (main params, exp_avg, exp_avg_sq, step) and
losses must equal an uninterrupted run's (``torch.equal``). Real processes (gloo).
"""

from __future__ import annotations

import pytest
from launch import (
    TINY_GPT,
    assert_same_state,
    load_dumps,
    recovered_iteration,
    run_gpt,
    run_until_killed,
)

TOTAL = 14
BASE_INTERVAL = 5
KILL_AFTER = 9  # iterations logged before the kill: base at 5, differentials 6.. durable

LAYOUTS = {
    "tp1-pp1-dp2": "--use-distributed-optimizer --overlap-grad-reduce",
    "tp2-pp1-dp1": "--tensor-model-parallel-size 2 --use-distributed-optimizer",
    "tp1-pp2-dp1": "--pipeline-model-parallel-size 2",
    # mixture of experts, the experts replicated over data parallelism (expert-parallel size 1):
    # their gradients in megatron's expert buffers, reduced over the expert-data-parallel group
    "moe-ep1-dp2": "--use-distributed-optimizer --overlap-grad-reduce --num-experts 4 "
    "--moe-router-topk 2 --moe-token-dispatcher-type alltoall --disable-bias-linear",
    "moe-ep2-dp2": "--use-distributed-optimizer --overlap-grad-reduce --num-experts 4 "
    "--moe-router-topk 2 --moe-token-dispatcher-type alltoall --disable-bias-linear "
    "--expert-model-parallel-size 2",
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sigkill_then_replay_is_bit_exact(tmp_path, layout):
    common = [*TINY_GPT, *LAYOUTS[layout].split(), "--lr-decay-iters", "100"]
    ckpt = str(tmp_path / "ckpt")
    diff = ["--diffckpt-mode", "lowdiff", "--save", ckpt, "--save-interval", str(BASE_INTERVAL)]

    run_gpt(2, *common, "--train-iters", str(TOTAL), "--dump-state", str(tmp_path / "straight"))
    run_until_killed([*common, "--train-iters", "1000", *diff], KILL_AFTER)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == str(
        BASE_INTERVAL
    )

    resumed = run_gpt(
        2,
        *common,
        "--train-iters",
        str(TOTAL),
        *diff,
        "--load",
        ckpt,
        "--dump-state",
        str(tmp_path / "resumed"),
    )
    log = resumed.stdout + resumed.stderr
    recovered = recovered_iteration(resumed)
    assert recovered > BASE_INTERVAL and f"replayed diff {recovered - BASE_INTERVAL} of" in log

    straight = load_dumps(tmp_path / "straight", 2)
    after = load_dumps(tmp_path / "resumed", 2)
    for rank in range(2):
        a, b = straight[rank], after[rank]
        assert b["losses"] == a["losses"][recovered:]  # training went on exactly from there
        assert_same_state(a, b, rank)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp1-pp1-dp2", "moe-ep1-dp2", "moe-ep2-dp2"])
def test_compressed_training_recovers_the_exact_state_at_t(tmp_path, layout):
    """With the top-k exchange, base + replay rebuilds the state at T bit for bit.

    The error-feedback residuals are local state no gradient can rebuild: after a replay they are
    the base's (invariant 6), so training on from T differs from the uninterrupted run by what the
    residuals held at T. What holds, and is checked: parameters and optimizer state at T are
    ``torch.equal``; the losses after T stay within 2% of the uninterrupted run's. With
    mixture of experts, the expert buckets go through the top-k exchange over their
    expert-data-parallel group.
    """
    common = [
        *TINY_GPT,
        *LAYOUTS[layout].split(),
        "--lr-decay-iters",
        "100",
        "--diffckpt-compressor",
        "topk",
        "--diffckpt-topk-ratio",
        "0.05",
    ]
    ckpt = str(tmp_path / "ckpt")
    diff = ["--diffckpt-mode", "lowdiff", "--save", ckpt, "--save-interval", str(BASE_INTERVAL)]

    run_until_killed([*common, "--train-iters", "1000", *diff], KILL_AFTER)
    # --train-iters below the recovered iteration: recover, train nothing, dump the state at T.
    at_t = run_gpt(
        2, *common, "--train-iters", "1", *diff, "--load", ckpt, "--dump-state", str(tmp_path / "t")
    )
    recovered = recovered_iteration(at_t)
    assert recovered > BASE_INTERVAL
    run_gpt(2, *common, "--train-iters", str(recovered), "--dump-state", str(tmp_path / "ref_t"))
    reference, at_t_dumps = load_dumps(tmp_path / "ref_t", 2), load_dumps(tmp_path / "t", 2)
    for rank in range(2):
        assert_same_state(reference[rank], at_t_dumps[rank], rank)

    run_gpt(2, *common, "--train-iters", str(TOTAL), "--dump-state", str(tmp_path / "straight"))
    run_gpt(
        2, *common, "--train-iters", str(TOTAL), *diff, "--load", ckpt,
        "--dump-state", str(tmp_path / "resumed"),
    )  # fmt: skip
    straight = load_dumps(tmp_path / "straight", 2)[0]["losses"][recovered:]
    resumed = load_dumps(tmp_path / "resumed", 2)[0]["losses"]
    assert len(resumed) == TOTAL - recovered
    assert resumed == pytest.approx(straight, rel=0.02)
