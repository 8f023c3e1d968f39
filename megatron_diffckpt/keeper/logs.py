"""LowDiff's diff log written by the node's keeper: each record leaves the rank once.

Under a keeper every LowDiff record is handed to it (:meth:`~megatron_diffckpt.keeper.client.
KeeperClient.put`, already in the diff log's encoding) before the rank's own writer serialises
it again, checksums it, writes and syncs it. With ``--diffckpt-option keeper_writes_log`` the keeper
writes the segments from the bytes it was handed (:class:`~megatron_diffckpt.storage.format.
EncodedRecord`: no decoding, no second serialisation or checksum), with the rank's settings
(batch size, backlog, full-storage policy, direct I/O), and the rank's writer only hands over:

1. **Open.** The rank's :class:`KeeperLogWriter` asks the keeper to open its log
   (``log_open``: the settings, the chain's start); the keeper's writer
   (:func:`open_log`) takes the rank's folder over, as any new writer does
   (:data:`~megatron_diffckpt.storage.writer.OWNER_FILE`), and names the log.
2. **Hand-over.** A ``put`` naming the log is held (memory, for recovery) and appended to the
   keeper's writer before the reply, which says how far storage holds the chain (the
   writer's durable iteration, backlog, counters and segment timings): the rank's metrics,
   its auto-tuner and its slow-storage warning read those as they read its own writer's.
   A full backlog makes the reply wait, as a full backlog makes the rank's own writer wait.
3. **Nothing lost.** Until the keeper reports a record durable, the rank keeps it (at most
   ``(max_pending + 2) * batch_size`` records, as its own writer's backlog would). When the
   keeper is lost, or its writer fails, the rank takes its folder back, cuts the log at the
   durable iteration and writes those records and every later one itself (said once); storage
   full stops training as the rank's own writer would
   (:class:`~megatron_diffckpt.out_of_space.StorageFullError`). When the rank dies, the keeper
   writes what it holds of its log at once (the connection's end); when the keeper stops, it
   writes every log it holds.
4. **One incarnation.** A log opened again for the same rank (a restart) replaces the older
   one, which is written out first and then cut at the new chain's start; a ``put`` naming the
   older log is refused, and its rank stops as a superseded writer does
   (:class:`~megatron_diffckpt.storage.writer.DiffLogOwnershipError`).

This module holds both sides: :class:`KeeperLogs` (the keeper's, one lock per rank) and
:class:`KeeperLogWriter` (the rank's, the training thread), and :func:`open_log`, the
keeper's writer of a rank's log, which LowDiff+'s replica in the keeper shares
(:class:`~megatron_diffckpt.keeper.hosted_replica.ReplicaLog`).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections import deque
from dataclasses import asdict, astuple, dataclass, field
from typing import Any

from megatron_diffckpt.durable_io import publish_file
from megatron_diffckpt.keeper.protocol import Op
from megatron_diffckpt.out_of_space import StorageFullError
from megatron_diffckpt.recovery import truncate_log
from megatron_diffckpt.storage.format import (
    DiffLogFormatError,
    DiffRecord,
    EncodedRecord,
    SegmentIdentity,
)
from megatron_diffckpt.storage.writer import (
    OWNER_FILE,
    DiffLogOwnershipError,
    DiffLogWriter,
    SegmentSample,
    WriterStats,
)

logger = logging.getLogger(__name__)

SPEC_FIELDS = ("root", "compressor", "batch_size", "max_pending", "when_full", "direct_io",
               "slow_hint")  # fmt: skip
"""What a keeper's writer of a rank's log is opened with (``durable`` optional)."""


_SUPERSEDED = {"logged": False, "superseded": "a newer incarnation of this rank opened its log"}


def open_log(
    spec: dict[str, Any],
    iteration: int,
    identity: dict[str, Any],
    serialise_at_append: bool = False,
) -> DiffLogWriter:
    """A writer, in the keeper, of the diff log of ``identity``'s chain from ``iteration``:
    nothing after ``iteration`` is left in storage's log (an older attempt's records there are
    cut off), and the writer takes the rank's folder over. ``spec``: :data:`SPEC_FIELDS`, and
    ``durable``, the newest iteration storage holds of the chain when that is older than
    ``iteration`` (``None``: ``iteration`` itself). ``serialise_at_append``: the writer's."""
    missing = [f for f in SPEC_FIELDS if f not in spec]
    if missing:
        raise ValueError(f"a diff log opened without {', '.join(missing)}")
    who = SegmentIdentity(**identity)
    rank_dir = os.path.join(spec["root"], who.dirname())
    if os.path.isdir(rank_dir):
        truncate_log(rank_dir, None, iteration)
    return DiffLogWriter(
        spec["root"],
        who,
        spec["compressor"],
        batch_size=int(spec["batch_size"]),
        max_pending=int(spec["max_pending"]),
        when_full=spec["when_full"],
        chain_start=iteration,
        slow_hint=spec["slow_hint"],
        direct_io=bool(spec["direct_io"]),
        durable_from=spec.get("durable"),
        serialise_at_append=serialise_at_append,
    )


def status(writer: DiffLogWriter) -> dict[str, Any]:
    """What a reply tells the rank of its log: how far storage holds it, the writer's backlog,
    its counters, and the segments published since the previous reply."""
    return {
        "logged": True,
        "durable": writer.durable_iteration,
        "backlog": writer.backlog,
        "stats": asdict(writer.stats),
        "samples": [astuple(s) for s in writer.take_samples()],
    }


def _failure(exc: BaseException) -> dict[str, Any]:
    """A reply for a writer that failed: storage full, a newer incarnation, or else."""
    causes = (exc, exc.__cause__)
    if any(isinstance(c, StorageFullError) for c in causes):
        return {"logged": False, "full": str(exc)}
    if any(isinstance(c, DiffLogOwnershipError) for c in causes):
        return {"logged": False, "superseded": str(exc.__cause__ or exc)}
    cause = exc.__cause__ or exc
    return {"logged": False, "why": f"{type(cause).__name__}: {cause}"}


@dataclass
class _Log:
    name: str
    writer: DiffLogWriter
    owner: object
    """The connection that opened it: its end (the rank's) writes the log out."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    """Written out and closed (under ``lock``): a request that waited for it is refused."""


class KeeperLogs:
    """The diff logs this keeper writes, one per rank (identity key). The keeper's connection
    threads: a rank's requests come on its connection, in order."""

    def __init__(self) -> None:
        self._logs: dict[tuple, _Log] = {}
        self._lock = threading.Lock()

    def handle(self, op: str, key: tuple, req: dict, owner: object) -> dict[str, Any]:
        """``log_open`` (``spec``, ``iteration``), ``log_flush`` (``log``), ``log_close``
        (``log``; without it, whichever log the rank has: a restarted rank's before it cuts its
        folder)."""
        if op == Op.LOG_OPEN:
            return self._open(key, req, owner)
        if op == Op.LOG_CLOSE and "log" not in req:
            self._end(key, None)
            return {"ok": True}
        log = self._named(key, req)
        if log is None:
            return dict(_SUPERSEDED)
        if op == Op.LOG_FLUSH:
            with log.lock:
                if log.closed:
                    return dict(_SUPERSEDED)
                try:
                    log.writer.flush()
                    return status(log.writer)
                except Exception as exc:  # noqa: BLE001 - the rank takes its log back
                    self._drop(key, log)
                    return _failure(exc)
        if op == Op.LOG_CLOSE:
            ended = self._end(key, log)
            return ended or {"logged": False, "why": "the keeper could not write it out"}
        return {"error": f"unknown request {op!r}"}

    def append(self, key: tuple, req: dict, record: bytes | bytearray) -> dict[str, Any]:
        """A ``put`` naming a log: ``record`` appended to it (``req["batch"]``: the rank's
        batch size now); its :func:`status`, or why not."""
        log = self._named(key, req)
        if log is None:
            return dict(_SUPERSEDED)
        with log.lock:
            if log.closed:
                return dict(_SUPERSEDED)
            try:
                encoded = EncodedRecord.of(int(req["iteration"]), record)
                log.writer.batch_size = max(1, int(req.get("batch", log.writer.batch_size)))
                log.writer.append(encoded)
                return status(log.writer)
            except (DiffLogFormatError, ValueError) as exc:
                self._drop(key, log)
                return {"logged": False, "why": str(exc)}
            except Exception as exc:  # noqa: BLE001 - the rank takes its log back
                self._drop(key, log)
                return _failure(exc)

    def rebase(self, key: tuple, base: int) -> None:
        """A base of ``base`` is published for the rank."""
        log = self._logs.get(key)
        if log is not None:
            with log.lock:
                log.writer.rebase(base)

    def detach(self, owner: object) -> None:
        """``owner``'s connection ended (its rank finished or died): its logs are written out
        now and closed."""
        with self._lock:
            keys = [k for k, log in self._logs.items() if log.owner is owner]
        for key in keys:
            self._end(key, None, owner)

    def close(self) -> None:
        """Write every log out (the keeper stops)."""
        for key in list(self._logs):
            self._end(key, None)

    def stats(self) -> list[dict[str, Any]]:
        rows = []
        with self._lock:
            logs = sorted(self._logs.items())
        for key, log in logs:
            w = log.writer
            rows.append(
                {
                    **dict(key),
                    "durable": w.durable_iteration,
                    "next": w.next_iteration,
                    "segments": w.stats.segments,
                    "bytes_written": w.stats.bytes_written,
                    "cpu_s": w.stats.cpu_seconds,
                }
            )
        return rows

    # -- internals ---------------------------------------------------------------------------

    def _open(self, key: tuple, req: dict, owner: object) -> dict[str, Any]:
        self._end(key, None)  # an older incarnation's: written out, then cut below
        try:
            writer = open_log(req["spec"], int(req["iteration"]), dict(key))
        except Exception as exc:  # noqa: BLE001 - the rank writes its log itself
            return {"error": f"{type(exc).__name__}: {exc}"}
        log = _Log(uuid.uuid4().hex, writer, owner)
        with self._lock:
            self._logs[key] = log
        logger.info(
            "keeper: writes the diff log of %s from iteration %d",
            writer.identity.dirname(),
            int(req["iteration"]) + 1,
        )
        return {"log": log.name}

    def _named(self, key: tuple, req: dict) -> _Log | None:
        log = self._logs.get(key)
        return log if log is not None and log.name == req.get("log") else None

    def _end(
        self, key: tuple, log: _Log | None, owner: object | None = None
    ) -> dict[str, Any] | None:
        """Write ``log`` (default: the rank's current one, if ``owner``'s) out and close it;
        its final :func:`status`, or ``None`` when there was none or it failed. The log stays
        in the table until it is written out: a request for it meanwhile waits for that."""
        with self._lock:
            current = self._logs.get(key)
            if current is None or (log is not None and current is not log):
                return None
            if owner is not None and current.owner is not owner:
                return None
        with current.lock:
            current.closed = True
            try:
                current.writer.close()
                ended = status(current.writer)
            except Exception as exc:  # noqa: BLE001 - said here; its rank is gone or takes over
                logger.warning(
                    "keeper: the diff log of %s could not be written out: %s",
                    current.writer.identity.dirname(),
                    exc,
                )
                ended = None
        with self._lock:
            if self._logs.get(key) is current:
                del self._logs[key]
        return ended

    def _drop(self, key: tuple, log: _Log) -> None:
        """``log``'s writer failed (the caller holds its lock): stop it; its rank takes over."""
        log.closed = True
        with self._lock:
            if self._logs.get(key) is log:
                del self._logs[key]
        try:
            log.writer.close()
        except Exception:  # noqa: BLE001 - the failure is the reply's
            pass


class KeeperLogWriter(DiffLogWriter):
    """The rank's diff-log writer when the node's keeper writes the log
    (``--diffckpt-option keeper_writes_log``): the same interface and guarantees as
    :class:`~megatron_diffckpt.storage.writer.DiffLogWriter` (whose arguments it takes; its
    ``sink`` must be the node's keeper), with the writing done in the keeper. Until the keeper
    reports a record durable, the rank keeps it; when the keeper cannot write (lost, or its
    writer failed), the rank writes from its newest durable iteration on itself
    (:meth:`in_keeper` turns false).
    The training thread."""

    def __init__(self, root: str, identity: SegmentIdentity, compressor: str, batch_size: int,
                 **kwargs: Any):  # fmt: skip
        keeper = kwargs.get("sink")
        if keeper is None:
            raise ValueError("a diff log written by the node's keeper needs the keeper")
        self.keeper = keeper
        # a predecessor's log in the keeper: written out while it still holds the folder
        keeper.call({"op": Op.LOG_CLOSE})
        super().__init__(root, identity, compressor, batch_size, **kwargs)
        self._log: str | None = None
        self._held: deque[DiffRecord] = deque()  # handed over, not yet durable in storage
        self._bound = (self.max_pending + 2) * batch_size
        self._keeper_backlog = 0
        self._skipped_at: int | None = None  # durable when the keeper's skipping was said
        spec = {
            "root": os.path.abspath(root),
            "compressor": compressor,
            "batch_size": batch_size,
            "max_pending": self.max_pending,
            "when_full": self.when_full,
            "direct_io": self.direct_io,
            "slow_hint": self.slow_hint,
        }
        opening = {"op": Op.LOG_OPEN, "spec": spec, "iteration": self.next_iteration - 1}
        reply = self.keeper.call(opening)
        if reply is not None and reply[0].get("log"):
            self._log = reply[0]["log"]
        else:
            why = "the keeper is lost" if reply is None else reply[0].get("error", "refused")
            logger.warning("diff log %s: this rank writes it itself (%s)", identity.dirname(), why)

    @property
    def in_keeper(self) -> bool:
        """Whether the keeper writes this log (else this rank does)."""
        return self._log is not None

    def append(self, record: DiffRecord) -> None:
        if self._log is None:
            super().append(record)
            return
        self._advance(record.iteration)
        reply = self.keeper.hand(record, {"log": self._log, "batch": self.batch_size})
        if reply is not None and reply.get("logged"):
            self._held.append(record)
            self._update(reply)
            return
        self._take_over(reply, record.iteration)
        self._add(record)

    @property
    def backlog(self) -> int:
        return self._keeper_backlog if self._log is not None else super().backlog

    def flush(self) -> int:
        if self._log is not None:
            reply = self.keeper.call({"op": Op.LOG_FLUSH, "log": self._log})
            if reply is not None and reply[0].get("logged"):
                self._update(reply[0])
                return self.durable_iteration
            self._take_over(None if reply is None else reply[0], self.next_iteration)
        return super().flush()

    def close(self) -> None:
        if self._log is not None:
            reply = self.keeper.call({"op": Op.LOG_CLOSE, "log": self._log})
            if reply is not None and reply[0].get("logged"):
                self._update(reply[0])
                self._log = None
                self._held.clear()
            else:
                self._take_over(None if reply is None else reply[0], self.next_iteration)
        super().close()

    # -- internals ---------------------------------------------------------------------------

    def _update(self, reply: dict[str, Any]) -> None:
        """What the keeper's writer reports: durability, backlog, counters, segments."""
        with self._lock:
            self._durable = max(self._durable, int(reply["durable"]))
            durable = self._durable
            self._samples.extend(SegmentSample(*s) for s in reply["samples"])
        while self._held and self._held[0].iteration <= durable:
            self._held.popleft()
        while len(self._held) > self._bound:  # storage behind a gap (skip): the next base
            self._held.popleft()
        self._keeper_backlog = int(reply["backlog"])
        blocked = reply["stats"]["blocked_seconds"] - self.stats.blocked_seconds
        skipped = reply["stats"]["skipped_records"] - self.stats.skipped_records
        self.stats = WriterStats(**reply["stats"])
        if blocked >= self.SLOW_AFTER_S and not self._slow_warned:
            self._slow_warned = True
            self._warn_slow(blocked, self.batch_size)
        if self._skipped_at is not None and durable > self._skipped_at:
            self._skipped_at = None  # storage took records again: a new incident is said anew
        if skipped > 0 and self._skipped_at is None:  # when-full skip: said here too, once
            self._skipped_at = durable
            logger.warning(
                "diff log %s: the node's keeper could not write %d record(s) (storage full or "
                "behind, --diffckpt-when-full skip; see the keeper's log); durability stays at "
                "iteration %d until storage takes records again and the next base",
                self.identity.dirname(),
                skipped,
                durable,
            )

    def _take_over(self, reply: dict[str, Any] | None, upcoming: int) -> None:
        """The keeper does not write this log any more: storage full and a newer incarnation
        stop this rank as they would stop its own writer; else the rank takes its folder back
        and writes, from the newest durable iteration on, what it kept and what follows
        (``upcoming``: the iteration this rank writes next after those it kept)."""
        self._log = None
        if reply is not None and "full" in reply:
            raise StorageFullError(reply["full"])  # the keeper's writer's words
        if reply is not None and "superseded" in reply:
            raise DiffLogOwnershipError(f"{self.dir}: {reply['superseded']}")
        why = "the keeper is lost" if reply is None else reply.get("why", "it stopped")
        durable = self.durable_iteration
        self._token = uuid.uuid4().hex
        publish_file(os.path.join(self.dir, OWNER_FILE), lambda f: f.write(self._token.encode()))
        truncate_log(self.dir, None, durable)
        kept = [r for r in self._held if r.iteration > durable]
        self._held.clear()
        first = kept[0].iteration if kept else upcoming
        logger.warning(
            "diff log %s: the node's keeper stopped writing it (%s); this rank writes it from "
            "iteration %d on%s",
            self.identity.dirname(),
            why,
            durable + 1,
            ""
            if first <= durable + 1
            else f" (iterations {durable + 1}-{first - 1} were in the keeper's hands only: "
            "durability resumes with the next base)",
        )
        for record in kept:
            self._add(record)
