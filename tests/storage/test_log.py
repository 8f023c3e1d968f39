"""The diff log on disk: batched durable writes, the reader's chain, and damage, kill and
back-pressure handled as documented."""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from megatron_diffckpt.storage import (
    DiffLogWriter,
    DiffRecord,
    SegmentIdentity,
    read_segment,
    scan_rank_log,
)
from megatron_diffckpt.storage import writer as writer_module
from megatron_diffckpt.storage.format import EncodedRecord, encode_record, read_header
from megatron_diffckpt.storage.writer import OWNER_FILE

IDENTITY = SegmentIdentity("run-a", 0, 0, 1, "layout-1")
OTHER_RANK = SegmentIdentity("run-a", 0, 0, 0, "layout-1")


def _record(it: int, numel: int = 64) -> DiffRecord:
    g = torch.Generator().manual_seed(it)
    return DiffRecord(it, {"lr": 0.001 * it}, {"grad": torch.randn(numel, generator=g)})


def _write(root: Path, iterations, identity=IDENTITY, batch_size=3, start=0) -> DiffLogWriter:
    w = DiffLogWriter(str(root), identity, "none", batch_size=batch_size, chain_start=start)
    for it in iterations:
        w.append(_record(it))
    w.close()
    return w


def _rank_dir(root: Path, identity=IDENTITY) -> Path:
    return root / identity.dirname()


def _segments(root: Path, identity=IDENTITY) -> list[str]:
    """Everything in the rank's folder but the owner token (no .tmp may be left)."""
    return sorted(n for n in os.listdir(_rank_dir(root, identity)) if n != OWNER_FILE)


def test_batches_become_published_segments(tmp_path):
    w = _write(tmp_path, range(1, 8))
    assert _segments(tmp_path) == [
        "seg_0000000001_0000000003.bin",
        "seg_0000000004_0000000006.bin",
        "seg_0000000007_0000000007.bin",
    ]
    assert w.durable_iteration == 7
    assert w.stats.records == 7 and w.stats.segments == 3 and w.stats.bytes_written > 7 * 64 * 4
    scan = scan_rank_log(str(_rank_dir(tmp_path)), IDENTITY, start=0)
    assert scan.problems == [] and scan.last_iteration == 7
    for rec in scan.records:
        assert torch.equal(rec.tensors["grad"], _record(rec.iteration).tensors["grad"])
        assert rec.scalars == {"lr": 0.001 * rec.iteration}


def test_chain_starts_after_the_base(tmp_path):
    _write(tmp_path, range(1, 8))
    scan = scan_rank_log(str(_rank_dir(tmp_path)), IDENTITY, start=4)
    assert [r.iteration for r in scan.records] == [5, 6, 7] and scan.problems == []


def test_out_of_order_append_is_refused(tmp_path):
    w = DiffLogWriter(str(tmp_path), IDENTITY, "none", batch_size=2)
    w.append(_record(1))
    with pytest.raises(ValueError, match="expects iteration 2, got 3"):
        w.append(_record(3))
    w.close()


def _damage_second_segment(tmp_path: Path, how: str) -> str:
    _write(tmp_path, range(1, 10))
    path = _rank_dir(tmp_path) / "seg_0000000004_0000000006.bin"
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(data[:-40])  # inside the payload of its third record
    elif how == "bit-flipped":
        data[-20] ^= 0x01  # in the payload of the last record
        path.write_bytes(bytes(data))
    elif how == "missing":
        path.unlink()
    elif how == "foreign":
        other = tmp_path / "other"
        _write(other, range(1, 10), identity=OTHER_RANK)
        shutil.copy(_rank_dir(other, OTHER_RANK) / path.name, path)
    elif how == "garbage":
        path.write_bytes(os.urandom(len(data)))
    return path.name


@pytest.mark.parametrize(
    ("how", "last", "message"),
    [
        ("truncated", 5, "kept 2 of its records"),
        ("bit-flipped", 5, "checksum mismatch in the record of iteration 6"),
        ("missing", 3, "gap, iteration 4 is missing"),
        ("foreign", 3, "belongs to"),
        ("garbage", 3, "not a diff log segment"),
    ],
)
def test_damage_keeps_the_longest_valid_prefix_and_says_what_was_skipped(
    tmp_path, how, last, message
):
    name = _damage_second_segment(tmp_path, how)
    scan = scan_rank_log(str(_rank_dir(tmp_path)), IDENTITY, start=0)
    assert scan.last_iteration == last
    assert [r.iteration for r in scan.records] == list(range(1, last + 1))
    text = "\n".join(scan.problems)
    assert message in text
    assert "seg_0000000007_0000000009.bin" in text  # the segment after the damage is named
    if how != "missing":
        assert name in text


def test_foreign_segment_is_refused_whole(tmp_path):
    _write(tmp_path, range(1, 4), identity=OTHER_RANK)
    path = _rank_dir(tmp_path, OTHER_RANK) / "seg_0000000001_0000000003.bin"
    scan = read_segment(str(path), IDENTITY)
    assert scan.records == [] and "belongs to" in scan.error
    other_run = SegmentIdentity("run-b", 0, 0, 0, "layout-1")
    assert "belongs to" in read_segment(str(path), other_run).error
    assert read_segment(str(path), OTHER_RANK).error is None


def test_temporary_files_are_never_read(tmp_path):
    _write(tmp_path, range(1, 4))
    (_rank_dir(tmp_path) / "seg_0000000004_0000000006.bin.tmp").write_bytes(b"partial")
    scan = scan_rank_log(str(_rank_dir(tmp_path)), IDENTITY, start=0)
    assert scan.last_iteration == 3 and scan.problems == []


class _StalledWrites:
    """Makes the background thread wait on an event before each segment."""

    def __init__(self, monkeypatch):
        self.release = threading.Event()
        original = writer_module.write_segment

        def stalled(*args, **kwargs):
            assert self.release.wait(30)
            return original(*args, **kwargs)

        monkeypatch.setattr(writer_module, "write_segment", stalled)


def test_skip_policy_drops_batches_says_so_and_stops_durability(tmp_path, monkeypatch, caplog):
    stall = _StalledWrites(monkeypatch)
    w = DiffLogWriter(
        str(tmp_path), IDENTITY, "none", batch_size=1, max_pending=1, when_full="skip"
    )
    for it in range(1, 6):  # one in the thread, one queued, the rest dropped
        w.append(_record(it))
    assert w.stats.skipped_records >= 2
    assert "were NOT written" in caplog.text
    stall.release.set()
    w.flush()
    held = w.durable_iteration
    assert held < 5  # the gap holds durability back
    for it in range(6, 9):
        w.append(_record(it))
        assert w.flush() == held  # written after the gap, so they do not count yet
    w.rebase(5)  # a base of iteration 5 is published: the chain restarts there
    assert w.durable_iteration == 8
    w.close()
    scan = scan_rank_log(str(_rank_dir(tmp_path)), IDENTITY, start=5)
    assert [r.iteration for r in scan.records] == [6, 7, 8]


def test_skipped_iterations_leave_a_gap_that_a_base_past_it_closes(tmp_path):
    """LowDiff+ paused (``max_merge_wait_ms``): iterations 4-6 are skipped; the records before
    them are written in a batch of their own, those after do not count until base 6."""
    w = DiffLogWriter(str(tmp_path), IDENTITY, "none", batch_size=4)
    for it in range(1, 4):
        w.append(_record(it))
    for it in range(4, 7):
        w.skip(it)
    with pytest.raises(ValueError, match="expects iteration 7, got 6"):
        w.append(_record(6))
    for it in range(7, 9):
        w.append(_record(it))
    assert w.flush() == 3 and w.stats.skipped_records == 3
    w.rebase(6)
    assert w.durable_iteration == 8
    w.close()
    scan = scan_rank_log(str(_rank_dir(tmp_path)), IDENTITY, start=0)
    assert [r.iteration for r in scan.records] == [1, 2, 3]  # the chain from the start
    assert [r.iteration for r in scan_rank_log(str(_rank_dir(tmp_path)), IDENTITY,
                                               start=6).records] == [7, 8]  # fmt: skip


def test_block_policy_waits_and_loses_nothing(tmp_path, monkeypatch, caplog):
    stall = _StalledWrites(monkeypatch)
    w = DiffLogWriter(
        str(tmp_path), IDENTITY, "none", batch_size=1, max_pending=1, slow_hint="do this"
    )
    threading.Timer(0.5, stall.release.set).start()
    with caplog.at_level(logging.WARNING, logger=writer_module.__name__):
        for it in range(1, 6):
            w.append(_record(it))
    assert w.flush() == 5 and w.stats.skipped_records == 0 and w.stats.blocked_seconds > 0
    w.close()
    # Training waited for the writer: said once, with what to do.
    slow = [r.getMessage() for r in caplog.records if "cannot keep up" in r.getMessage()]
    assert len(slow) == 1 and "do this" in slow[0] and "training waited" in slow[0]  # main thread


def test_background_failure_reaches_the_training_loop(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(writer_module, "write_segment", broken)
    w = DiffLogWriter(str(tmp_path), IDENTITY, "none", batch_size=1)
    w.append(_record(1))
    with pytest.raises(RuntimeError, match="last durable iteration is 0") as exc:
        w.flush()
    assert "disk full" in str(exc.value.__cause__)
    with pytest.raises(RuntimeError):
        w.append(_record(2))
    with pytest.raises(RuntimeError):
        w.close()  # the failure is reported once more, and the thread stops
    assert not w._worker.alive


_KILLED_WRITER = textwrap.dedent(
    """
    import sys, torch
    from megatron_diffckpt.storage import DiffLogWriter, DiffRecord, SegmentIdentity
    w = DiffLogWriter(sys.argv[1], SegmentIdentity("run-a", 0, 0, 1, "layout-1"), "none",
                      batch_size=2, max_pending=2)
    it = 0
    while True:
        it += 1
        g = torch.Generator().manual_seed(it)
        w.append(DiffRecord(it, {"lr": 0.001 * it}, {"grad": torch.randn(1_000_000, generator=g)}))
        print("durable", w.durable_iteration, flush=True)
    """
)


@pytest.mark.parametrize("delay", [0.0, 0.15, 0.4])
def test_sigkill_mid_write_leaves_every_durable_iteration_readable(tmp_path, delay):
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    reported: list[int] = []
    progressed = threading.Event()

    def follow():
        for line in proc.stdout:
            m = re.fullmatch(r"\S+ (\d+)\n", line)  # a line the kill cut short is not a report
            if m is None:
                continue
            reported.append(int(m.group(1)))
            if reported[-1] >= 4:
                progressed.set()

    threading.Thread(target=follow, daemon=True).start()
    try:
        assert progressed.wait(120), "the writer made no progress"
        time.sleep(delay)  # land the kill at different points of a segment's write
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close()
    last_reported = reported[-1]

    scan = scan_rank_log(str(_rank_dir(tmp_path)), IDENTITY, start=0)
    # Everything the writer had called durable is there, intact, with no gap and no damage;
    # a segment cut by the kill exists only as a .tmp file, which is never read.
    assert scan.last_iteration >= last_reported
    assert scan.problems == []
    assert [r.iteration for r in scan.records] == list(range(1, scan.last_iteration + 1))
    for rec in scan.records:
        expected = torch.randn(1_000_000, generator=torch.Generator().manual_seed(rec.iteration))
        assert torch.equal(rec.tensors["grad"], expected)


def test_an_older_incarnation_never_publishes_into_a_newer_ones_log(tmp_path):
    """Two live writers of one rank (a restarted job while a rank of the old one still runs):
    the older one stops at its next segment, with an error; the newer one's log is intact."""
    old = DiffLogWriter(str(tmp_path), IDENTITY, "none", batch_size=1)
    old.append(_record(1))
    old.flush()
    new = DiffLogWriter(str(tmp_path), IDENTITY, "none", batch_size=1, chain_start=1)
    old.append(_record(2))
    with pytest.raises(RuntimeError, match="failed") as exc:
        old.flush()
    assert isinstance(exc.value.__cause__, writer_module.DiffLogOwnershipError)
    assert "newer incarnation" in str(exc.value.__cause__)
    new.append(_record(2))
    new.close()
    with pytest.raises(RuntimeError):
        old.close()
    rank_dir = tmp_path / IDENTITY.dirname()
    scan = scan_rank_log(str(rank_dir), IDENTITY, 0)
    assert [r.iteration for r in scan.records] == [1, 2] and not scan.problems
    assert torch.equal(scan.records[1].tensors["grad"], _record(2).tensors["grad"])


def _full_disk_for(iterations: set[int], monkeypatch) -> None:
    """Segments starting at these iterations fail with ENOSPC, as on a full filesystem."""
    original = writer_module.write_segment

    def write_segment(f, header, records):
        if header.first_iteration in iterations:
            f.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(f, header, records)

    monkeypatch.setattr(writer_module, "write_segment", write_segment)


def test_full_disk_with_skip_goes_on_with_one_warning_per_incident(tmp_path, monkeypatch, caplog):
    _full_disk_for({3, 4, 5}, monkeypatch)
    w = DiffLogWriter(str(tmp_path), IDENTITY, "none", batch_size=1, when_full="skip")
    with caplog.at_level("WARNING"):
        for it in range(1, 8):
            w.append(_record(it))
            w.flush()
        w.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("storage is full" in m for m in warnings) == 1, warnings  # one incident
    assert any("storage has space again at iteration 6" in m for m in warnings)
    assert w.durable_iteration == 2 and w.stats.skipped_records == 3
    # The valid prefix is intact, nothing partial is left, and a base rebases the chain.
    assert _segments(tmp_path) == [
        "seg_0000000001_0000000001.bin",
        "seg_0000000002_0000000002.bin",
        "seg_0000000006_0000000006.bin",
        "seg_0000000007_0000000007.bin",
    ]
    scan = scan_rank_log(str(_rank_dir(tmp_path)), IDENTITY, 0)
    assert [r.iteration for r in scan.records] == [1, 2]


def test_full_disk_with_block_stops_with_one_clear_error(tmp_path, monkeypatch):
    _full_disk_for({3}, monkeypatch)
    w = DiffLogWriter(str(tmp_path), IDENTITY, "none", batch_size=1, when_full="block")
    for it in (1, 2, 3):
        w.append(_record(it))
    with pytest.raises(writer_module.StorageFullError) as exc:
        w.flush()
    message = str(exc.value)
    assert "No space left on device" in message and "last durable iteration is 2" in message
    assert "--diffckpt-when-full skip" in message and "\n" not in message
    with pytest.raises(writer_module.StorageFullError):
        w.close()
    assert _segments(tmp_path) == [
        "seg_0000000001_0000000001.bin",
        "seg_0000000002_0000000002.bin",
    ]


@pytest.mark.parametrize("when_full", ["block", "strict"])
def test_strict_keeps_the_log_within_b_iterations_of_training_on_storage_slower_than_it(
    tmp_path, when_full
):
    """A storage that takes 40 ms per segment, an iteration every millisecond, B = 2: with
    ``block`` training runs ahead of what is durable by up to (1 + max_pending) x B iterations
    (what a crash would lose); with ``strict`` never by more than B (its appends wait)."""
    w = DiffLogWriter(str(tmp_path), IDENTITY, "none", batch_size=2, when_full=when_full)
    write = w._write_segment

    def slow(batch):
        time.sleep(0.04)
        write(batch)

    w._write_segment = slow
    lags = []
    for it in range(1, 25):
        w.append(_record(it, numel=8))
        lags.append(it - w.durable_iteration)  # what a crash now would lose
        time.sleep(0.001)
    w.close()
    assert w.durable_iteration == 24 and _segments(tmp_path)[-1] == "seg_0000000023_0000000024.bin"
    if when_full == "strict":
        assert max(lags) <= 2, lags
        assert w.stats.blocked_seconds > 0
    else:  # the storage is slower than training: the lag grows past B
        assert max(lags) > 2, lags


class _CopyingSink:
    """A sink that keeps a copy of the bytes of each record it is handed (what the node's
    keeper holds)."""

    def __init__(self) -> None:
        self.held: list[tuple[int, bytes]] = []
        self.held_iteration = None

    def put(self, record) -> None:
        data = record.data if isinstance(record, EncodedRecord) else encode_record(record)
        self.held.append((record.iteration, bytes(data)))
        self.held_iteration = record.iteration

    def published(self, base_iteration: int) -> None:
        pass


def test_serialised_at_append_the_caller_may_reuse_its_tensors_at_once(tmp_path):
    """LowDiff+'s merger gives the snapshot slot its record's gradients lie in back once
    ``append`` returns: the writer serialised them by then (segments read back equal to what
    was appended, though every appended tensor was overwritten right after), the sink got the
    record's bytes as the segment holds them, and the segments' records are byte for byte the
    ones the copying writer writes (only the header's JSON is padded to its room)."""
    sink = _CopyingSink()
    staged = DiffLogWriter(str(tmp_path / "staged"), IDENTITY, "none", batch_size=3,
                           sink=sink, serialise_at_append=True)  # fmt: skip
    for it in range(1, 8):
        rec = _record(it, numel=100_000)
        staged.append(rec)
        rec.tensors["grad"].fill_(float("nan"))  # the slot, reused
    staged.close()
    copied = DiffLogWriter(str(tmp_path / "copied"), IDENTITY, "none", batch_size=3)
    for it in range(1, 8):
        copied.append(_record(it, numel=100_000))
    copied.close()
    assert _segments(tmp_path / "staged") == _segments(tmp_path / "copied")
    scan = scan_rank_log(str(_rank_dir(tmp_path / "staged")), IDENTITY, start=0)
    assert scan.problems == [] and [r.iteration for r in scan.records] == list(range(1, 8))
    for rec in scan.records:
        assert torch.equal(rec.tensors["grad"], _record(rec.iteration, 100_000).tensors["grad"])
    assert sink.held == [(it, encode_record(_record(it, 100_000))) for it in range(1, 8)]
    for name in _segments(tmp_path / "staged"):
        a = (_rank_dir(tmp_path / "staged") / name).read_bytes()
        b = (_rank_dir(tmp_path / "copied") / name).read_bytes()
        with open(_rank_dir(tmp_path / "copied") / name, "rb") as f:
            read_header(f)
            header_end = f.tell()
        assert a[writer_module.STAGED_HEADER_BYTES :] == b[header_end:]
        with open(_rank_dir(tmp_path / "staged") / name, "rb") as f:
            assert read_header(f).first_iteration == int(name[4:14])
            assert f.tell() == writer_module.STAGED_HEADER_BYTES
    assert staged.stats.records == 7 and staged.stats.bytes_written == sum(
        (_rank_dir(tmp_path / "staged") / n).stat().st_size for n in _segments(tmp_path / "staged")
    )


def test_serialised_at_append_a_full_disk_or_a_dropped_batch_loses_only_that_batch(
    tmp_path, monkeypatch, caplog
):
    """With ``serialise_at_append`` the policies hold as with copies: a batch dropped for a
    writer behind is said, a segment refused for a full disk is skipped with one warning, and
    their staging buffers serve later batches (at most ``max_pending + 2`` are made)."""
    publish = writer_module.StagedPublisher.publish_staged
    stall = threading.Event()

    def full_or_slow(self, path, staging, written=None):
        stall.wait()
        if os.path.basename(path).startswith("seg_0000000007_"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return publish(self, path, staging, written)

    monkeypatch.setattr(writer_module.StagedPublisher, "publish_staged", full_or_slow)
    made = []
    original = writer_module.StagingBuffer.__init__
    monkeypatch.setattr(writer_module.StagingBuffer, "__init__",
                        lambda self: (made.append(self), original(self))[-1])  # fmt: skip
    w = DiffLogWriter(str(tmp_path), IDENTITY, "none", batch_size=1, max_pending=1,
                      when_full="skip", serialise_at_append=True)  # fmt: skip
    with caplog.at_level("WARNING"):
        w.append(_record(1))
        deadline = time.monotonic() + 30
        while w.backlog and time.monotonic() < deadline:  # the writer thread holds it
            time.sleep(0.01)
        for it in range(2, 6):  # 2 queued, 3-5 dropped
            w.append(_record(it))
        stall.set()
        w.flush()
        for it in range(6, 13):
            w.append(_record(it))
            w.flush()
        w.close()
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "fell behind" in m] == [
        f"diff log rank_0_0_1: storage fell behind, iterations {it}-{it} were NOT written; "
        "durability stays at iteration 0 until the next base"
        for it in (3, 4, 5)
    ], messages
    full = [m for m in messages if "storage is full" in m]
    assert len(full) == 1 and "iterations from 7 on are NOT written" in full[0], messages
    # the publisher's own (never written to here), and max_pending + 2 for the batches
    assert w.stats.skipped_records == 4 and len(made) <= 1 + 3
    scan = scan_rank_log(str(_rank_dir(tmp_path)), IDENTITY, start=0)
    assert [r.iteration for r in scan.records] == [1, 2]
    scan = scan_rank_log(str(_rank_dir(tmp_path)), IDENTITY, start=7)
    assert [r.iteration for r in scan.records] == list(range(8, 13))
    for rec in scan.records:
        assert torch.equal(rec.tensors["grad"], _record(rec.iteration).tensors["grad"])
