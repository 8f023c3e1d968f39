"""Recovery: agree on the newest iteration every rank holds durably, then replay up to it.

The collective rule: :func:`agree_on_iteration` and :func:`replay` are called by all ranks
together (replay runs the optimizer step, which all-gathers parameters across data-parallel ranks).
The base is loaded before, by the caller, with stock ``dist_checkpointing``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from megatron_diffckpt import failpoints
from megatron_diffckpt.capture import ReplayTarget, replay_record, restore_rng
from megatron_diffckpt.durable_io import fsync_dir, publish_file
from megatron_diffckpt.storage.format import (
    DiffRecord,
    SegmentHeader,
    segment_filename,
    write_segment,
)
from megatron_diffckpt.storage.reader import RankLogScan, list_segments, read_segment_header

logger = logging.getLogger(__name__)


def all_reduce_min(values: list[int], group: Any = None) -> list[int]:
    """The element-wise minimum of ``values`` over the ranks of ``group``: one all-reduce.
    All ranks of ``group``, collectively."""
    return _all_reduce(values, torch.distributed.ReduceOp.MIN, group)


def all_reduce_sum(values: list[int], group: Any = None) -> list[int]:
    """The element-wise sum of ``values`` over the ranks of ``group``: one all-reduce.
    All ranks of ``group``, collectively."""
    return _all_reduce(values, torch.distributed.ReduceOp.SUM, group)


def _all_reduce(values: list[int], op: Any, group: Any) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64)
    if torch.cuda.is_available() and torch.distributed.get_backend(group) == "nccl":
        t = t.cuda()
    torch.distributed.all_reduce(t, op=op, group=group)
    return [int(x) for x in t.tolist()]


def agree_on_iteration(scan: RankLogScan, group: Any = None) -> int:
    """The largest T that every rank's chain reaches: one all-reduce (MIN). All ranks."""
    return all_reduce_min([scan.last_iteration], group)[0]


def replay(
    targets: list[ReplayTarget], records: list[DiffRecord], rng_tracker: Any, log_every: int = 10
) -> DiffRecord | None:
    """Replay ``records`` in order through ``targets`` (the optimizer's inner steps, from
    ``patches.optimizer_step.replay_targets``); restore the RNGs of the last one.

    All ranks, collectively. Returns the last record (its scalars hold the scheduler's step count
    and the consumed samples), or ``None`` when there was nothing to replay.
    """
    start = time.perf_counter()
    for i, record in enumerate(records, 1):
        replay_record(targets, record)
        failpoints.reach("replay")
        if i % log_every == 0 or i == len(records):
            rate = i / max(time.perf_counter() - start, 1e-9)
            logger.info(
                "replayed diff %d of %d (iteration %d, %.1f diffs/s)",
                i,
                len(records),
                record.iteration,
                rate,
            )
    if not records:
        return None
    restore_rng(records, rng_tracker)
    return records[-1]


def truncate_log(rank_dir: str, scan: RankLogScan, iteration: int) -> None:
    """Make ``rank_dir`` end at ``iteration``, so new records can follow it. Any rank.

    Segments after ``iteration`` are removed; one that straddles it is first rewritten with its
    records up to ``iteration`` (published atomically), so nothing durable at or before it is lost.
    """
    kept = {r.iteration: r for r in scan.records if r.iteration <= iteration}
    for first, last, path in list_segments(rank_dir):
        if last <= iteration:
            continue
        if first <= iteration:
            old = read_segment_header(path)
            prefix = [kept[i] for i in range(first, iteration + 1) if i in kept]
            if old is not None and len(prefix) == iteration - first + 1:
                header = SegmentHeader(old.identity, old.compressor, first, iteration, len(prefix))
                final = os.path.join(rank_dir, segment_filename(first, iteration))
                publish_file(final, lambda f, h=header, p=prefix: write_segment(f, h, p))
        os.remove(path)
        logger.info(
            "diff log: removed %s (after the recovered iteration %d)",
            os.path.basename(path),
            iteration,
        )
    fsync_dir(rank_dir)
