"""LowDiff+ bucket snapshots: each reduced gradient shard copied to host memory once it exists.

During the backward pass megatron DDP reduces the gradients bucket by bucket. When a bucket's
reduction has been started, :meth:`BucketSnapshotter.on_bucket_ready` is told about this rank's
shard of it (the source tensor) and the reduction's handle; the snapshotter copies the shard into
a host buffer once the reduction completes, off the training thread:

- on CPU, a background worker thread waits on the handle and copies (``Tensor.copy_`` and
  ``Work.wait`` release the GIL, so the copy overlaps the rest of the backward pass);
- on GPU, a side stream waits on the reduction and copies into pinned memory; an event marks the
  end of the copy, and the consumer synchronizes on it before reading.

With pipeline parallelism the copies are *deferred to bubbles*: a copy that becomes possible while
the stage computes is queued and issued when the stage next waits on a pipeline peer
(:meth:`bubble` wraps that wait); what is still queued at the flush point is issued there. A
:class:`StageTrace` records, per iteration, the stage's wait and copy intervals and how much of the
copy time fell inside waits.

Host buffers come in ``slots`` sets (double buffering by default): an iteration's copies go into a
free slot, the slot goes to the consumer (the replica merger) at the end of the iteration, and is
reused only after the consumer :meth:`release`\\ s it. When no slot is free, the training thread
waits, and the wait is logged.

Ordering rule (the training loop's side, one thread): ``on_bucket_ready`` for each bucket during
the backward pass; :meth:`flush` before anything modifies the gradients in place (gradient
clipping, the optimizer step, the next iteration's zeroing); :meth:`finish_iteration` hands the
slot over. Nothing here imports megatron.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_diffckpt.background import CpuMeter

logger = logging.getLogger(__name__)


@dataclass
class SnapshotSlot:
    """One set of host buffers, holding one iteration's reduced gradient shards."""

    index: int
    buffers: dict[str, torch.Tensor]
    iteration: int | None = None
    filled: set[str] = field(default_factory=set)
    refreshed: bool = False  # the ranges changed after reduction were copied (once, at flush)
    events: list[Any] = field(default_factory=list)  # CUDA events of the copies in flight

    def wait_ready(self) -> None:
        """Block until every copy into this slot has landed. The consumer's thread."""
        for event in self.events:
            event.synchronize()
        self.events.clear()


@dataclass
class StageTrace:
    """Wait and copy intervals of one iteration on this stage (seconds, ``perf_counter``)."""

    iteration: int
    start: float
    end: float = 0.0
    waits: list[tuple[float, float]] = field(default_factory=list)
    copies: list[tuple[float, float, bool]] = field(default_factory=list)  # (start, end, in bubble)

    @property
    def copy_seconds(self) -> float:
        return sum(end - start for start, end, _ in self.copies)

    @property
    def copy_seconds_in_bubbles(self) -> float:
        """Copy time that overlapped a wait on a pipeline peer."""
        total = 0.0
        for c_start, c_end, _ in self.copies:
            for w_start, w_end in self.waits:
                total += max(0.0, min(c_end, w_end) - max(c_start, w_start))
        return total

    def as_dict(self) -> dict[str, Any]:
        wait = sum(end - start for start, end in self.waits)
        return {
            "iteration": self.iteration,
            "seconds": self.end - self.start,
            "compute_seconds": max(0.0, self.end - self.start - wait),
            "wait_seconds": wait,
            "copy_seconds": self.copy_seconds,
            "copy_seconds_in_bubbles": self.copy_seconds_in_bubbles,
            "copies_issued_in_bubbles": sum(1 for *_, b in self.copies if b),
            "copies": len(self.copies),
            "waits": [[s - self.start, e - self.start] for s, e in self.waits],
            "copy_intervals": [[s - self.start, e - self.start, b] for s, e, b in self.copies],
        }


@dataclass
class _CopyJob:
    key: str
    source: torch.Tensor
    handle: Any  # the reduction's work handle (``wait()``), or None when it completed already


class BucketSnapshotter:
    """Copies this rank's reduced gradient shards to host buffers, off the training thread.

    Args:
        shards: bucket key -> ``(numel, dtype)`` of this rank's shard of that bucket.
        slots: sets of host buffers (2 = double buffering); bounds host memory and the backlog.
        device: ``"cpu"`` or ``"cuda"``: where the gradients live.
        defer_to_bubbles: queue copies until the stage waits on a pipeline peer (PP > 1).
        trace_iterations: how many iterations of :class:`StageTrace` to keep.
        cpu: where the copy thread's CPU time goes (activity ``"snapshot copy"``; CPU only: on
            GPU the copies are the device's).
        buffer: ``(slot, bucket key, numel, dtype) -> tensor``: where the host buffers live
            (default: process memory, pinned on GPU; the keeper's replica maps them into
            shared memory, :mod:`~megatron_diffckpt.keeper.replicas`).
    """

    def __init__(
        self,
        shards: dict[str, tuple[int, torch.dtype]],
        slots: int = 2,
        device: str = "cpu",
        defer_to_bubbles: bool = False,
        trace_iterations: int = 64,
        cpu: CpuMeter | None = None,
        buffer: Callable[[int, str, int, torch.dtype], torch.Tensor] | None = None,
    ):
        if slots < 1:
            raise ValueError(f"need at least one snapshot slot, got {slots}")
        self.device = device
        self.defer_to_bubbles = defer_to_bubbles
        self.cpu = cpu if cpu is not None else CpuMeter()
        pin = device == "cuda"
        if buffer is None:

            def buffer(_slot: int, _key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
                return torch.empty(numel, dtype=dtype, pin_memory=pin)

        self._slots = [
            SnapshotSlot(
                i, {key: buffer(i, key, numel, dtype) for key, (numel, dtype) in shards.items()}
            )
            for i in range(slots)
        ]
        self.nbytes = sum(b.numel() * b.element_size() for b in self._slots[0].buffers.values())
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(slots):
            self._free.put(i)
        self._current: SnapshotSlot | None = None
        self._queued: list[_CopyJob] = []
        self._in_flight: list[Future] = []
        self._in_bubble = False
        self._lock = threading.Lock()  # guards trace appends from the worker
        if device == "cuda":
            self._stream = torch.cuda.Stream()
            self._worker = None
        else:
            self._stream = None
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="diffckpt-snapshot")
        self.traces: deque[StageTrace] = deque(maxlen=trace_iterations)
        self._trace: StageTrace | None = None
        self.refresh_at_flush: list[tuple[str, int, int, torch.Tensor]] = []
        """``(bucket, start, end, source)``: ranges copied again at :meth:`flush`, from their
        final values (gradients changed after their bucket's reduction)."""
        self.slot_wait_seconds = 0.0
        """Time the training thread waited for a free slot (the merger's backlog), cumulative."""
        self.before_iteration: Callable[[], None] | None = None
        """Called on the training thread before an iteration's slot is taken, at its first
        bucket (:meth:`before_reduction`, else :meth:`on_bucket_ready`): the keeper's merger
        waits there for the previous iteration's hand-over
        (:meth:`~megatron_diffckpt.keeper.replica_client.KeeperReplicaMerger.attach`). Its time
        counts in :attr:`slot_wait_seconds`."""
        self.max_wait_s: float | None = None
        """How long the training thread may wait for a free slot; past it the snapshotter
        pauses (:attr:`paused`) instead, or calls :attr:`on_full` when that is set. ``None``:
        as long as it takes."""
        self.on_full: Callable[[], None] | None = None
        """Called on the training thread, instead of pausing, when no slot came within
        :attr:`max_wait_s`: the consumer is told to let its backlog go (the in-rank merger
        skips merging until the next base, its log thread still reads every slot), and the
        snapshotter then waits for a slot as long as it takes."""
        self.paused = False
        """No slot is taken and nothing copied until :meth:`resume`: the iteration whose
        first bucket found no slot within :attr:`max_wait_s`, and those after it."""
        self._path_seconds = 0.0
        self._waited_before = 0.0
        self.iteration_slot_wait_seconds = 0.0
        """The part of :attr:`slot_wait_seconds` in the last finished iteration: training
        waiting for the merger."""
        self.iteration_path_seconds = 0.0
        """Training-thread time spent here in the last finished iteration: issuing copies,
        waiting for a slot, flushing (waits inside :meth:`bubble` are the peer's, not counted)."""

    @property
    def slots(self) -> int:
        """How many sets of host buffers there are."""
        return len(self._slots)

    # ----------------------------------------------------------------- training thread
    def before_reduction(self) -> None:
        """A bucket group's reduction is about to be issued: the iteration's first takes its
        slot now, so that :attr:`before_iteration` runs before this rank's first collective
        of the iteration."""
        start = time.perf_counter()
        self._slot()
        self._path_seconds += time.perf_counter() - start

    def resume(self) -> None:
        """Take slots and copy again, from the next iteration on. The training thread."""
        self.paused = False

    def on_bucket_ready(self, key: str, source: torch.Tensor, handle: Any = None) -> None:
        """The reduction of bucket ``key`` was started (``handle``) or is done (``None``).

        ``source`` is this rank's shard of the bucket: it holds the reduced gradient once the
        reduction completes, and must not change until :meth:`flush` returns.
        """
        start = time.perf_counter()
        slot = self._slot()
        if slot is None:  # paused: nothing of this iteration is copied
            self._path_seconds += time.perf_counter() - start
            return
        if key not in slot.buffers:
            raise KeyError(f"unknown bucket {key!r}; known: {sorted(slot.buffers)[:8]}")
        job = _CopyJob(key, source, handle)
        if self.defer_to_bubbles and not self._in_bubble:
            self._queued.append(job)
        else:
            self._issue(job, self._in_bubble)
        self._path_seconds += time.perf_counter() - start

    @contextmanager
    def bubble(self) -> Iterator[None]:
        """Wrap a wait on a pipeline peer: queued copies are issued at its start and run while
        the stage waits. The wait's interval goes into the trace."""
        trace = self._ensure_trace()
        start = time.perf_counter()
        self._in_bubble = True
        queued, self._queued = self._queued, []
        for job in queued:
            self._issue(job, True)
        try:
            yield
        finally:
            end = time.perf_counter()
            self._in_bubble = False
            with self._lock:
                trace.waits.append((start, end))

    def flush(self) -> None:
        """Issue what is queued and make every copy of this iteration complete before the
        gradients change: CPU, wait for the worker; GPU, order the current stream after the
        copies. Idempotent."""
        start = time.perf_counter()
        try:
            self._flush()
        finally:
            self._path_seconds += time.perf_counter() - start

    def _flush(self) -> None:
        queued, self._queued = self._queued, []
        for job in queued:
            self._issue(job, False)
        in_flight, self._in_flight = self._in_flight, []
        for future in in_flight:
            future.result()
        slot = self._current
        if slot is None:
            return
        if self._stream is not None and slot.events:
            torch.cuda.current_stream().wait_event(slot.events[-1])
        # Gradients megatron changed after their bucket's reduction: copy their final values.
        if slot.refreshed:
            return
        slot.refreshed = True
        refresh = [r for r in self.refresh_at_flush if r[0] in slot.filled]
        for key, start, end, source in refresh:
            slot.buffers[key][start:end].copy_(source, non_blocking=self._stream is not None)
        if refresh and self._stream is not None:
            event = torch.cuda.Event()
            event.record()
            slot.events.append(event)

    def finish_iteration(self, iteration: int) -> SnapshotSlot | None:
        """Close ``iteration``: the slot that holds its shards (``None`` if no bucket was ready).
        The consumer calls :meth:`SnapshotSlot.wait_ready`, reads, then :meth:`release`."""
        self.flush()
        self.iteration_path_seconds, self._path_seconds = self._path_seconds, 0.0
        self.iteration_slot_wait_seconds = self.slot_wait_seconds - self._waited_before
        self._waited_before = self.slot_wait_seconds
        slot, self._current = self._current, None
        if self._trace is not None:
            self._trace.iteration = iteration
            self._trace.end = time.perf_counter()
            self.traces.append(self._trace)
            self._trace = None
        if slot is not None:
            slot.iteration = iteration
        return slot

    # ----------------------------------------------------------------- consumer thread
    def release(self, slot: SnapshotSlot) -> None:
        """The consumer is done with ``slot``: it may be refilled. Any thread."""
        slot.filled.clear()
        slot.refreshed = False
        slot.iteration = None
        self._free.put(slot.index)

    def close(self) -> None:
        self.flush()
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    # ----------------------------------------------------------------- internals
    def _ensure_trace(self) -> StageTrace:
        if self._trace is None:
            self._trace = StageTrace(iteration=-1, start=time.perf_counter())
        return self._trace

    def _slot(self) -> SnapshotSlot | None:
        self._ensure_trace()
        if self.paused:
            return None
        if self._current is None:
            if self.before_iteration is not None:
                start = time.perf_counter()
                self.before_iteration()  # may pause, past max_wait_s
                self.slot_wait_seconds += time.perf_counter() - start
                if self.paused:
                    return None
            try:
                index = self._free.get_nowait()
            except queue.Empty:
                start = time.perf_counter()
                try:
                    index = self._free.get(timeout=self.max_wait_s)
                except queue.Empty:  # the merger is too far behind
                    if self.on_full is None:  # pause, do not wait on
                        self.slot_wait_seconds += time.perf_counter() - start
                        self.paused = True
                        return None
                    self.on_full()  # the merger lets its backlog go: slots come back soon
                    index = self._free.get()
                waited = time.perf_counter() - start
                self.slot_wait_seconds += waited
                logger.warning(
                    "LowDiff+ backlog full (%d snapshot slots held by the merger): training "
                    "waited %.1f ms for a free slot",
                    len(self._slots),
                    waited * 1000.0,
                )
            self._current = self._slots[index]
        return self._current

    def _issue(self, job: _CopyJob, in_bubble: bool) -> None:
        slot = self._current
        dst = slot.buffers[job.key]
        if job.source.numel() != dst.numel():
            raise ValueError(
                f"bucket {job.key}: shard has {job.source.numel()} elements, the snapshot "
                f"buffer {dst.numel()}"
            )
        slot.filled.add(job.key)
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                start = time.perf_counter()
                if job.handle is not None:
                    job.handle.wait()  # NCCL: the side stream waits on the collective
                dst.copy_(job.source.reshape(-1), non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            job.source.record_stream(self._stream)
            slot.events.append(event)
            with self._lock:
                self._trace.copies.append((start, time.perf_counter(), in_bubble))
            return
        trace = self._trace
        self._in_flight.append(self._worker.submit(self._copy, job, dst, trace, in_bubble))

    def _copy(self, job: _CopyJob, dst: torch.Tensor, trace: StageTrace, in_bubble: bool) -> None:
        if job.handle is not None:
            job.handle.wait()
        start = time.perf_counter()
        with torch.no_grad(), self.cpu.measure("snapshot copy"):
            dst.copy_(job.source.reshape(-1))
        with self._lock:
            trace.copies.append((start, time.perf_counter(), in_bubble))


def summarize_traces(traces: list[StageTrace]) -> dict[str, float]:
    """Totals over ``traces``: copy time, the part inside bubbles, and its share."""
    copy = sum(t.copy_seconds for t in traces)
    inside = sum(t.copy_seconds_in_bubbles for t in traces)
    return {
        "iterations": len(traces),
        "copy_seconds": copy,
        "copy_seconds_in_bubbles": inside,
        "share_in_bubbles": inside / copy if copy > 0 else 0.0,
        "wait_seconds": sum(sum(e - s for s, e in t.waits) for t in traces),
    }
