"""Reading a rank's diff log: the longest valid chain, and exactly what was skipped and why.

Any rank, no collectives. Damage never raises here: recovery needs the valid prefix and a precise
account of the rest, so every problem becomes a line in :attr:`RankLogScan.problems`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from megatron_diffckpt.storage.format import (
    DiffLogFormatError,
    DiffRecord,
    ForeignSegmentError,
    SegmentHeader,
    SegmentIdentity,
    iter_records,
    read_header,
)

_SEGMENT_RE = re.compile(r"^seg_(\d{10})_(\d{10})\.bin$")
_RANK_DIR_RE = re.compile(r"^rank_(\d+)_(\d+)_(\d+)$")  # SegmentIdentity.dirname()
RUN_ID_FILE = "run.json"  # the run's id (and the mode that created the log), in the log's root


def list_rank_dirs(diff_dir: str) -> list[str]:
    """The names of the rank folders (``rank_<tp>_<pp>_<dp>``) of a diff log, sorted; none when
    the folder is missing. Any process."""
    if not os.path.isdir(diff_dir):
        return []
    return sorted(n for n in os.listdir(diff_dir) if _RANK_DIR_RE.match(n))


def read_run_info(diff_dir: str) -> dict:
    """The diff log's ``run.json`` (``run_id``, ``mode``); empty when missing or unreadable."""
    try:
        with open(os.path.join(diff_dir, RUN_ID_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


@dataclass
class SegmentScan:
    """One segment file: its header (if readable), its valid records, and its first problem."""

    path: str
    header: SegmentHeader | None = None
    records: list[DiffRecord] = field(default_factory=list)
    error: str | None = None


def read_segment(path: str, identity: SegmentIdentity | None = None) -> SegmentScan:
    """Read ``path``, keeping the records before the first damaged one. Any rank.

    With ``identity``, a segment of another rank, run or layout is refused whole.
    """
    scan = SegmentScan(path)
    try:
        with open(path, "rb") as f:
            scan.header = read_header(f)
            if identity is not None and scan.header.identity != identity:
                raise ForeignSegmentError(
                    f"segment belongs to {scan.header.identity}, expected {identity}"
                )
            expected = scan.header.first_iteration
            for rec in iter_records(f):
                if rec.iteration != expected:
                    raise DiffLogFormatError(
                        f"record of iteration {rec.iteration} where {expected} was expected"
                    )
                if rec.iteration > scan.header.last_iteration:
                    raise DiffLogFormatError(
                        f"record of iteration {rec.iteration} beyond the header's last "
                        f"iteration {scan.header.last_iteration}"
                    )
                scan.records.append(rec)
                expected += 1
    except ForeignSegmentError as exc:
        scan.records.clear()
        scan.error = str(exc)
    except (DiffLogFormatError, OSError) as exc:
        scan.error = str(exc)
    if scan.error is None and scan.header is not None:
        if len(scan.records) != scan.header.num_records:
            scan.error = (
                f"truncated: {len(scan.records)} of {scan.header.num_records} records present"
            )
    return scan


def read_segment_header(path: str) -> SegmentHeader | None:
    """The segment's header alone (its records are not read), or ``None`` when unreadable."""
    try:
        with open(path, "rb") as f:
            return read_header(f)
    except (DiffLogFormatError, OSError):
        return None


def list_segments(rank_dir: str) -> list[tuple[int, int, str]]:
    """``(first, last, path)`` of the published segments in ``rank_dir``, by first iteration."""
    if not os.path.isdir(rank_dir):
        return []
    found = []
    for name in os.listdir(rank_dir):
        m = _SEGMENT_RE.match(name)
        if m:
            found.append((int(m.group(1)), int(m.group(2)), os.path.join(rank_dir, name)))
    return sorted(found)


@dataclass
class RankLogScan:
    """The contiguous chain of records after ``start`` in one rank's log, and what was skipped."""

    start: int
    records: list[DiffRecord] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    foreign: SegmentIdentity | None = None
    """The identity of a segment after ``start`` that belongs to another rank, run or layout
    (the first one met), e.g. differentials written under another parallel layout."""

    @property
    def last_iteration(self) -> int:
        """The newest iteration the chain reaches (``start`` when it is empty)."""
        return self.records[-1].iteration if self.records else self.start


def scan_rank_log(rank_dir: str, identity: SegmentIdentity, start: int) -> RankLogScan:
    """The records for iterations ``start + 1, start + 2, ...`` with no gap. Any rank.

    ``start`` is the iteration of the base the chain is replayed onto. Reading stops at the first
    gap, damaged record or foreign segment; every segment not replayed is named in ``problems``.
    """
    result = RankLogScan(start)
    expected = start + 1
    segments = list_segments(rank_dir)
    ended_at = len(segments)
    for i, (first, last, path) in enumerate(segments):
        if last < expected:
            continue  # entirely at or before the base
        name = os.path.basename(path)
        if first > expected:
            result.problems.append(f"{name}: the chain has a gap, iteration {expected} is missing")
            ended_at = i + 1
            break
        scan = read_segment(path, identity)
        if scan.header is not None and scan.header.identity != identity:
            result.foreign = result.foreign or scan.header.identity
        if (
            scan.error is None
            and scan.header is not None
            and ((scan.header.first_iteration, scan.header.last_iteration) != (first, last))
        ):
            scan.error = (
                f"header holds iterations {scan.header.first_iteration}-"
                f"{scan.header.last_iteration}, the file name {first}-{last}"
            )
            scan.records.clear()
        usable = [r for r in scan.records if r.iteration >= expected]
        result.records.extend(usable)
        expected += len(usable)
        if scan.error is not None:
            result.problems.append(
                f"{name}: {scan.error}; kept {len(usable)} of its records, the chain ends at "
                f"iteration {expected - 1}"
            )
            ended_at = i + 1
            break
    rest = [os.path.basename(p) for _, _, p in segments[ended_at:]]
    if rest:
        result.problems.append(f"not replayed, after the end of the chain: {', '.join(rest)}")
    return result
