"""Retention keeps the newest K complete bases and every differential a kept base can replay."""

from __future__ import annotations

import os

import torch

from megatron_diffckpt.checkpoint_layout import publish_iteration
from megatron_diffckpt.retention import oldest_kept_base, prune_bases, prune_diff_log
from megatron_diffckpt.storage import DiffLogWriter, DiffRecord, SegmentIdentity, scan_rank_log

IDENTITY = SegmentIdentity("r", 0, 0, 0, "h")


def _setup(tmp_path):
    for it, complete in ((5, True), (10, True), (12, False), (15, True), (20, True)):
        d = tmp_path / f"iter_{it:07d}"
        d.mkdir()
        if complete:
            (d / "metadata.json").write_text("{}")
    publish_iteration(str(tmp_path), 15)  # iter_0000020 is complete but not yet published
    w = DiffLogWriter(str(tmp_path / "diffckpt"), IDENTITY, "none", batch_size=4)
    for i in range(1, 23):
        w.append(DiffRecord(i, {}, {"g": torch.ones(2)}))
    w.close()
    return str(tmp_path / "diffckpt" / IDENTITY.dirname())


def test_keeps_newest_bases_up_to_the_published_one(tmp_path):
    rank_dir = _setup(tmp_path)
    assert oldest_kept_base(str(tmp_path), 2) == 10
    assert prune_bases(str(tmp_path), 2) == ["iter_0000005"]
    assert sorted(os.listdir(tmp_path)) == [
        "diffckpt",
        "iter_0000010",
        "iter_0000012",
        "iter_0000015",
        "iter_0000020",
        "latest_checkpointed_iteration.txt",
    ]
    removed = prune_diff_log(str(tmp_path), rank_dir, 2)
    assert removed == ["seg_0000000001_0000000004.bin", "seg_0000000005_0000000008.bin"]
    # Both kept bases can still be replayed forward to the end of the log.
    for base in (10, 15):
        scan = scan_rank_log(rank_dir, IDENTITY, base)
        assert scan.problems == [] and scan.last_iteration == 22


def test_nothing_is_pruned_without_enough_bases_or_when_disabled(tmp_path):
    rank_dir = _setup(tmp_path)
    for keep in (0, 4):
        assert prune_bases(str(tmp_path), keep) == []
        assert prune_diff_log(str(tmp_path), rank_dir, keep) == []
    assert len([n for n in os.listdir(rank_dir) if n.startswith("seg_")]) == 6


def test_keep_one_never_removes_the_published_base(tmp_path):
    _setup(tmp_path)
    prune_bases(str(tmp_path), 1)
    assert os.path.isdir(tmp_path / "iter_0000015") and os.path.isdir(tmp_path / "iter_0000020")
    assert not os.path.exists(tmp_path / "iter_0000010")
