"""No work lost from the first iteration on: a job from scratch saves its starting point as a base.

A GPT job (2 processes, DP 2, bases every F = 3, B = 1) is killed with SIGKILL right after
iteration 1, 2 (F-1), 3 (F) or 4 (F+1) is logged, or while its first base (iteration 0) is being
written, and started again with the same command. It may lose at most B iterations with LowDiff,
and at most B + --diffckpt-max-pending with LowDiff+ (the merger's backlog), and its final state
(parameters, main parameters, Adam moments, step) and losses must equal an uninterrupted run's,
``torch.equal``. Real processes (torchrun, gloo).
"""

from __future__ import annotations

import re

import pytest
from launch import (
    TINY_GPT,
    assert_same_state,
    load_dumps,
    run_gpt,
    run_until_killed,
    uninterrupted_dumps,
)

TOTAL = 6
F = 3
MAX_PENDING = 2
COMMON = [*TINY_GPT, "--use-distributed-optimizer", "--lr-decay-iters", "100"]
MODES = {"lowdiff": 1, "lowdiff-plus": 1 + MAX_PENDING}  # iterations a crash may lose
POINTS = ["first-base", 1, F - 1, F, F + 1]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    return uninterrupted_dumps(out, *COMMON, "--train-iters", str(TOTAL))


@pytest.mark.distributed
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("point", POINTS, ids=str)
def test_sigkill_early_loses_at_most_b_iterations_and_recovers_exactly(
    tmp_path, mode, point, straight
):
    ckpt = tmp_path / "ckpt"
    job = [*COMMON, "--train-iters", str(TOTAL), "--save", str(ckpt), "--save-interval", str(F),
           "--diffckpt-mode", mode, "--diffckpt-max-pending", str(MAX_PENDING)]  # fmt: skip
    if point == "first-base":  # as soon as the folder of base 0 appears
        log = run_until_killed(job, kill_when_exists=ckpt / "iter_0000000")
    else:
        log = run_until_killed(job, kill_after=point)
    logged = [int(i) for i in re.findall(r"iteration +(\d+)/", log)]
    killed_after = max(logged, default=0)

    resumed = run_gpt(2, *job, "--load", str(ckpt), "--dump-state", str(tmp_path / "resumed"))
    out = resumed.stdout + resumed.stderr
    m = re.search(r"recovered to iteration (\d+)", out)
    recovered = int(m.group(1)) if m else 0  # no base yet: a start from scratch
    assert killed_after - recovered <= MODES[mode], (killed_after, recovered)
    after = load_dumps(tmp_path / "resumed", 2)
    for rank in range(2):
        assert after[rank]["losses"] == straight[rank]["losses"][recovered:]
        assert_same_state(straight[rank], after[rank], rank)
