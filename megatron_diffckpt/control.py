"""The job's control plane: the library's collectives with a timeout that names who did not
arrive, agreed outcomes of a rank's work, and a fault board that stops every rank in one line.

A rank-local failure (its checkpoint writer's helper process killed, its node-local disk full,
a permission error on one node) must not leave the others waiting forever in a collective the
failed rank will never reach (design invariant 8). Three mechanisms, over torch.distributed's
own key-value store (which every rank of the default process group reaches, whatever the
collectives are doing):

- **The fault board.** A rank that cannot go on posts one line, ``rank R: what: cause``
  (:meth:`JobControl.fail`, or the training entry's :func:`stop_others` for any error that
  ends a rank); the first post wins. Every rank runs a watcher thread that polls the board
  (:data:`WATCH_POLL_S`); a rank that sees another's fault and has not stopped by itself
  :data:`STOP_GRACE_S` later (an error every rank raises together ends each in its own line)
  prints the line and exits (:data:`FAULT_EXIT`), wherever its main thread waits (inside
  megatron's save barrier, say). The rank that posted prints its line first and ends only once
  the others have stopped (:meth:`JobControl.linger`): once a rank ends, torchrun stops the
  rest, which would then end without a word. torchrun (or Slurm's requeue) restarts the job,
  which recovers exactly.
- **Outcomes agreed before anyone acts** (:meth:`JobControl.agree`): the ranks that succeeded
  and the ranks that failed reach one exchange (ok, or which rank failed and whether for want
  of space), so that every rank takes the same decision: go on, skip a base
  (``--diffckpt-when-full skip``), or stop. A rank that failed waits for the others at most
  :data:`FAILED_WAIT_S`: ranks that do not come are stuck elsewhere, and the job stops.
- **Collectives with a timeout** (:meth:`JobControl.run`): each rank writes which collective
  it is at (one store key per rank, overwritten: the store does not grow) before it enters;
  a rank that waited ``timeout_s`` names the ranks that did not arrive, and where each of them
  was last, and stops the job. A fault posted meanwhile ends the wait at once.

Without a :class:`JobControl` (a process that never started one: unit tests, offline tools)
the library's collectives run as plain torch.distributed calls.

Collective rule: :meth:`JobControl.start`, :meth:`JobControl.run` and :meth:`JobControl.agree`
are called by all ranks together; :meth:`JobControl.fail` by any rank.
"""

from __future__ import annotations

import logging
import os
import random
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from megatron_diffckpt.errors import DiffCkptError

logger = logging.getLogger(__name__)

FAULT_EXIT = 3
"""The exit status of a rank stopped by another rank's fault (the failing rank's own entry
exits 2, as for every :class:`~megatron_diffckpt.errors.DiffCkptError`)."""

WATCH_POLL_S = 1.0
"""How often a rank's watcher reads the fault board."""

FAILED_WAIT_S = 10.0
"""How long a rank whose work failed waits for the others in :meth:`JobControl.agree` before it
stops the job (the others are then stuck in a collective of megatron's that it left)."""

STOP_GRACE_S = 3.0
"""How long a rank's watcher, having read another rank's fault, leaves the rank to stop by
itself before it stops it."""

SAY_FIRST_S = 0.5
"""How long the other ranks leave a failed rank, in :meth:`JobControl.stop_agreed`, to say why
before they stop (once one rank exits, torchrun stops the others)."""

LINGER_S = STOP_GRACE_S + WATCH_POLL_S + 2.0
"""How long the rank that posted the fault waits for the others to stop before it ends."""

LEAVE_S = 0.5
"""How long a rank stopped by its watcher lives on once it said so and counted itself stopped:
the rank that posted may be reading that count from a store this process hosts."""


class JobFault(DiffCkptError):
    """A rank failed and the job stops (this rank's failure, or another's, in one line)."""


class CollectiveTimeoutError(JobFault):
    """A library collective waited longer than its timeout: the ranks that did not arrive are
    named."""


@dataclass(frozen=True)
class Agreed:
    """What every rank learned in :meth:`JobControl.agree`: ``failed`` (some rank failed),
    ``full`` (some rank failed for want of space: a base may be skipped), ``first`` (the lowest
    failed rank, or ``None``)."""

    failed: bool
    full: bool
    first: int | None


_CURRENT: JobControl | None = None


def current() -> JobControl | None:
    """This process's control plane, once :meth:`JobControl.start` ran; else ``None``."""
    return _CURRENT


_PEER_GONE = re.compile(
    r"Connection reset by peer|Connection closed by peer|Broken pipe|remote process exited"
)
"""What a collective's error says when the process at the other end of a connection ended
(gloo's TCP transport, NCCL's "remote process exited or there was a network error")."""

_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")
"""The ``[.../pair.cc:537]`` gloo puts before its messages."""


def peer_gone(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because another rank's process ended under it
    (killed, or stopped by its own error), or the network between them failed: not this
    rank's fault, and no traceback of this rank says anything about it."""
    return isinstance(exc, RuntimeError) and _PEER_GONE.search(str(exc)) is not None


def describe(exc: BaseException) -> str:
    """An exception in one line: its type and the first line of its text; for DCP's
    ``CheckpointException`` (megatron's report of a failed save), the first failed rank's
    error that it carries; for a collective whose peer ended (:func:`peer_gone`), the
    backend's words up to the cause (``Read error [10.0.0.2]:38784: Connection reset by
    peer``), without its source location and advice."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, failure = min(failures.items(), key=lambda item: item[0])
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return f"{type(exc).__name__} of rank {rank}: {describe(inner)}"
    text = str(exc).strip().splitlines()
    if not text:
        return type(exc).__name__
    first = text[0]
    if peer_gone(exc):
        first = _SOURCE_PREFIX.sub("", first)
        gone = _PEER_GONE.search(first)
        if gone is not None:
            first = first[: gone.end()]
    return f"{type(exc).__name__}: {first}"


class JobControl:
    """The control plane of one attempt of a job (see the module doc). ``store``: the default
    process group's store; ``prefix``: this attempt's keys (agreed at :meth:`start`)."""

    def __init__(self, store: Any, rank: int, world: int, prefix: str, timeout_s: float):
        self.store, self.rank, self.world = store, rank, world
        self.prefix, self.timeout_s = prefix, timeout_s
        self.fault_key = f"{prefix}/fault"
        self._seq = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ender: str | None = None  # who ends this rank: "main" (itself) or "watcher"
        self._watcher: threading.Thread | None = None
        self._gone: BaseException | None = None  # the store's first failure (its host ended)

    @classmethod
    def start(cls, timeout_s: float) -> JobControl:
        """The control plane of this attempt, with its watcher running; this process's
        :func:`current` from now on. All ranks, collectively (one all-reduce, which agrees on a
        fresh key prefix: a store shared across torchrun's restarts holds an older attempt's
        keys)."""
        global _CURRENT
        if _CURRENT is not None:
            _CURRENT.close()
        from torch.distributed import distributed_c10d

        token = torch.tensor([random.SystemRandom().getrandbits(62)], dtype=torch.int64)
        if torch.cuda.is_available() and torch.distributed.get_backend() == "nccl":
            token = token.cuda()
        torch.distributed.all_reduce(token, op=torch.distributed.ReduceOp.MAX)
        control = cls(
            distributed_c10d._get_default_store(),
            torch.distributed.get_rank(),
            torch.distributed.get_world_size(),
            f"diffckpt/{int(token.item()):x}",
            timeout_s,
        )
        control._watcher = threading.Thread(
            target=control._watch, name="diffckpt-fault-watcher", daemon=True
        )
        control._watcher.start()
        _CURRENT = control
        return control

    def close(self) -> None:
        """Stop the watcher (the job ends normally). Any rank."""
        global _CURRENT
        self._stop.set()
        if _CURRENT is self:
            _CURRENT = None

    # -- the fault board ---------------------------------------------------------------------

    def _store(self, op: str, *args: Any) -> Any:
        """``self.store.<op>(*args)``. Once a call failed (the store's host ended: its socket
        is gone for good), every later one raises that failure again without touching the
        socket: torch's store client logs each failed call with a C++ backtrace, and a rank
        whose peer hosted the store would otherwise print one per call as it ends. Any
        thread."""
        if self._gone is not None:
            raise self._gone
        try:
            return getattr(self.store, op)(*args)
        except (RuntimeError, OSError) as exc:
            self._gone = exc
            raise

    def posted(self) -> str | None:
        """The fault posted on the board, or ``None``; a line saying so when the job's store
        is gone (its host, often rank 0, ended). Any rank."""
        try:
            return self._board()
        except (RuntimeError, OSError) as exc:
            return f"the job's store is gone ({describe(exc)}): another rank stopped"

    def _board(self) -> str | None:
        if not self._store("check", [self.fault_key]):
            return None
        return self._store("get", self.fault_key).decode()

    def post(self, line: str) -> str:
        """Post ``line`` unless a fault is there already; returns the board's fault. Any rank."""
        try:
            return self._store("compare_set", self.fault_key, "", line).decode()
        except (RuntimeError, OSError):
            return line

    def fail(self, what: str, cause: BaseException | str) -> NoReturn:
        """This rank cannot go on: post ``rank R: what: cause`` (unless another fault is there)
        and raise :class:`JobFault` with the board's line; the training entry prints it, then
        :func:`stop_others`. Any rank."""
        text = cause if isinstance(cause, str) else describe(cause)
        self._raise(self.post(f"rank {self.rank}: {what}: {text}; the job stops"))

    def linger(self) -> None:
        """This rank is about to end, having said why. The rank whose post is the board's
        waits (at most :data:`LINGER_S`) until every other rank has stopped: its process may
        host the job's store, and once it exits torchrun stops the others before they say
        why. Any other rank counts itself stopped. Any rank."""
        self.claim()
        line = self.posted()
        if line is None or not line.startswith(f"rank {self.rank}: "):
            self._stopping()
            return
        deadline = time.monotonic() + LINGER_S
        while time.monotonic() < deadline:
            try:
                if int(self._store("add", f"{self.prefix}/stopped", 0)) >= self.world - 1:
                    return
            except (RuntimeError, OSError):
                return
            time.sleep(0.05)

    def claim(self) -> None:
        """The main thread ends this rank itself (its watcher leaves it alone); if the watcher
        is ending it already, wait for that (never returns): an error the main thread meets
        then (a collective failing as the rank that failed ends) is a consequence, not news.
        Any rank."""
        with self._lock:
            if self._ender is None:
                self._ender = "main"
            mine = self._ender == "main"
        if not mine:
            threading.Event().wait()

    def _raise(self, line: str, kind: type[JobFault] = JobFault) -> NoReturn:
        self.claim()
        raise kind(line)

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_POLL_S):
            try:
                line = self._board()
            except (RuntimeError, OSError):
                # The store's host ended: at the job's end, before this rank; or it died, and
                # this rank's next collective fails (a failed rank posts, and waits for the
                # others to read it, before it ends).
                return
            if line is None or line.startswith(f"rank {self.rank}: ") or self._ender:
                continue
            # An error every rank raises together (a full disk under block) ends this rank by
            # itself, in its own line: the watcher stops only a rank that does not.
            if self._stop.wait(STOP_GRACE_S):
                return
            with self._lock:
                if self._ender is not None:
                    return
                self._ender = "watcher"
            logger.error("stopping: %s", line)
            for handler in logging.getLogger().handlers:
                handler.flush()
            sys.stderr.flush()
            self._stopping()
            time.sleep(LEAVE_S)
            os._exit(FAULT_EXIT)

    def _stopping(self) -> None:
        try:
            self._store("add", f"{self.prefix}/stopped", 1)
        except (RuntimeError, OSError):
            pass

    # -- collectives -------------------------------------------------------------------------

    def run(
        self,
        what: str,
        start: Callable[[], Any],
        timeout_s: float | None = None,
        on_timeout: Callable[[str], NoReturn] | None = None,
    ) -> None:
        """Run the collective ``start()`` begins (an ``async_op=True`` torch.distributed call;
        returns its work) as the library's collective ``what``: it waits at most
        ``timeout_s`` (default: this plane's), and a fault posted meanwhile ends the wait.
        Raises :class:`CollectiveTimeoutError` naming the ranks that did not arrive (or calls
        ``on_timeout(those ranks)``), or :class:`JobFault` with the posted line. All ranks,
        collectively."""
        self._seq += 1
        try:
            self._store("set", f"{self.prefix}/at/{self.rank}", f"{self._seq} {what}")
        except (RuntimeError, OSError) as exc:
            self._raise(self.posted() or f"the job's store is gone ({describe(exc)})")
        line = self.posted()
        if line is not None:
            self._raise(line)
        limit = self.timeout_s if timeout_s is None else timeout_s
        work = start()
        began = time.monotonic()
        pause, next_check = 0.0002, began + 0.5
        while True:
            try:
                if work.is_completed():
                    work.wait()
                    return
            except RuntimeError as exc:  # a peer died (gloo: connection closed)
                self._raise(self.posted() or f"{what}: {describe(exc)}")
            now = time.monotonic()
            if now >= next_check:
                line = self.posted()
                if line is not None:
                    self._raise(line)
                next_check = now + 0.5
            if now - began > limit:
                late = self._late()
                if on_timeout is not None:
                    on_timeout(late)
                line = f"rank {self.rank}: the collective '{what}' timed out after {limit:.0f} s; "
                self._raise(self.post(f"{line}not arrived: {late}; the job stops"),
                            CollectiveTimeoutError)  # fmt: skip
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _late(self) -> str:
        """The ranks that are not at this rank's collective (number ``self._seq`` of this
        attempt), and where each was last."""
        late = []
        for rank in range(self.world):
            key = f"{self.prefix}/at/{rank}"
            at = self._store("get", key).decode() if self._store("check", [key]) else "0 (none yet)"
            seq, _, where = at.partition(" ")
            if int(seq) < self._seq:
                late.append(f"rank {rank} (last at '{where}')")
        shown = ", ".join(late[:8]) + (f" and {len(late) - 8} more" if len(late) > 8 else "")
        return shown or "none (a slow collective)"

    def agree(self, what: str, error: BaseException | None, full: bool = False) -> Agreed:
        """The outcome of ``what`` on every rank: ``error`` is this rank's failure (``None``:
        it succeeded), ``full`` whether it was for want of space. One exchange that failing and
        succeeding ranks both reach, before any acts on it; a failed rank waits at most
        :data:`FAILED_WAIT_S` for the others (then stops the job, naming them). All ranks,
        collectively."""
        mine = torch.tensor(
            [-int(full), self.rank if error is not None else self.world], dtype=torch.int64
        )
        if torch.cuda.is_available() and torch.distributed.get_backend() == "nccl":
            mine = mine.cuda()
        wait = FAILED_WAIT_S if error is not None else None

        def start() -> Any:
            return torch.distributed.all_reduce(
                mine, op=torch.distributed.ReduceOp.MIN, async_op=True
            )

        def stuck(late: str) -> NoReturn:  # the others wait in a collective it left
            assert error is not None
            self.fail(what, f"{describe(error)}; not at the exchange: {late}")

        self.run(what, start, timeout_s=wait, on_timeout=stuck if error is not None else None)
        neg_full, first = (int(x) for x in mine.tolist())
        failed = first < self.world
        return Agreed(failed, neg_full < 0, first if failed else None)

    def stop_agreed(self, what: str, agreed: Agreed, error: BaseException | None) -> NoReturn:
        """Every rank stops after :meth:`agree` found a failure that cannot be skipped: the
        first failed rank posts its cause, every rank raises :class:`JobFault` with it. All
        ranks, collectively."""
        if agreed.first == self.rank:
            assert error is not None
            self.fail(what, error)
        deadline = time.monotonic() + FAILED_WAIT_S
        while (line := self.posted()) is None:
            if time.monotonic() > deadline:
                line = f"rank {agreed.first}: {what} failed (its cause did not arrive)"
                break
            time.sleep(0.05)
        time.sleep(SAY_FIRST_S)  # the failed rank says it first (torchrun stops the rest)
        self._raise(line)


def ending() -> None:
    """A training entry is about to print the error that ends this rank: unless this rank's
    watcher is stopping it already (then this waits for that, see :meth:`JobControl.claim`).
    Any rank; does nothing without a current control plane."""
    plane = current()
    if plane is not None:
        plane.claim()


def end_rank(exc: BaseException, say: Callable[[str], None]) -> int:
    """How a training entry ends this rank on ``exc``, the error its training raised (the last
    ``except`` of its ``main``); returns the exit status. One line through ``say`` for what
    the line tells whole: this library's errors (exit 2) and a collective whose peer's process
    ended (:func:`peer_gone`, exit 1: the peer's own line, or the launcher's report of its
    death, says why); any other error's traceback (exit 1). Then :func:`stop_others`. Any
    rank."""
    ending()  # unless the fault board stops this rank already
    if isinstance(exc, DiffCkptError):  # a wrong resume, a full disk: what happened
        say(f"error: {exc}")
        status = 2
    elif peer_gone(exc):
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else "?"
        say(
            f"error: rank {rank}: lost its connection to another rank during a collective "
            f"({describe(exc)}): that rank's process ended, or the network failed; the job "
            "stops (a restart with --load recovers)"
        )
        status = 1
    else:  # not this library's: its traceback, and the others stop too
        traceback.print_exception(exc)
        sys.stderr.flush()
        status = 1
    stop_others(exc)  # said first: once this rank ends, the launcher stops the others
    return status


def stop_others(exc: BaseException) -> None:
    """A training entry's last word on an error that ends this rank, once it has printed it:
    unless the board holds a fault already, post ``rank R: failed: exc`` so that the other
    ranks stop within seconds instead of waiting for this one in a collective (they print the
    line and exit), then :meth:`JobControl.linger`. Any rank; does nothing without a current
    control plane."""
    plane = current()
    if plane is None:
        return
    plane.claim()
    if peer_gone(exc):
        plane.post(f"rank {plane.rank}: lost a peer: {describe(exc)}; the job stops")
    elif not isinstance(exc, JobFault):
        plane.post(f"rank {plane.rank}: failed: {describe(exc)}; the job stops")
    plane.linger()
