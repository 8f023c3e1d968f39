"""The PyTorch DCP baseline (``--ckpt-format torch_dcp``) saves and resumes bit-exactly.

It is what LowDiff+ is benchmarked against, so it must be a real checkpoint: an async DCP save
every 2 iterations, then new processes load the newest one and train on; parameters, optimizer
state and losses equal an uninterrupted run's (``torch.equal``). Real processes (gloo).
"""

from __future__ import annotations

import json

import pytest
from launch import TINY_GPT, assert_same_state, load_dumps, run_gpt, run_script

COMMON = [
    *TINY_GPT,
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--lr-decay-iters",
    "8",
]
DCP = ["--ckpt-format", "torch_dcp"]


@pytest.mark.distributed
def test_async_dcp_save_then_resume_is_bit_exact(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_gpt(2, *COMMON, *DCP, "--train-iters", "4", "--save", str(ckpt), "--save-interval", "2",
            "--async-save")  # fmt: skip
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"
    marker = json.loads((ckpt / "iter_0000004" / "metadata.json").read_text())
    assert marker == {"sharded_backend": "torch_dcp"}
    assert list((ckpt / "iter_0000004").glob("*.distcp"))
    run_gpt(2, *COMMON, *DCP, "--train-iters", "8", "--load", str(ckpt), "--dump-state",
            str(tmp_path / "resumed"))  # fmt: skip
    run_gpt(2, *COMMON, "--train-iters", "8", "--dump-state", str(tmp_path / "straight"))
    straight, resumed = load_dumps(tmp_path / "straight", 2), load_dumps(tmp_path / "resumed", 2)
    for rank in range(2):
        assert resumed[rank]["losses"] == straight[rank]["losses"][4:]
        assert_same_state(straight[rank], resumed[rank], rank)


def test_dcp_is_refused_for_differential_bases(tmp_path):
    proc = run_script(*DCP, "--train-iters", "2", "--save", str(tmp_path), "--save-interval", "1",
                      "--diffckpt-mode", "lowdiff")  # fmt: skip
    assert proc.returncode == 2 and "writes torch_dist bases" in proc.stderr, proc.stderr[-2000:]
