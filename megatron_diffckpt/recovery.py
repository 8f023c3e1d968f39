"""Recovery: agree on the newest iteration every rank holds durably, then replay up to it.

The collective rule: :func:`agree_on_iteration` and :func:`replay` are called by all ranks
together (replay runs the optimizer step, which all-gathers parameters across data-parallel ranks).
The base is loaded before, by the caller, with stock ``dist_checkpointing``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from megatron_diffckpt import control, failpoints
from megatron_diffckpt.capture import ReplayTarget, replay_record, restore_rng
from megatron_diffckpt.durable_io import fsync_dir, publish_file
from megatron_diffckpt.out_of_space import FULL_ERRNOS, StorageFullError
from megatron_diffckpt.storage.format import (
    DiffRecord,
    SegmentHeader,
    SegmentIdentity,
    segment_filename,
    write_segment,
)
from megatron_diffckpt.storage.reader import (
    RankLogScan,
    list_segments,
    read_segment,
    read_segment_header,
)

logger = logging.getLogger(__name__)


def all_reduce_min(values: list[int], group: Any = None, what: str = "all-reduce") -> list[int]:
    """The element-wise minimum of ``values`` over the ranks of ``group``: one all-reduce (on
    the whole job, the library's collective ``what``, with :mod:`~megatron_diffckpt.control`'s
    timeout). All ranks of ``group``, collectively."""
    return _all_reduce(values, torch.distributed.ReduceOp.MIN, group, what)


def all_reduce_sum(values: list[int], group: Any = None, what: str = "all-reduce") -> list[int]:
    """The element-wise sum of ``values`` over the ranks of ``group``: one all-reduce (see
    :func:`all_reduce_min`). All ranks of ``group``, collectively."""
    return _all_reduce(values, torch.distributed.ReduceOp.SUM, group, what)


def _all_reduce(values: list[int], op: Any, group: Any, what: str) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64)
    if torch.cuda.is_available() and torch.distributed.get_backend(group) == "nccl":
        t = t.cuda()
    plane = control.current()
    if plane is None or group is not None:
        torch.distributed.all_reduce(t, op=op, group=group)
    else:
        plane.run(what, lambda: torch.distributed.all_reduce(t, op=op, async_op=True))
    return [int(x) for x in t.tolist()]


def agree_on_iteration(scan: RankLogScan | TieredChain, group: Any = None) -> int:
    """The largest T that every rank's chain reaches: one all-reduce (MIN). All ranks."""
    what = "recovery: the iteration every rank reaches"
    return all_reduce_min([scan.last_iteration], group, what)[0]


@dataclass
class TieredChain:
    """A rank's chain after its base, from storage and from the node's keeper."""

    records: list[DiffRecord]
    """Consecutive iterations from the base's next on."""
    stored: int
    """The last iteration of storage's chain (the base's own when it holds none)."""
    kept_by: str = "the node's keeper"
    """Who served the records after ``stored``."""

    @property
    def last_iteration(self) -> int:
        return self.records[-1].iteration if self.records else self.stored

    def served(self, target: int) -> str:
        """Which tier serves which iterations up to ``target``, for the log."""
        parts = []
        first = self.records[0].iteration if self.records else target + 1
        if first <= min(self.stored, target):
            parts.append(f"{first}-{min(self.stored, target)} from the diff log")
        if target > self.stored:
            parts.append(f"{self.stored + 1}-{target} from {self.kept_by}")
        return ", ".join(parts) or "nothing to replay"


def join_tiers(
    scan: RankLogScan, kept: list[DiffRecord], kept_by: str = "the node's keeper"
) -> TieredChain:
    """Storage's chain (``scan``) extended by the keeper's consecutive records after it
    (``kept``, from any iteration on, served by ``kept_by``; what both hold is taken from
    storage). Any rank."""
    records, expected = list(scan.records), scan.last_iteration + 1
    for record in kept:
        if record.iteration > expected:
            break
        if record.iteration == expected:
            records.append(record)
            expected += 1
    return TieredChain(records, scan.last_iteration, kept_by)


def fill_log(
    rank_dir: str, identity: SegmentIdentity, compressor: str, records: list[DiffRecord]
) -> None:
    """Publish ``records`` (consecutive, following the end of the rank's log) as one segment,
    so that storage's chain reaches as far as recovery did. Any rank. A full filesystem raises
    :class:`~megatron_diffckpt.out_of_space.StorageFullError` whatever ``--diffckpt-when-full``
    says: training on would count iterations durable that storage lacks (the keeper still
    holds them for the next attempt)."""
    if not records:
        return
    first, last = records[0].iteration, records[-1].iteration
    header = SegmentHeader(identity, compressor, first, last, len(records))
    try:
        os.makedirs(rank_dir, exist_ok=True)
        publish_file(
            os.path.join(rank_dir, segment_filename(first, last)),
            lambda f: write_segment(f, header, records),
        )
        fsync_dir(rank_dir)
    except OSError as exc:
        if exc.errno not in FULL_ERRNOS:
            raise
        raise StorageFullError(
            f"{rank_dir} has no room for iterations {first}-{last}, recovered from the node's "
            f"keeper ({exc.strerror}): free space and restart with --load"
        ) from exc
    logger.info(
        "diff log: wrote iterations %d-%d, recovered from the node's keeper, to %s",
        first,
        last,
        rank_dir,
    )


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


def truncate_log(rank_dir: str, scan: RankLogScan | None, iteration: int) -> None:
    """Make ``rank_dir`` end at ``iteration``, so new records can follow it. Any process.

    Segments after ``iteration`` are removed; one that straddles it is first rewritten with its
    records up to ``iteration`` (published atomically), so nothing durable at or before it is lost.
    The straddling segment's records come from ``scan`` (the rank's chain, read for its
    recovery); without one, from the segment itself.
    """
    kept = {r.iteration: r for r in scan.records if r.iteration <= iteration} if scan else {}
    for first, last, path in list_segments(rank_dir):
        if last <= iteration:
            continue
        if first <= iteration:
            old = read_segment_header(path)
            if scan is None:
                kept = {r.iteration: r for r in read_segment(path).records}
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
