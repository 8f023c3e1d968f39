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
from pathlib import Path

import pytest
from launch import TINY_GPT, assert_same_state, load_dumps, recovered_iteration, run_cli, run_gpt

COMMON = [*TINY_GPT, "--use-distributed-optimizer", "--lr-decay-iters", "100"]


@pytest.fixture
def small_fs(tmpfs):
    """A 1 MiB tmpfs: room for the first few differentials of both ranks only."""
    return tmpfs("log", "1m")


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
    events = re.findall(r"diff log (rank_\S+): storage (is full|has space again)", log)
    for rank in ("rank_0_0_0", "rank_0_0_1"):
        # One warning per incident: each opens one that only "has space again" ends. The ranks
        # share the filesystem, so a write one rank gave up on can leave room for the other's:
        # a rank may see a second incident, never a second warning within one.
        said = [what for who, what in events if who == rank]
        alternating = (["is full", "has space again"] * len(said))[: len(said)]
        assert said and said == alternating, (rank, said, log[-3000:])
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "12"
    assert not list(small_fs.glob("rank_*/*.tmp"))
    _verify(tmp_path, small_fs)
    resumed = run_gpt(2, *_job(tmp_path, small_fs, "skip"), "--train-iters", "14",
                      "--load", str(tmp_path / "ckpt"))  # fmt: skip
    assert recovered_iteration(resumed) == 12


@pytest.mark.distributed
def test_full_disk_with_block_stops_in_one_line_then_recovers_with_space(tmp_path, small_fs, tmpfs):
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
    tmpfs.grow(small_fs)
    _verify(tmp_path, small_fs)
    resumed = run_gpt(2, *_job(tmp_path, small_fs, "block"), "--train-iters", "12",
                      "--load", str(tmp_path / "ckpt"))  # fmt: skip
    assert recovered_iteration(resumed) >= last
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "12"
    _verify(tmp_path, small_fs)
    assert os.path.isdir(tmp_path / "ckpt" / "iter_0000012")


@pytest.mark.distributed
def test_a_diff_log_full_on_one_rank_only_stops_every_rank_in_one_line(tmp_path, tmpfs):
    """Rank 1's diff-log folder on a 1 MiB filesystem of its own (its node's disk), rank 0's
    with room: under block, rank 1's writer finds it full and rank 1 stops in one line; rank
    0, which could train on, waits for rank 1 in the next iteration's reduction and is stopped
    by the fault board in one line naming rank 1 and the cause, no hang. With space again the
    restart recovers, finishes, and ``verify`` passes."""
    (tmp_path / "log").mkdir()
    small = tmpfs("log/rank_0_0_1", "1m")
    job = _job(tmp_path, tmp_path / "log", "block")
    proc = run_gpt(2, *job, "--train-iters", "12", check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    said = [line for line in log.splitlines() if "No space left on device" in line]
    assert len(said) == 2, said  # one line per rank, each naming the full folder
    assert re.search(r"\[rank1\] .*pretrain_gpt.py: error: the diff log cannot be written", log)
    assert re.search(r"\[rank0\] .*stopping: rank 1: failed: StorageFullError: the diff log", log)
    assert "Traceback" not in log and "recvValue failed" not in log, log[-4000:]
    tmpfs.grow(small)
    resumed = run_gpt(2, *job, "--train-iters", "12", "--load", str(tmp_path / "ckpt"))
    assert recovered_iteration(resumed) >= 0
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "12"
    _verify(tmp_path, tmp_path / "log")


# --save itself on a small filesystem: bases and the diff log (SAVE/diffckpt) fill it together.
# A base of this GPT is about 2.2 MB, a differential about 0.26 MB per rank.


def _save_job(save: Path, when_full: str, *extra: str) -> list[str]:
    return [*COMMON, "--save", str(save), "--save-interval", "4",
            "--diffckpt-when-full", when_full, *extra]  # fmt: skip


def _no_partial_base(save: Path) -> None:
    """Every base folder left is complete (megatron's metadata written last)."""
    for base in save.glob("iter_*"):
        assert (base / "metadata.json").exists(), f"{base} is a partial base"


@pytest.mark.distributed
def test_a_full_save_with_skip_skips_bases_then_resumes_exactly_with_space(tmp_path, tmpfs):
    save = tmpfs("save", "6m")  # base 0, base 4 and a few differentials
    job = _save_job(save, "skip", "--diffckpt-mode", "lowdiff")
    proc = run_gpt(2, *job, "--train-iters", "16")
    log = proc.stdout + proc.stderr
    skipped = re.findall(r"storage under \S+ is full \((.*?)\): base (\d+) was NOT saved", log)
    assert len(skipped) == 1, log[-4000:]  # one warning for the incident, on rank 0
    reason, first = skipped[0]
    published = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert published < int(first) <= 16 and published % 4 == 0
    _no_partial_base(save)
    assert not list(save.glob("diffckpt/rank_*/*.tmp"))
    assert run_cli("verify", str(save)).returncode == 0

    tmpfs.grow(save)
    straight = tmp_path / "straight"
    run_gpt(2, *COMMON, "--train-iters", "18", "--dump-state", str(straight))
    resumed = run_gpt(2, *job, "--train-iters", "18", "--load", str(save),
                      "--dump-state", str(tmp_path / "resumed"))  # fmt: skip
    assert recovered_iteration(resumed) >= published
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "18"
    after, expected = load_dumps(tmp_path / "resumed", 2), load_dumps(straight, 2)
    for rank in range(2):
        assert_same_state(expected[rank], after[rank], rank)
    verify = run_cli("verify", str(save))
    assert verify.returncode == 0, verify.stdout + verify.stderr


@pytest.mark.distributed
def test_a_full_save_with_block_stops_in_one_line_then_recovers_with_space(tmp_path, tmpfs):
    save = tmpfs("save", "6m")
    job = _save_job(save, "block", "--diffckpt-mode", "lowdiff")
    proc = run_gpt(2, *job, "--train-iters", "16", check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "exitcode  : 2" in log, log[-4000:]
    errors = re.findall(r"pretrain_gpt.py: error: (.*)", log)
    assert errors and all(
        re.match(r"(base \d+ cannot be written|the diff log cannot be written)", e) for e in errors
    ), errors
    assert not re.search(r"\[rank\d\]: Traceback", log), log[-4000:]  # one line, no traceback
    _no_partial_base(save)
    published = int((save / "latest_checkpointed_iteration.txt").read_text())
    tmpfs.grow(save)
    resumed = run_gpt(2, *job, "--train-iters", "16", "--load", str(save))
    assert recovered_iteration(resumed) >= published
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "16"
    verify = run_cli("verify", str(save))
    assert verify.returncode == 0, verify.stdout + verify.stderr


SAVE_PATHS = {
    "lowdiff-sync": ["--diffckpt-mode", "lowdiff"],
    "lowdiff-async-save": ["--diffckpt-mode", "lowdiff", "--async-save"],
    "lowdiff-plus": ["--diffckpt-mode", "lowdiff-plus"],
}


@pytest.mark.distributed
@pytest.mark.parametrize("path", sorted(SAVE_PATHS))
def test_a_base_whose_write_fails_for_space_is_skipped_on_every_save_path(tmp_path, tmpfs, path):
    """2 MiB: room for the least a base can be (12 bytes per parameter: 1.45 MB), so the first
    base is started, but not for the base (2.2 MB): it fails inside megatron's write, which
    raises on every rank, synchronously, in the asynchronous save's finalize step, or in
    LowDiff+'s. Later bases find no room before they start."""
    save = tmpfs("save", "2m")
    job = _save_job(save, "skip", *SAVE_PATHS[path])
    proc = run_gpt(2, *job, "--train-iters", "6")
    log = proc.stdout + proc.stderr
    incidents = re.findall(r"storage under \S+ is full \(.*?\): base \d+ was NOT saved", log)
    assert len(incidents) == 1, log[-4000:]  # one warning (an asynchronous base 0 fails late)
    base0 = [
        line for line in log.splitlines() if re.search(r"base 0 (was NOT saved|skipped)", line)
    ]
    why = re.search(r"is (?:still )?full \((.*?)\)", base0[0]) if len(base0) == 1 else None
    assert why and "a base needs about" not in why.group(1), base0  # its write failed
    assert not re.search(r"\[rank\d\]: Traceback", log), log[-4000:]
    assert not list(save.glob("iter_*")), list(save.iterdir())  # the partial base is removed
    tmpfs.grow(save)
    resumed = run_gpt(2, *job, "--train-iters", "8", "--load", str(save))
    assert "will not load any checkpoint" in resumed.stdout + resumed.stderr  # nothing was durable
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "8"
    verify = run_cli("verify", str(save))
    assert verify.returncode == 0, verify.stdout + verify.stderr
