"""How a process that steps several ranks' host replicas (a node's keeper: one LowDiff+ replica
per rank of the node) spends a budget of CPU threads on them.

Each rank's merge runs on the thread that serves that rank, so a node's merges run in parallel.
Left alone, every one of them would run torch's kernels on all of the host's cores, and a node
of 8 ranks would put 8 times the host's threads on memory-bound work. :class:`MergeThreads`
bounds them: at most ``min(threads, shards)`` merges at a time, each with ``threads // shards``
intra-op threads (at least one), so that the node's merges together use ``threads``. The Adam
step is memory-bound: once the threads saturate the host's memory bandwidth more buy nothing
(``benchmarks/host_merge.py`` measures where that is).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity, as Slurm's cgroup or ``taskset`` set it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_threads() -> int:
    """A keeper's default budget: half the CPUs it may run on (the rest stay with the ranks'
    data loaders and the checkpoint writers), at least one."""
    return max(1, available_cpus() // 2)


class MergeThreads:
    """A budget of ``threads`` CPU threads for the merges of ``shards`` replicas."""

    def __init__(self, threads: int, shards: int):
        if threads < 1 or shards < 1:
            raise ValueError(f"threads and shards must be >= 1, got {threads} and {shards}")
        self.threads, self.shards = threads, shards
        self.concurrent = min(threads, shards)
        """Merges that run at the same time."""
        self.per_merge = max(1, threads // shards)
        """torch's intra-op threads of each merge."""
        self._slots = threading.BoundedSemaphore(self.concurrent)

    def __repr__(self) -> str:
        return (
            f"{self.threads} thread(s) for {self.shards} replica(s): {self.concurrent} merge(s) "
            f"at a time, {self.per_merge} thread(s) each"
        )

    @contextlib.contextmanager
    def merging(self) -> Iterator[None]:
        """Around one merge, on the thread that runs it: waits for a slot, and runs torch's
        kernels on that thread with :attr:`per_merge` threads (torch's count is per thread)."""
        import torch  # here: a keeper that hosts no replica never imports it

        with self._slots:
            torch.set_num_threads(self.per_merge)
            yield


_BUDGET: MergeThreads | None = None


def configure(threads: int, shards: int) -> MergeThreads:
    """This process's budget (the keeper sets it at start); :func:`merging` uses it."""
    global _BUDGET
    _BUDGET = MergeThreads(threads, shards)
    return _BUDGET


def merging() -> contextlib.AbstractContextManager[None]:
    """:meth:`MergeThreads.merging` of this process's budget; nothing without one."""
    return contextlib.nullcontext() if _BUDGET is None else _BUDGET.merging()
