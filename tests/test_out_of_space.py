"""Recognising a full filesystem in what a failed save raises, and whether a base fits."""

from __future__ import annotations

import errno
import os

from torch.distributed.checkpoint.api import CheckpointException

from megatron_diffckpt.out_of_space import base_fits, folder_bytes, full_reason, looks_full

NO_SPACE = os.strerror(errno.ENOSPC)


def test_an_oserror_for_want_of_space_is_recognised_with_its_path():
    assert full_reason(OSError(errno.ENOSPC, NO_SPACE, "/ckpt/x")) == f"{NO_SPACE}: /ckpt/x"
    assert full_reason(OSError(errno.EDQUOT, "quota")) == os.strerror(errno.EDQUOT)


def test_a_cause_deep_in_the_chain_is_found():
    try:
        try:
            raise OSError(errno.ENOSPC, NO_SPACE)
        except OSError as inner:
            raise RuntimeError("Worker failure") from inner
    except RuntimeError as outer:
        assert full_reason(outer) == NO_SPACE


def test_dcps_gathered_failures_are_read_by_their_text():
    """What megatron's finalize raises on the coordinator: the writer's error arrives pickled
    through a gather, its cause lost; only its text says why."""
    failure = RuntimeError(f"Worker failure: [Errno {errno.ENOSPC}] {NO_SPACE}")
    exc = CheckpointException("write", {1: (failure, None)})
    assert full_reason(exc) == NO_SPACE
    assert full_reason(RuntimeError(f"Worker failure: [Errno {errno.ENOSPC}]")) == NO_SPACE


def test_other_errors_are_not_taken_for_a_full_disk():
    assert full_reason(OSError(errno.EACCES, "Permission denied")) is None
    assert full_reason(CheckpointException("write", {})) is None  # a rank that saw no detail
    assert full_reason(CheckpointException("write", {0: (ValueError("bad shape"), None)})) is None
    assert full_reason(KeyError("x")) is None


def test_a_base_fits_when_the_newest_one_fits_with_headroom(tmp_path):
    base = tmp_path / "iter_0000004"
    base.mkdir()
    (base / "a.distcp").write_bytes(b"x" * 1000)
    (base / "sub").mkdir()
    (base / "sub" / "b").write_bytes(b"y" * 500)
    assert folder_bytes(str(base)) == 1500
    fits, needed, free = base_fits(str(tmp_path), str(base))
    assert fits and needed == 1650 and free > needed
    assert base_fits(str(tmp_path / "missing"), None) == (True, 0, 0)  # nothing to measure yet
    # A lower bound counts before the first base; a folder not made yet is measured where it
    # will be made.
    fits, needed, free = base_fits(str(tmp_path / "missing" / "save"), None, floor=free + 1)
    assert not fits and needed == free + 1


def test_a_failed_write_looks_full_when_less_is_left_than_a_base_needs(tmp_path):
    newest, failed = tmp_path / "iter_0000004", tmp_path / "iter_0000008"
    newest.mkdir()
    failed.mkdir()
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    assert looks_full(str(tmp_path), str(newest), str(failed)) is None  # room left: not full
    with open(newest / "big", "wb") as f:  # a "base" larger than what is free (sparse file)
        f.truncate(free + 2**30)
    assert "MiB left of" in looks_full(str(tmp_path), str(newest), str(failed))
