"""Nothing outlives a killed rank, under plain torchrun too.

A LowDiff+ job writes a base from its replica every iteration (megatron's checkpoint writer
keeps a results manager, a process the rank forks at start-up), under plain ``torchrun`` (not
the project's node launcher, which reaps orphans itself). The rank with ``RANK=1`` (found by its
environment, not by its place in a process list) gets SIGKILL; torchrun stops the other rank and
exits. Every process that ever ran below torchrun must be gone 10 s later, and the named
semaphores its queues made removed. Real processes.
"""

from __future__ import annotations

import pytest
from launch import PRETRAIN_GPT, TINY_GPT, outliving_a_killed_rank


@pytest.mark.distributed
def test_no_process_of_a_killed_lowdiff_plus_job_outlives_torchrun(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [*TINY_GPT, "--use-distributed-optimizer", "--train-iters", "1000", "--save",
            str(ckpt), "--save-interval", "1", "--diffckpt-mode", "lowdiff-plus"]  # fmt: skip
    # until bases have been written for a while (the writer's processes exist by then)
    left = outliving_a_killed_rank(
        PRETRAIN_GPT, args, (ckpt / "iter_0000004" / "metadata.json").exists
    )
    assert not left, f"{len(left)} process(es) or semaphore(s) of the killed job left: {left}"
