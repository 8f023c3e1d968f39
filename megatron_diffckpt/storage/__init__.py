"""The diff log: per-rank segment files of differentials, their writer and their reader.

Layout::

    SAVE/diffckpt/rank_<tp>_<pp>_<dp>/seg_<first>_<last>.bin

See :mod:`.format` for the bytes, :mod:`.writer` for durability, :mod:`.reader` for recovery's
view (the longest valid chain and an account of everything skipped).
"""

from megatron_diffckpt.storage.format import (
    DiffLogFormatError,
    DiffRecord,
    ForeignSegmentError,
    SegmentHeader,
    SegmentIdentity,
)
from megatron_diffckpt.storage.reader import RankLogScan, read_segment, scan_rank_log
from megatron_diffckpt.storage.writer import DiffLogWriter

__all__ = [
    "DiffLogFormatError",
    "DiffLogWriter",
    "DiffRecord",
    "ForeignSegmentError",
    "RankLogScan",
    "SegmentHeader",
    "SegmentIdentity",
    "read_segment",
    "scan_rank_log",
]
