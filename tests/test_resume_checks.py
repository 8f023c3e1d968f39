"""Resuming the GPT example: what a wrong resume says, and a job that recovers onto its end.

One ``--diffckpt-mode lowdiff`` run on 2 processes (DP 2) is killed with SIGKILL after its base at
5 with differentials up to 6 durable; then, from copies of its folder:

- another model shape (``--hidden-size``) is refused in one line naming the tensor and both
  shapes, exit code 2, before megatron's load;
- another data-parallel size, with differentials past the newest base, is refused in one line
  with the way out (the original layout, or ``megatron-diffckpt merge`` first), exit code 2:
  resuming from the base alone would silently drop them;
- the same job recovered onto its last iteration (6) still ends with its final base, and logs
  that the checkpoint writer was started at start-up, off the training path.

Real processes (gloo).
"""

from __future__ import annotations

import re
import shutil

import pytest
from launch import TINY_GPT, recovered_iteration, run_gpt, run_until_killed

COMMON = [*TINY_GPT, "--use-distributed-optimizer", "--lr-decay-iters", "100"]


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """A folder with base 5 published and both ranks' differentials of 6 durable."""
    ckpt = tmp_path_factory.mktemp("killed") / "ckpt"
    args = [*COMMON, "--train-iters", "1000", *_diff(ckpt)]
    durable = [
        ckpt / "diffckpt" / f"rank_0_0_{d}" / "seg_0000000006_0000000006.bin" for d in (0, 1)
    ]
    log = run_until_killed(args, 6, durable)
    assert "checkpoint writer ready in" in log  # started at start-up, off the training path
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "5"
    return ckpt


def _diff(ckpt) -> list[str]:
    return ["--save", str(ckpt), "--save-interval", "5", "--diffckpt-mode", "lowdiff"]


def _copy(ckpt, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    return copy


def _refused(proc) -> str:
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "exitcode: 2" in log, log[-3000:]
    # One line from the ranks, not a traceback out of megatron (the launcher's own line follows it).
    assert "pretrain_gpt.py: error: " in log and 'File "/' not in log.split("exitcode: 2")[0]
    return log


@pytest.mark.distributed
def test_another_model_shape_is_refused_in_one_line(killed_run, tmp_path):
    ckpt = _copy(killed_run, tmp_path)
    args = [*COMMON, "--hidden-size", "128", "--train-iters", "8", *_diff(ckpt)]
    log = _refused(run_gpt(2, *args, "--load", str(ckpt), check=False))
    assert "holds another model than this run builds" in log
    assert re.search(r"is \[\d+, 64\] there, \[\d+, 128\] here", log), log[-2000:]


@pytest.mark.distributed
def test_another_data_parallel_size_with_differentials_past_the_base_is_refused(
    killed_run, tmp_path
):
    ckpt = _copy(killed_run, tmp_path)
    args = [*COMMON, "--global-batch-size", "8", "--train-iters", "8", *_diff(ckpt)]
    log = _refused(run_gpt(1, *args, "--load", str(ckpt), check=False))
    assert "holds differentials after base 5 written under another parallel layout" in log
    assert f"megatron-diffckpt merge {ckpt} --out DIR2" in log
    # Nothing was dropped: the original layout still recovers them.
    resumed = run_gpt(2, *COMMON, "--train-iters", "8", *_diff(ckpt), "--load", str(ckpt))
    assert recovered_iteration(resumed) >= 6


@pytest.mark.distributed
def test_a_job_recovered_onto_its_last_iteration_ends_with_its_final_base(killed_run, tmp_path):
    ckpt = _copy(killed_run, tmp_path)
    # The state of a crash right after 6 (the kill may have come an iteration or two later).
    for segment in (ckpt / "diffckpt").glob("rank_*/seg_*.bin"):
        if int(segment.name.split("_")[1]) > 6:
            segment.unlink()
    resumed = run_gpt(2, *COMMON, "--train-iters", "6", *_diff(ckpt), "--load", str(ckpt))
    log = resumed.stdout + resumed.stderr
    assert recovered_iteration(resumed) == 6
    assert "saving the base of the recovered iteration 6 (end of training)" in log
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert (ckpt / "iter_0000006" / "metadata.json").exists()
