"""After recovery to T, the log is cut at T without losing any durable record at or before T."""

from __future__ import annotations

import os

import torch

from megatron_diffckpt.recovery import truncate_log
from megatron_diffckpt.storage import DiffLogWriter, DiffRecord, SegmentIdentity, scan_rank_log
from megatron_diffckpt.storage.writer import OWNER_FILE

IDENTITY = SegmentIdentity("run-a", 0, 0, 0, "layout-1")


def test_straddling_segment_is_rewritten_and_later_ones_removed(tmp_path):
    w = DiffLogWriter(str(tmp_path), IDENTITY, "none", batch_size=3)
    for it in range(1, 10):
        w.append(DiffRecord(it, {"i": it}, {"g": torch.full((4,), float(it))}))
    w.close()
    rank_dir = str(tmp_path / IDENTITY.dirname())
    scan = scan_rank_log(rank_dir, IDENTITY, 0)
    truncate_log(rank_dir, scan, 5)
    assert sorted(n for n in os.listdir(rank_dir) if n != OWNER_FILE) == [
        "seg_0000000001_0000000003.bin",
        "seg_0000000004_0000000005.bin",
    ]
    after = scan_rank_log(rank_dir, IDENTITY, 0)
    assert after.problems == [] and [r.iteration for r in after.records] == [1, 2, 3, 4, 5]
    assert torch.equal(after.records[-1].tensors["g"], torch.full((4,), 5.0))
    # New records continue the chain after T.
    w = DiffLogWriter(str(tmp_path), IDENTITY, "none", batch_size=2, chain_start=5)
    w.append(DiffRecord(6, {}, {}))
    w.close()
    assert scan_rank_log(rank_dir, IDENTITY, 0).last_iteration == 6
