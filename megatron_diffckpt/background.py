"""megatron-diffckpt's background threads (diff writer, replica merger, base persister): their
CPU priority, the worker thread the writer and the merger share, what they cost the cores
(:class:`CpuMeter`), the rule that processes a rank starts die with it, and a quiet exit.

They run beside the training thread in the same process. On a GPU node the host cores are mostly
idle and priority does not matter; on a busy host (CPU training, data loading on every core) the
training thread should win. :func:`lower_priority` raises the calling thread's nice value by
``BACKGROUND_NICENESS`` (Linux: per thread); processes it forks (megatron's checkpoint writers)
inherit it. Raising one's own nice value needs no privilege; where it is not possible the thread
keeps its priority.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

BACKGROUND_NICENESS = 10


def lower_priority(niceness: int = BACKGROUND_NICENESS) -> bool:
    """Lower the calling thread's CPU priority. Any thread; returns whether it took effect."""
    try:
        tid = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + niceness))
        return True
    except (AttributeError, OSError):
        return False


class CpuMeter:
    """CPU seconds that background work took, by activity ("snapshot copy", "merge step", ...).

    Each activity is measured on the thread that does it, with that thread's CPU clock
    (``time.thread_time``): what the work took from the cores, whatever the wall clock says while
    it waits for a lock, a disk or a core the training thread holds. Any thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}

    @contextmanager
    def measure(self, activity: str) -> Iterator[None]:
        """Add the calling thread's CPU time inside the block to ``activity``."""
        start = time.thread_time()
        try:
            yield
        finally:
            self.add(activity, time.thread_time() - start)

    def add(self, activity: str, seconds: float) -> None:
        with self._lock:
            self._seconds[activity] = self._seconds.get(activity, 0.0) + seconds

    def totals(self) -> dict[str, float]:
        """Seconds by activity, cumulative."""
        with self._lock:
            return dict(self._seconds)


class BackgroundWorker:
    """One daemon thread that runs ``handle(item)`` for every queued item, in order, at lower
    CPU priority: the diff log's writer and the LowDiff+ merger.

    The first exception ``handle`` raises is kept in :attr:`error` (and passed to ``on_error``
    on the worker thread); the item and every later one go to ``drop`` (e.g. to give resources
    back) instead of ``handle``. The owner re-raises :attr:`error` on the training thread, with
    what it means for durability: an error is never swallowed.

    Threads: the owner's thread calls :meth:`put`, :meth:`join` and :meth:`stop`; the rest runs
    on the worker thread.
    """

    def __init__(
        self,
        name: str,
        handle: Callable[[Any], None],
        *,
        maxsize: int = 0,
        drop: Callable[[Any], None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
    ):
        self._handle, self._drop, self._on_error = handle, drop, on_error
        self._queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item: Any, block: bool = True) -> bool:
        """Queue ``item``; without ``block``, ``False`` when the queue is full."""
        try:
            self._queue.put(item, block=block)
        except queue.Full:
            return False
        return True

    @property
    def backlog(self) -> int:
        """Items queued and not yet taken."""
        return self._queue.qsize()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until every queued item was handled (or dropped), at most ``timeout`` seconds
        (``None``: as long as it takes); whether they were."""
        if timeout is None:
            self._queue.join()
            return True
        deadline = time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._queue.all_tasks_done.wait(left)
        return True

    def stop(self) -> None:
        """Handle what is queued, then end the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        lower_priority()  # training first on a busy host
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self.error is None:
                    self._handle(item)
                elif self._drop is not None:
                    self._drop(item)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the owner
                self.error = exc
                if self._drop is not None:
                    self._drop(item)
                if self._on_error is not None:
                    self._on_error(exc)
            finally:
                self._queue.task_done()


# Linux prctl(2) option: the signal a process gets when the thread that started it ends.
PR_SET_PDEATHSIG = 1


def _prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (AttributeError, OSError):  # not Linux
        return None


_PRCTL = _prctl()  # resolved once here: a forked child should not load libraries


def die_with_parent(parent: int | None = None) -> bool:
    """Make the calling process get SIGKILL when the thread that started it ends (Linux
    ``PR_SET_PDEATHSIG``), and end now if that already happened: if its parent is no longer
    ``parent`` (the pid of the process that started it, where known), or, without it, if its
    parent changed during the call or is init. (An orphan is adopted by the nearest subreaper,
    not always init: only the known pid tells every adoption.) Returns whether it took effect
    (not on other systems)."""
    before = os.getppid()
    if _PRCTL is None or _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        return False
    now = os.getppid()
    if now != (before if parent is None else parent) or now == 1:  # the parent died before
        os._exit(1)
    return True


_FORK_HOOK = False
_FORKED_BY = 0
"""The pid of the process that forked this one (set in the forking process, before a fork)."""


def _record_forker() -> None:
    global _FORKED_BY
    _FORKED_BY = os.getpid()


def _die_with_forker() -> None:
    die_with_parent(_FORKED_BY)


def children_die_with_this_process() -> None:
    """Every process this one forks from now on (megatron's checkpoint writers fork) gets SIGKILL
    when the thread that forked it ends, so that nothing a killed rank started outlives it, under
    any launcher (a leftover writer of an older incarnation could otherwise still be writing
    while a restarted job uses the same folder). The forking threads (the training thread,
    megatron's async caller, the LowDiff+ persister) wait for their writers, so a writer ends
    before its thread does unless the process dies. Any process; idempotent."""
    global _FORK_HOOK
    if not _FORK_HOOK:
        os.register_at_fork(before=_record_forker, after_in_child=_die_with_forker)
        _FORK_HOOK = True


_FORK_SERVER = "from multiprocessing.forkserver import main"
"""How ``multiprocessing`` starts its fork server: ``python -c`` with this code."""
_FORK_SERVER_PRELOAD = "megatron_diffckpt.fork_server_preload"


def helpers_die_with_this_rank() -> None:
    """For an entry script, at import, so that nothing a killed rank started outlives it.

    In the rank: :func:`children_die_with_this_process` (megatron-core 0.19 forks its checkpoint
    writer's results manager while Megatron-LM initializes, before this project's manager
    starts) and :func:`fork_server_dies_with_this_process`. In a helper that ``multiprocessing``
    started by *spawn* (it imports the script; megatron's checkpoint writer spawns its results
    manager, megatron-core 0.16 its persistent checkpoint worker): die with the rank, and so do
    the processes the helper forks (a spawned interpreter has none of the rank's fork hooks; the
    persistent worker forks the file writers, which wait on queues whose other end died with the
    worker and would otherwise wait forever, holding the rank's resource tracker and its
    semaphores). In the fork server or a process it forked: nothing more (the server's preload
    did it). (A helper's ``sys.argv`` is the parent's while it imports the script; its own
    command line is ``sys.orig_argv``.)"""
    if "--multiprocessing-fork" in getattr(sys, "orig_argv", ()):
        die_with_parent()
        children_die_with_this_process()
    elif not in_fork_server():
        children_die_with_this_process()
        fork_server_dies_with_this_process()


def in_fork_server() -> bool:
    """Whether this interpreter is ``multiprocessing``'s fork server, or a process it forked."""
    return any(arg.startswith(_FORK_SERVER) for arg in getattr(sys, "orig_argv", ()))


def fork_server_dies_with_this_process() -> None:
    """The fork server ``multiprocessing`` starts from this process, if it starts one after this
    call (megatron-core 0.19 forks its persistent checkpoint worker from one), dies with the
    thread that started it, and every process it forks dies with it
    (:mod:`~megatron_diffckpt.fork_server_preload`, which it imports before it serves). Without
    this a killed rank's fork server and worker live on: the fork server is started by
    ``spawnv``, which runs no fork hook and imports no entry script (Python 3.12 passes it no
    main path), and the worker's queues keep the rank's resource tracker waiting, with their
    semaphores in /dev/shm. Any process; idempotent."""
    from multiprocessing import forkserver

    # the modules the server preloads (default ["__main__"]); only a setter is public
    modules = list(getattr(forkserver._forkserver, "_preload_modules", ["__main__"]))
    if _FORK_SERVER_PRELOAD not in modules:
        forkserver.set_forkserver_preload([*modules, _FORK_SERVER_PRELOAD])


_EXIT_HOOK = False
_DATALOADER_HANDLER = "torch.utils.data._utils.signal_handling"


def quiet_child_exits_at_exit() -> None:
    """At interpreter exit, before ``multiprocessing`` stops the daemonic children (torch's
    DataLoader workers), give SIGCHLD back its default action if torch's DataLoader handler
    holds it. Otherwise those children's exits arrive while the interpreter disables its
    signal handling, and one caught by another thread at that moment is reported after the
    handler is gone, on stderr as ``OSError: Signal 17 ignored due to race condition`` (seen
    with Python 3.12 at the end of a successful run). At exit nothing needs the handler (it
    turns a worker's crash into an error of the training loop, which has ended); waiting for
    children works the same with the default action. The rank's main thread; idempotent."""
    global _EXIT_HOOK
    if not _EXIT_HOOK:
        # atexit runs its functions last-registered first: this one before multiprocessing's,
        # which was registered when torch imported it
        atexit.register(_restore_sigchld)
        _EXIT_HOOK = True


def _restore_sigchld() -> None:
    handler = signal.getsignal(signal.SIGCHLD)
    if getattr(handler, "__module__", None) == _DATALOADER_HANDLER:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
