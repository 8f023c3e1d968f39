"""LowDiff's diff log written by the node's keeper (``--diffckpt-option keeper_writes_log``): a real
keeper process writes segments byte for byte as the rank's own writer does, from the records as
they were handed over; a rank SIGKILLed mid-batch leaves nothing unwritten (the keeper writes
its part batch when the connection ends); a rank whose keeper is SIGKILLed writes its log itself
from the keeper's durable iteration on, with nothing missing; a restarted rank's log supersedes
its predecessor's; a full filesystem stops the rank as its own writer would."""

from __future__ import annotations

import filecmp
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from launch import REPO, run_cli
from test_keeper import ME, record, start_keeper

from megatron_diffckpt.keeper.client import KeeperClient, query, stop
from megatron_diffckpt.keeper.logs import KeeperLogWriter
from megatron_diffckpt.out_of_space import StorageFullError
from megatron_diffckpt.storage.format import EncodedRecord, encode_record
from megatron_diffckpt.storage.reader import scan_rank_log
from megatron_diffckpt.storage.writer import OWNER_FILE, DiffLogOwnershipError, DiffLogWriter


def _writer(root: Path, keeper: KeeperClient | None, batch: int, **kwargs) -> DiffLogWriter:
    cls = DiffLogWriter if keeper is None else KeeperLogWriter
    return cls(str(root), ME, "identity", batch, sink=keeper, direct_io=False, **kwargs)


def _assert_log_holds(root: Path, last: int) -> None:
    """Storage's chain of ME from base 0 reaches ``last``, every record exact."""
    scan = scan_rank_log(str(root / ME.dirname()), ME, 0)
    assert scan.last_iteration == last and not scan.problems, (scan.last_iteration, scan.problems)
    for r in scan.records:
        expected = record(r.iteration).tensors["o0.g0.p0:dense"]
        assert torch.equal(r.tensors["o0.g0.p0:dense"], expected), r.iteration


@pytest.fixture
def keeper(tmp_path):
    sock = str(tmp_path / "keeper.sock")
    proc = start_keeper(sock)
    yield sock, proc
    if proc.poll() is None:
        stop(sock)
        proc.wait(30)


def test_an_encoded_record_is_checked_to_frame_one_record_of_its_iteration():
    data = encode_record(record(3))
    assert EncodedRecord.of(3, data).data is data
    for iteration, bad, why in (
        (4, data, "not an encoded record of iteration 4"),
        (3, data[:-1], "frames"),
        (3, data[:10], "truncated"),
        (3, b"XXXX" + data[4:], "not an encoded record"),
    ):
        with pytest.raises(ValueError, match=why):
            EncodedRecord.of(iteration, bad)


def test_the_keeper_writes_segments_as_the_ranks_own_writer_does(keeper, tmp_path):
    sock, _ = keeper
    client = KeeperClient(sock, ME)
    mine, theirs = tmp_path / "rank", tmp_path / "keeper"
    here, there = _writer(mine, None, 4), _writer(theirs, client, 4)
    assert there.in_keeper
    for i in range(1, 11):
        here.append(record(i))
        there.append(record(i))
    assert there.durable_iteration < 10  # 9 and 10 wait for a full batch
    shown = run_cli("inspect", str(tmp_path), "--keeper", sock).stdout
    assert "rank_0_0_1: diff log written here, durable to" in shown, shown
    assert there.flush() == here.flush() == 10
    assert there.stats.records == 10 and there.stats.segments == 3
    assert [s.records for s in there.take_samples()] == [4, 4, 2]
    names = sorted(p.name for p in (mine / ME.dirname()).glob("seg_*"))
    assert names == sorted(p.name for p in (theirs / ME.dirname()).glob("seg_*")), names
    for name in names:  # the same bytes: header, records, checksums
        assert filecmp.cmp(mine / ME.dirname() / name, theirs / ME.dirname() / name, False)
    _assert_log_holds(theirs, 10)
    there.rebase(10)  # a base: the keeper drops the records up to it
    there.close()
    here.close()
    assert query(sock)["logs"] == []  # closed with its writer
    assert (theirs / ME.dirname() / OWNER_FILE).exists()


def test_a_rank_killed_mid_batch_leaves_nothing_unwritten(keeper, tmp_path):
    sock, _ = keeper
    root = tmp_path / "log"
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_keeper import ME, record
        from test_keeper_log import _writer
        from megatron_diffckpt.keeper.client import KeeperClient
        from pathlib import Path
        writer = _writer(Path({str(root)!r}), KeeperClient({sock!r}, ME), 8)
        for i in range(1, 12):
            writer.append(record(i))
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 30  # written when the keeper sees the connection end
    while not (root / ME.dirname() / "seg_0000000009_0000000011.bin").exists():
        assert time.monotonic() < deadline, sorted(os.listdir(root / ME.dirname()))
        time.sleep(0.05)
    _assert_log_holds(root, 11)
    assert query(sock)["logs"] == []


def test_a_rank_whose_keeper_dies_writes_its_log_itself_losing_nothing(keeper, tmp_path, caplog):
    sock, proc = keeper
    root = tmp_path / "log"
    writer = _writer(root, KeeperClient(sock, ME), 4)
    for i in range(1, 5):
        writer.append(record(i))
    assert writer.flush() == 4
    for i in (5, 6):
        writer.append(record(i))
    assert writer.in_keeper and writer.durable_iteration == 4  # 5 and 6 in the keeper's batch
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    with caplog.at_level(logging.WARNING, logger="megatron_diffckpt"):
        for i in range(7, 11):
            writer.append(record(i))
        assert writer.flush() == 10
    assert not writer.in_keeper
    taken = [r.getMessage() for r in caplog.records if "stopped writing it" in r.getMessage()]
    assert len(taken) == 1 and "this rank writes it from iteration 5 on" in taken[0], taken
    _assert_log_holds(root, 10)
    writer.close()


def test_a_restarted_ranks_log_supersedes_its_predecessors(keeper, tmp_path):
    sock, _ = keeper
    root = tmp_path / "log"
    old = _writer(root, KeeperClient(sock, ME), 2)
    for i in range(1, 6):
        old.append(record(i))  # 1-4 written, 5 in the keeper's batch
    # the restarted rank resumes after 3: its predecessor's 4 and 5 are cut
    new = _writer(root, KeeperClient(sock, ME), 2, chain_start=3)
    with pytest.raises(DiffLogOwnershipError, match="a newer incarnation of this rank"):
        old.append(record(6))
    for i in range(4, 6):
        new.append(record(i))
    assert new.flush() == 5
    names = sorted(p.name for p in (root / ME.dirname()).glob("seg_*"))
    assert names == [
        "seg_0000000001_0000000002.bin",
        "seg_0000000003_0000000003.bin",
        "seg_0000000004_0000000005.bin",
    ], names
    _assert_log_holds(root, 5)
    new.close()


def test_a_full_filesystem_stops_the_rank_as_its_own_writer_would(keeper, tmp_path, tmpfs):
    sock, _ = keeper
    root = tmpfs("full", "256k")
    writer = _writer(root, KeeperClient(sock, ME), 1, max_pending=1)
    with pytest.raises(StorageFullError, match="free space and restart with --load"):
        for i in range(1, 40):
            writer.append(record(i, n=1 << 14))  # 64 KiB each
            time.sleep(0.01)
        writer.flush()
    assert writer.durable_iteration >= 1


def test_records_the_keeper_skips_are_said_in_the_ranks_log(keeper, tmp_path, tmpfs, caplog):
    """``--diffckpt-when-full skip`` with the keeper writing: the batches a full filesystem
    refuses are dropped by the keeper's writer, training goes on, and the rank's log says so
    with the durable iteration that stays."""
    sock, _ = keeper
    root = tmpfs("full", "256k")
    writer = _writer(root, KeeperClient(sock, ME), 1, when_full="skip")
    with caplog.at_level(logging.WARNING, logger="megatron_diffckpt"):
        for i in range(1, 20):
            writer.append(record(i, n=1 << 14))  # 64 KiB each
        writer.flush()
    said = [r.getMessage() for r in caplog.records if "could not write" in r.getMessage()]
    stays = [int(re.search(r"durability stays at iteration (\d+)", m).group(1)) for m in said]
    # Once per incident, not per record: a loaded host may also see the keeper's writer fall
    # behind before storage fills (an incident of its own, at an older durable iteration).
    assert stays and stays == sorted(set(stays)), said
    assert writer.in_keeper and writer.stats.skipped_records > 0
    assert writer.durable_iteration < 19
    writer.close()


def test_a_keeper_stopped_by_sigterm_writes_what_it_holds_and_leaves_nothing(tmp_path):
    """Slurm's ``scancel`` (or a preemption) sends SIGTERM to every process of the job, the
    keeper included, while a rank's part batch (9-11 of a batch of 8) is held only there: the
    keeper writes it out, removes its shared-memory folder and socket, says so in one line and
    exits 0."""
    sock, shm = str(tmp_path / "keeper.sock"), tmp_path / "diffckpt-keeper-t"
    proc = start_keeper(sock, "--shm-dir", str(shm))
    root = tmp_path / "log"
    writer = _writer(root, KeeperClient(sock, ME), 8)
    for i in range(1, 12):
        writer.append(record(i))
    deadline = time.monotonic() + 30  # 1-8 written; 9-11 wait for a full batch, in the keeper
    while scan_rank_log(str(root / ME.dirname()), ME, 0).last_iteration != 8:
        assert time.monotonic() < deadline, sorted(os.listdir(root / ME.dirname()))
        time.sleep(0.05)
    assert shm.is_dir()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    said = proc.stderr.read().decode()
    _assert_log_holds(root, 11)
    assert not os.path.exists(sock) and not shm.exists()
    assert "Traceback" not in said, said
    stopped = [line for line in said.splitlines() if "SIGTERM" in line]
    assert len(stopped) == 1 and "written out" in stopped[0], said
