"""The batched background writer of one rank's diff log.

The training loop hands over one :class:`DiffRecord` per iteration; every ``batch_size`` records
become one segment, which a background thread serialises into its staging buffer, writes to
``<name>.tmp`` (direct I/O where the filesystem takes it:
:class:`~megatron_diffckpt.durable_io.StagedPublisher`), fsyncs, renames to its final name and
fsyncs the directory: only then do its iterations count as durable. The loop never
waits on storage unless it asks to (:meth:`DiffLogWriter.flush`) or the bounded backlog is full and
the policy is ``"block"``; with ``"skip"`` the batch is dropped instead, a warning names the lost
iterations, and durability stops advancing at the gap (a chain cannot be replayed past it) until
:meth:`DiffLogWriter.rebase` names a base published after the gap. Errors of the background
thread are raised by the next call from the training loop, never swallowed.

With a sink (:class:`~megatron_diffckpt.storage.sink.RecordSink`: the node's keeper), every record
is first handed to it, in the caller's thread: once :meth:`DiffLogWriter.append` returns, it holds
the record in memory that outlives this rank (:attr:`DiffLogWriter.kept_iteration`), whatever
storage has made durable yet. (With ``--diffckpt-option keeper_writes_log`` the keeper writes the
segments too: :class:`~megatron_diffckpt.keeper.logs.KeeperLogWriter`.)

Any rank, no collectives: each rank writes only its own folder.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megatron_diffckpt import failpoints
from megatron_diffckpt.background import BackgroundWorker
from megatron_diffckpt.durable_io import StagedPublisher, StagingBuffer, publish_file
from megatron_diffckpt.errors import DiffCkptError
from megatron_diffckpt.out_of_space import FULL_ERRNOS, StorageFullError
from megatron_diffckpt.storage.format import (
    DiffRecord,
    EncodedRecord,
    SegmentHeader,
    SegmentIdentity,
    encode_file_header,
    segment_filename,
    write_record,
    write_segment,
)

if TYPE_CHECKING:
    from megatron_diffckpt.storage.sink import RecordSink

logger = logging.getLogger(__name__)

WHEN_FULL = ("block", "skip", "strict")


@dataclass
class WriterStats:
    """Counters since the writer started."""

    segments: int = 0
    records: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    blocked_seconds: float = 0.0
    skipped_records: int = 0
    cpu_seconds: float = 0.0
    """CPU time of the writer thread (serialising, checksums, the kernel's copy into the page
    cache, fsync), whatever the wall clock of its waits."""


@dataclass(frozen=True)
class SegmentSample:
    """How one segment's publication went (what the auto-tuner measures)."""

    records: int
    nbytes: int
    write_s: float
    """Serialising and writing the bytes."""
    sync_s: float
    """fsync, rename and folder fsync: the fixed cost of a write."""


STAGED_HEADER_BYTES = 1024
"""With ``serialise_at_append``: the room a segment's staging buffer keeps for its file header
before the records (the header's JSON padded to fill it; it needs about 300 bytes)."""


@dataclass
class _Batch:
    """One segment's records: as handed over (``records``) or, with ``serialise_at_append``,
    serialised into ``staged`` after :data:`STAGED_HEADER_BYTES` for the file header."""

    iterations: list[int] = field(default_factory=list)
    records: list[DiffRecord | EncodedRecord] = field(default_factory=list)
    staged: StagingBuffer | None = None

    def __len__(self) -> int:
        return len(self.iterations)

    @property
    def first(self) -> int:
        return self.iterations[0]

    @property
    def last(self) -> int:
        return self.iterations[-1]


OWNER_FILE = "owner"
"""In a rank's folder: the token of the writer that holds it (the newest incarnation)."""


class DiffLogOwnershipError(DiffCkptError):
    """A newer incarnation of this rank took over its diff-log folder."""


class DiffLogWriter:
    """Writes one rank's differentials as segments of ``batch_size`` consecutive iterations.

    One incarnation at a time: a writer takes the rank's folder over when it starts (a fresh
    token in ``OWNER_FILE``) and checks the token before publishing each segment, so a leftover
    process of an older incarnation (a rank that had not died yet when its job restarted) stops
    instead of publishing into the newer incarnation's log.

    Args:
        root: the diff log folder (``SAVE/diffckpt``); this rank writes ``root/rank_T_P_D``.
        identity: whose records these are; written into every segment header.
        compressor: the compressor's name, recorded in each header.
        batch_size: iterations per segment (B).
        max_pending: segments that may wait for the background thread (bounds host memory at
            about ``(max_pending + 2) * batch_size`` records, and the staging buffer one segment).
        when_full: when storage cannot keep up or is full: ``"block"`` (wait for the writer
            once ``max_pending`` segments wait; a full disk stops training with
            :class:`StorageFullError`), ``"strict"`` (as block, and :meth:`append` returns only
            once at most ``batch_size`` iterations are not durable: :meth:`wait_durable`) or
            ``"skip"`` (drop the batch with one warning per incident, go on; durability waits
            for the next base).
        chain_start: the iteration of the base the first record follows.
        slow_hint: what to do when storage cannot keep up, for the warning that says so (once
            per writer, the first time a hand-over waits for it).
        sink: handed every record before storage (the node's keeper; ``None``: storage only).
        durable_from: the newest iteration storage is known to hold when that is before
            ``chain_start`` (a chain that resumes after a gap: its segments count once a base
            after the gap is published, :meth:`rebase`); default ``chain_start``.
        direct_io: write segments with direct I/O where the filesystem takes it
            (:class:`~megatron_diffckpt.durable_io.StagedPublisher`; ``False``: through the page
            cache). Either way the writer holds one page-aligned staging buffer of the largest
            segment's size.
        serialise_at_append: :meth:`append` serialises the record into its segment's staging
            buffer at once, in the caller's thread (the one copy of its bytes, checksummed on
            the way), so the caller may change the record's tensors once it returns: for a
            caller that would otherwise copy them to hand them over (LowDiff+'s merger, which
            gives the snapshot slot they lie in back). The writer thread then only writes. A
            segment keeps :data:`STAGED_HEADER_BYTES` for its header (the JSON padded); up to
            ``max_pending + 2`` staging buffers (filled, waiting, being written), each of the
            largest segment's size, in place of the records the other way holds.
    """

    SLOW_AFTER_S = 0.01
    """A hand-over that waits this long means the writer is behind: the warning is due."""

    def __init__(
        self,
        root: str,
        identity: SegmentIdentity,
        compressor: str,
        batch_size: int,
        max_pending: int = 2,
        when_full: str = "block",
        chain_start: int = 0,
        slow_hint: str = "a larger --diffckpt-batch-size spreads each write's fixed cost",
        sink: RecordSink | None = None,
        direct_io: bool = True,
        durable_from: int | None = None,
        serialise_at_append: bool = False,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        if when_full not in WHEN_FULL:
            raise ValueError(f"when_full must be one of {WHEN_FULL}, got {when_full!r}")
        self.identity = identity
        self.compressor = compressor
        self.batch_size = batch_size
        self.max_pending = max_pending
        self.when_full = when_full
        self.direct_io = direct_io
        self.serialise_at_append = serialise_at_append
        if serialise_at_append:  # raises now if a header can never fit its room
            most = 2**63 - 1
            encode_file_header(SegmentHeader(identity, compressor, most, most, most),
                               STAGED_HEADER_BYTES)  # fmt: skip
        self.slow_hint = slow_hint
        self.sink = sink
        self._slow_warned = False
        self.dir = os.path.join(root, identity.dirname())
        os.makedirs(self.dir, exist_ok=True)
        self._token = uuid.uuid4().hex
        publish_file(os.path.join(self.dir, OWNER_FILE), lambda f: f.write(self._token.encode()))
        self.stats = WriterStats()
        self._batch = _Batch()
        self._spare: list[StagingBuffer] = []  # of batches written or dropped, for the next ones
        self._lock = threading.Lock()
        self._durable_moved = threading.Condition(self._lock)
        self._next_iteration = chain_start + 1
        # The chain: every iteration in (base, _durable] is published. Segments published beyond a
        # gap (a skipped batch) wait in _after_gap until a rebase() or the gap's filling joins them.
        self._durable = chain_start if durable_from is None else min(durable_from, chain_start)
        self._after_gap: list[tuple[int, int]] = []
        self._samples: deque[SegmentSample] = deque(maxlen=256)
        self._full_since: int | None = None  # first iteration skipped for a full disk
        self._publisher = StagedPublisher(direct_io, what=f"diff log {identity.dirname()}")
        self._worker = BackgroundWorker(
            "diffckpt-writer", self._write, maxsize=max_pending, on_error=self._failed
        )

    # -- the training loop's side -----------------------------------------------------------

    @property
    def durable_iteration(self) -> int:
        """The newest iteration whose record, and all before it back to the chain start, is on
        disk (fsynced and published)."""
        with self._lock:
            return self._durable

    def append(self, record: DiffRecord | EncodedRecord) -> None:
        """Take ownership of ``record`` (its tensors must not change afterwards). Strict: returns
        once at most ``batch_size`` iterations up to it are not durable."""
        self._raise_background_error()
        self._advance(record.iteration)
        self._add(record, self.sink)
        if self.when_full == "strict":
            self.wait_durable(record.iteration - self.batch_size)

    def skip(self, iteration: int) -> None:
        """``iteration`` is not logged (LowDiff+ stopped merging until the next base): the
        records before it are written as a batch of their own, and the chain has a gap there
        until a :meth:`rebase` past it."""
        self._raise_background_error()
        self._advance(iteration)
        self.stats.skipped_records += 1
        if self._batch:
            self._submit()

    def wait_durable(self, iteration: int) -> None:
        """Wait until :attr:`durable_iteration` reaches ``iteration`` (or an error of the
        writer's thread is raised); counted in ``stats.blocked_seconds``. Every record up to
        ``iteration`` must have been handed over in a full batch."""
        start = time.perf_counter()
        with self._durable_moved:
            while self._durable < iteration and self._worker.error is None:
                self._durable_moved.wait(0.1)
        self.stats.blocked_seconds += time.perf_counter() - start
        self._raise_background_error()

    def _advance(self, iteration: int) -> None:
        """Check that ``iteration`` is the next one, and count it."""
        if iteration != self._next_iteration:
            raise ValueError(
                f"diff log of {self.identity.dirname()} expects iteration "
                f"{self._next_iteration}, got {iteration}"
            )
        self._next_iteration += 1

    def _add(self, record: DiffRecord | EncodedRecord, sink: RecordSink | None = None) -> None:
        """Batch ``record`` and hand it to ``sink`` (with ``serialise_at_append``, as its bytes
        lie in the batch's staging buffer: not encoded twice); a full batch goes to the
        background thread."""
        if self.serialise_at_append:
            self._stage(record, sink)
        else:
            if sink is not None:
                sink.put(record)
            self._batch.records.append(record)
        self._batch.iterations.append(record.iteration)
        if len(self._batch) >= self.batch_size:
            self._submit()

    def _stage(self, record: DiffRecord | EncodedRecord, sink: RecordSink | None) -> None:
        """The record's bytes into the batch's staging buffer, then, as they lie there, to
        ``sink``."""
        batch = self._batch
        if batch.staged is None:
            batch.staged = self._spare.pop() if self._spare else StagingBuffer()
            batch.staged.reset()
            batch.staged.write(bytes(STAGED_HEADER_BYTES))
        start = batch.staged.tell()
        if isinstance(record, EncodedRecord):
            batch.staged.write(record.data)
        else:
            write_record(batch.staged, record)
        if sink is not None:
            with batch.staged.view(start, batch.staged.tell()) as data:
                sink.put(EncodedRecord(record.iteration, data))

    @property
    def next_iteration(self) -> int:
        """The iteration the next :meth:`append` takes."""
        return self._next_iteration

    @property
    def kept_iteration(self) -> int | None:
        """The newest iteration the sink (the node's keeper) holds (``None`` without one)."""
        return None if self.sink is None else self.sink.held_iteration

    @property
    def backlog(self) -> int:
        """Segments handed over and not yet written."""
        return self._worker.backlog

    def flush(self) -> int:
        """Write the partial batch and wait until everything handed over is durable.

        Returns :attr:`durable_iteration`.
        """
        if self._batch:
            self._submit(force_block=True)
        self._worker.join()
        self._raise_background_error()
        return self.durable_iteration

    def take_samples(self) -> list[SegmentSample]:
        """The segments published since the previous call (at most the newest 256)."""
        with self._lock:
            samples = list(self._samples)
            self._samples.clear()
        return samples

    def rebase(self, base_iteration: int) -> None:
        """A base of ``base_iteration`` is published: durability now counts from it.

        Records after it that were written still count; a gap before it no longer matters. The
        training loop's order of records is unchanged. Any time, from the training loop.
        """
        if self.sink is not None:
            self.sink.published(base_iteration)
        with self._lock:
            if base_iteration > self._durable:
                self._durable = base_iteration
            self._after_gap = [(f, last) for f, last in self._after_gap if last > base_iteration]
            self._absorb()

    def _absorb(self) -> None:
        """Extend the chain by the segments that now follow it (the caller holds the lock)."""
        self._after_gap.sort()
        while self._after_gap and self._after_gap[0][0] <= self._durable + 1:
            self._durable = max(self._durable, self._after_gap.pop(0)[1])
        self._durable_moved.notify_all()

    def close(self) -> None:
        """Flush and stop the background thread. Idempotent."""
        if not self._worker.alive:
            return
        try:
            self.flush()
        finally:
            self._worker.stop()
            self._publisher.close()
            for staged in self._spare:
                staged.close()
            self._spare.clear()

    # -- internals ---------------------------------------------------------------------------

    def _submit(self, force_block: bool = False) -> None:
        batch, self._batch = self._batch, _Batch()
        if self.when_full == "skip" and not force_block:
            if not self._worker.put(batch, block=False):
                self._give_back(batch)
                self.stats.skipped_records += len(batch)
                logger.warning(
                    "diff log %s: storage fell behind, iterations %d-%d were NOT written; "
                    "durability stays at iteration %d until the next base",
                    self.identity.dirname(),
                    batch.first,
                    batch.last,
                    self.durable_iteration,
                )
            return
        start = time.perf_counter()
        self._worker.put(batch)
        waited = time.perf_counter() - start
        self.stats.blocked_seconds += waited
        if waited >= self.SLOW_AFTER_S and not self._slow_warned and not force_block:
            self._slow_warned = True
            self._warn_slow(waited, len(batch))

    def _warn_slow(self, waited: float, records: int) -> None:
        """Once: the thread that hands records over (the training thread for LowDiff, the
        merger for LowDiff+, which then holds its snapshot slots longer) waited for the writer
        (storage slower than the log's bytes)."""
        stats = self.stats
        per_record = stats.bytes_written / stats.records if stats.records else 0.0
        rate = stats.bytes_written / stats.write_seconds if stats.write_seconds else 0.0
        thread = threading.current_thread()
        who = "training" if thread is threading.main_thread() else f"thread {thread.name}"
        logger.warning(
            "diff log %s cannot keep up with storage: %s waited %.0f ms to hand over %d "
            "record(s) (%.1f MB per record, written at %.0f MB/s; %d segments may wait); "
            "%s (this warning is not repeated; the writer's backlog is in the metrics)",
            self.identity.dirname(),
            who,
            waited * 1000.0,
            records,
            per_record / 1e6,
            rate / 1e6,
            self.backlog,
            self.slow_hint,
        )

    def _raise_background_error(self) -> None:
        error = self._worker.error
        if isinstance(error, StorageFullError):
            raise StorageFullError(
                f"{error}; the last durable iteration is {self.durable_iteration}: free space and "
                "restart with --load, or run with --diffckpt-when-full skip"
            ) from error.__cause__
        if error is not None:
            raise RuntimeError(
                f"diff log writer of {self.identity.dirname()} failed; the last durable iteration "
                f"is {self.durable_iteration}"
            ) from self._worker.error

    def _give_back(self, batch: _Batch) -> None:
        """``batch`` is written or dropped: its staging buffer serves a later one."""
        if batch.staged is not None:
            self._spare.append(batch.staged)
            batch.staged = None

    def _storage_full(self, batch: _Batch, exc: OSError) -> None:
        """A segment did not fit: stop (block) or drop it with one warning per incident."""
        what = f"{self.dir}: {os.strerror(exc.errno)}"
        if self.when_full != "skip":
            raise StorageFullError(f"the diff log cannot be written, {what}") from exc
        self.stats.skipped_records += len(batch)
        if self._full_since is None:
            self._full_since = batch.first
            logger.warning(
                "diff log %s: storage is full (%s): iterations from %d on are NOT written until "
                "it has space again; durability stays at iteration %d until then and the next "
                "base (--diffckpt-when-full skip)",
                self.identity.dirname(),
                what,
                batch.first,
                self.durable_iteration,
            )

    def _check_owner(self) -> None:
        try:
            with open(os.path.join(self.dir, OWNER_FILE), "rb") as f:
                token = f.read().decode(errors="replace")
        except OSError:
            token = "<none>"
        if token != self._token:
            raise DiffLogOwnershipError(
                f"{self.dir} is held by a newer incarnation of this rank; this process no longer "
                "writes to it"
            )

    def _failed(self, exc: BaseException) -> None:  # the worker thread; the next call raises it
        if not isinstance(exc, StorageFullError):  # raised in its own line, with what to do
            logger.error("diff log writer of %s failed: %s", self.identity.dirname(), exc)

    def _write(self, batch: _Batch) -> None:
        cpu = time.thread_time()
        try:
            self._write_segment(batch)
        finally:
            self.stats.cpu_seconds += time.thread_time() - cpu
            self._give_back(batch)

    def _write_segment(self, batch: _Batch) -> None:
        start = time.perf_counter()
        first, last = batch.first, batch.last
        header = SegmentHeader(self.identity, self.compressor, first, last, len(batch))
        final = os.path.join(self.dir, segment_filename(first, last))
        self._check_owner()
        timed: list[float] = []

        def written():
            timed.append(time.perf_counter() - start)
            failpoints.reach("segment-write")  # written, neither fsynced nor published

        try:
            if batch.staged is not None:
                batch.staged.overwrite(0, encode_file_header(header, STAGED_HEADER_BYTES))
                self._publisher.publish_staged(final, batch.staged, written)
                n = batch.staged.tell()
            else:
                records = batch.records
                n = self._publisher.publish(final, lambda f: write_segment(f, header, records),
                                            written)  # fmt: skip
        except OSError as exc:
            if exc.errno not in FULL_ERRNOS:
                raise
            self._storage_full(batch, exc)
            return
        if self._full_since is not None:
            logger.warning(
                "diff log %s: storage has space again at iteration %d (iterations %d-%d were not "
                "written; durability resumes with the next base)",
                self.identity.dirname(),
                first,
                self._full_since,
                first - 1,
            )
            self._full_since = None
        total = time.perf_counter() - start
        with self._lock:
            self._after_gap.append((first, last))
            self._absorb()
            self._samples.append(SegmentSample(len(batch), n, timed[0], total - timed[0]))
        self.stats.segments += 1
        self.stats.records += len(batch)
        self.stats.bytes_written += n
        self.stats.write_seconds += total
