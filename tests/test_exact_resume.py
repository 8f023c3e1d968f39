"""Stop-and-resume through a stock dist checkpoint is bit-exact, for three parallel layouts.

N iterations straight, against k iterations, a checkpoint, a new set of processes that loads it,
and N - k more: model parameters, optimizer main parameters, exp_avg, exp_avg_sq, step and every
iteration's loss must be identical (``torch.equal``), on every rank. Real processes (gloo),
real megatron-core through CPU mode. Dropout is on, so the RNG states must round-trip too.
"""

from __future__ import annotations

import pytest
from launch import OPTIMIZER_STATE, TINY_GPT, assert_same_state, load_dumps, run_gpt

TOTAL, STOP = 6, 3

# (TP, PP, DP) on 2 processes; the other flags vary the set-up across the three layouts:
# distributed optimizer with overlapped reduction and async save; distributed optimizer with sync
# save; megatron's plain optimizer through the 1F1B pipeline schedule; top-k compressed exchange.
LAYOUTS = {
    "tp1-pp1-dp2": "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 "
    "--use-distributed-optimizer --overlap-grad-reduce --async-save",
    "tp2-pp1-dp1": "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 "
    "--use-distributed-optimizer",
    "tp1-pp2-dp1": "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2",
    # The compressed exchange: its error-feedback residuals must travel with the checkpoint.
    "tp1-pp1-dp2-topk": "--use-distributed-optimizer --overlap-grad-reduce "
    "--diffckpt-compressor topk --diffckpt-topk-ratio 0.05",
}


def _assert_same_state(straight: dict, resumed: dict, rank: int) -> None:
    assert_same_state(straight, resumed, rank)
    for a, b in zip(straight["optimizer"], resumed["optimizer"], strict=True):
        assert a.keys() == b.keys() == set(OPTIMIZER_STATE)
        assert a["step"].item() == TOTAL


@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_stop_and_resume_is_bit_exact(tmp_path, layout):
    common = (*TINY_GPT, *LAYOUTS[layout].split(), "--train-iters", str(TOTAL))
    ckpt = tmp_path / "ckpt"

    run_gpt(
        2,
        *common,
        "--save",
        str(tmp_path / "straight_ckpt"),
        "--dump-state",
        str(tmp_path / "straight"),
    )
    run_gpt(
        2,
        *common,
        "--save",
        str(ckpt),
        "--exit-interval",
        str(STOP),
        "--dump-state",
        str(tmp_path / "first"),
    )
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(STOP)
    resumed = run_gpt(
        2,
        *common,
        "--load",
        str(ckpt),
        "--save",
        str(ckpt),
        "--dump-state",
        str(tmp_path / "second"),
    )
    assert f"at iteration {STOP}" in resumed.stdout + resumed.stderr

    straight = load_dumps(tmp_path / "straight", 2)
    first = load_dumps(tmp_path / "first", 2)
    second = load_dumps(tmp_path / "second", 2)
    for rank in range(2):
        assert len(straight[rank]["losses"]) == TOTAL
        assert straight[rank]["losses"] == first[rank]["losses"] + second[rank]["losses"]
        _assert_same_state(straight[rank], second[rank], rank)
    # The losses moved: a run that silently skipped its updates could not pass the checks above
    # by accident, but make the point explicit.
    losses = straight[0]["losses"]
    assert losses[-1] < losses[0]
