"""megatron-diffckpt's background threads (diff writer, replica merger, base persister): their
CPU priority, and the worker thread the writer and the merger share.

They run beside the training thread in the same process. On a GPU node the host cores are mostly
idle and priority does not matter; on a busy host (CPU training, data loading on every core) the
training thread should win. :func:`lower_priority` raises the calling thread's nice value by
``BACKGROUND_NICENESS`` (Linux: per thread); processes it forks (megatron's checkpoint writers)
inherit it. Raising one's own nice value needs no privilege; where it is not possible the thread
keeps its priority.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
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

    def join(self) -> None:
        """Wait until every queued item was handled (or dropped)."""
        self._queue.join()

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
