"""Retention: keep the newest K complete bases and the differentials that can still be replayed.

A differential of iteration i is useful only after a kept base at or before i. Once the newest K
complete bases are ``b_1 < ... < b_K``, bases older than ``b_1``, incomplete base folders older than
the newest complete base (debris of interrupted saves), and every segment whose last iteration is
at or before ``b_1`` can go. The base the tracker names, and anything newer, is never touched.

Collective rule: every rank calls :func:`prune_diff_log` for its own folder; rank 0 alone calls
:func:`prune_bases`. Call them only after the newest base is published.
"""

from __future__ import annotations

import logging
import os
import shutil

from megatron_diffckpt.checkpoint_layout import (
    CheckpointNotFoundError,
    checkpoint_dir,
    find_latest_iteration,
    list_checkpoints,
)
from megatron_diffckpt.storage.reader import list_segments

logger = logging.getLogger(__name__)


def oldest_kept_base(root: str, keep: int) -> int | None:
    """The oldest base retention keeps, or ``None`` when nothing may be pruned."""
    if keep < 1:
        return None
    try:
        latest = find_latest_iteration(root)
    except CheckpointNotFoundError:
        return None
    bases = [i for i, complete in list_checkpoints(root) if complete and i <= latest]
    return bases[-keep] if len(bases) >= keep else None


def bases_to_prune(root: str, keep: int) -> list[str]:
    """The base folders retention removes: every one older than the oldest kept base."""
    oldest = oldest_kept_base(root, keep)
    if oldest is None:
        return []
    return [checkpoint_dir(root, i) for i, _ in list_checkpoints(root) if i < oldest]


def segments_to_prune(root: str, rank_dir: str, keep: int) -> list[str]:
    """This rank's segments retention removes: those no kept base can replay."""
    oldest = oldest_kept_base(root, keep)
    if oldest is None:
        return []
    return [path for _, last, path in list_segments(rank_dir) if last <= oldest]


def prune_bases(root: str, keep: int) -> list[str]:
    """Remove base folders older than the oldest kept one. Rank 0 only. Returns what it removed."""
    removed = []
    for path in bases_to_prune(root, keep):
        shutil.rmtree(path)
        removed.append(os.path.basename(path))
    if removed:
        logger.info("retention (keep %d bases): removed %s", keep, ", ".join(removed))
    return removed


def prune_diff_log(root: str, rank_dir: str, keep: int) -> list[str]:
    """Remove this rank's segments that no kept base can replay. Any rank, its own folder."""
    removed = []
    for path in segments_to_prune(root, rank_dir, keep):
        os.remove(path)
        removed.append(os.path.basename(path))
    if removed:
        logger.info(
            "retention: removed %d segment(s) no kept base can replay from %s",
            len(removed),
            os.path.basename(rank_dir),
        )
    return removed
