"""A diff log on a filesystem that fills up: skip goes on, block stops, and nothing is lost.

The diff log (``--diffckpt-dir``) of a GPT job on 2 processes lives on a small tmpfs that fills
after a few iterations. With ``--diffckpt-when-full skip`` the job trains to its end with one
warning per incident and rank, and its bases restore durability; with ``block`` it stops with a
one-line error, no hang; either way the published bases and the valid prefix of the diff log stay
intact, and once the filesystem has space again a restart recovers and ``megatron-diffckpt
verify`` passes. Needs root to mount the tmpfs (CI runs as root). Real processes.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from launch import TINY_GPT, recovered_iteration, run_cli, run_gpt

COMMON = [*TINY_GPT, "--use-distributed-optimizer", "--lr-decay-iters", "100"]


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs: room for the first few differentials of both ranks only."""
    mount = tmp_path / "log"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _job(tmp_path, log_dir, when_full: str) -> list[str]:
    ckpt = tmp_path / "ckpt"
    return [*COMMON, "--save", str(ckpt), "--save-interval", "4", "--diffckpt-mode", "lowdiff",
            "--diffckpt-dir", str(log_dir), "--diffckpt-when-full", when_full]  # fmt: skip


def _verify(tmp_path, log_dir) -> None:
    proc = run_cli("verify", str(tmp_path / "ckpt"), "--diff-dir", str(log_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.distributed
def test_full_disk_with_skip_trains_on_with_one_warning_per_incident(tmp_path, small_fs):
    proc = run_gpt(2, *_job(tmp_path, small_fs, "skip"), "--train-iters", "12")
    log = proc.stdout + proc.stderr
    warnings = re.findall(r"diff log (rank_\S+): storage is full", log)
    assert sorted(warnings) == ["rank_0_0_0", "rank_0_0_1"], log[-3000:]  # one per rank
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "12"
    assert not list(small_fs.glob("rank_*/*.tmp"))
    _verify(tmp_path, small_fs)
    resumed = run_gpt(2, *_job(tmp_path, small_fs, "skip"), "--train-iters", "14",
                      "--load", str(tmp_path / "ckpt"))  # fmt: skip
    assert recovered_iteration(resumed) == 12


@pytest.mark.distributed
def test_full_disk_with_block_stops_in_one_line_then_recovers_with_space(tmp_path, small_fs):
    proc = run_gpt(2, *_job(tmp_path, small_fs, "block"), "--train-iters", "12", check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    error = re.search(r"pretrain_gpt.py: error: the diff log cannot be written, .*", log)
    assert error and "No space left on device" in error.group(0), log[-3000:]
    # What every rank holds: recovery replays up to the shortest chain.
    last = min(
        max((int(p.name.split("_")[2].split(".")[0]) for p in rank.glob("seg_*.bin")), default=0)
        for rank in small_fs.glob("rank_*")
    )
    assert last > 0 and not list(small_fs.glob("rank_*/*.tmp"))
    # Space again (the tmpfs grows; its contents stay): the restart recovers and finishes.
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_fs)], check=True)
    _verify(tmp_path, small_fs)
    resumed = run_gpt(2, *_job(tmp_path, small_fs, "block"), "--train-iters", "12",
                      "--load", str(tmp_path / "ckpt"))  # fmt: skip
    assert recovered_iteration(resumed) >= last
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "12"
    _verify(tmp_path, small_fs)
    assert os.path.isdir(tmp_path / "ckpt" / "iter_0000012")
