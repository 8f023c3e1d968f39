"""A full filesystem under ``--save``: recognising it in an error, and whether a base still fits.

A base is a megatron ``dist_checkpointing`` save; when its filesystem fills up, megatron reports
the failure on every rank together as DCP's ``CheckpointException`` (the writing ranks' errors
gathered on the coordinator, a failure flag broadcast to the others), and only the coordinator
sees the ``OSError`` behind it. :func:`full_reason` finds that error in an exception, its causes
and DCP's per-rank failures; where the error does not say (torch's zip writer reports a short
write as an ``unexpected pos``), :func:`looks_full` judges by the space left. The manager agrees
on it across ranks (:meth:`~megatron_diffckpt.manager.DiffCheckpointManager.base_failed`).

Some writes of a save happen on one rank only (megatron's ``common.pt`` and the metadata file on
the coordinator); a failure there would leave the other ranks waiting in the save's next
collective. So a base is not started when the newest published one would not fit in the space
left (:func:`base_fits`): the job skips or stops cleanly before any byte is written.

Any rank; nothing here is collective.
"""

from __future__ import annotations

import errno
import os
from typing import Any

from megatron_diffckpt.errors import DiffCkptError

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""A write that failed for want of space (no space, quota, file size limit)."""


def __getattr__(name: str) -> Any:
    """``SAVE_FAILURES``: what a failed megatron save or finalize raises: any error (a rank's own:
    its writer's helper process gone, a permission refused; or megatron's report of a failed
    write on every rank), and DCP's ``CheckpointException``, a ``BaseException``. The ranks agree
    on it before acting (:meth:`~megatron_diffckpt.manager.DiffCheckpointManager.agree_on_base`).

    Resolved on first use (PEP 562): importing DCP costs a process about 45 MB and a second, and
    the node's keeper, which imports this module for :class:`StorageFullError`, saves no base."""
    if name == "SAVE_FAILURES":
        from torch.distributed.checkpoint.api import CheckpointException

        return (Exception, CheckpointException)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


HEADROOM = 1.1
"""A base is started only when this many times the newest base's bytes are free."""


class StorageFullError(DiffCkptError):
    """The filesystem of the diff log or of the bases is full (``--diffckpt-when-full block``)."""


def full_reason(exc: BaseException) -> str | None:
    """Why ``exc`` is a full filesystem (the OS's words), or ``None`` when it is something else.

    Looks at ``exc``, its causes and contexts, and the per-rank failures of DCP's
    ``CheckpointException`` (which arrive pickled, their causes lost: their text is read too)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            return os.strerror(e.errno) + (f": {e.filename}" if e.filename else "")
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                todo.append(failure[0] if isinstance(failure, tuple) else failure)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        if failures is None:
            text = str(e)
            for code in FULL_ERRNOS:
                if os.strerror(code) in text or f"[Errno {code}]" in text:
                    return os.strerror(code)
    return None


def folder_bytes(path: str) -> int:
    """Bytes of the files in ``path`` and below (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                continue  # removed meanwhile
    return total


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still write on ``path``'s filesystem."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def base_fits(save_dir: str, newest_base_dir: str | None, floor: int = 0) -> tuple[bool, int, int]:
    """Whether a base fits in ``save_dir``: ``(fits, bytes needed, bytes free)``. It needs
    :data:`HEADROOM` times the newest published base (``newest_base_dir``), and at least
    ``floor`` bytes (a lower bound of any base's size). A folder that does not exist yet has
    room for what its filesystem has."""
    newest = folder_bytes(newest_base_dir) if newest_base_dir else 0
    needed = max(int(newest * HEADROOM), floor)
    if needed == 0:
        return True, 0, 0
    path = save_dir
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)  # the filesystem the folder will be created on
    free = free_bytes(path)
    return free >= needed, needed, free


def looks_full(save_dir: str, newest_base_dir: str | None, failed_dir: str) -> str | None:
    """After a base's write failed without saying why (torch's zip writer reports a short write
    as ``unexpected pos``): whether the filesystem is full, judged by what is left: less than
    the newest base needs, or than the failed base had already written. The reason, or
    ``None``."""
    try:
        free = free_bytes(save_dir)
    except OSError:
        return None
    newest = folder_bytes(newest_base_dir) if newest_base_dir else 0
    needed = max(int(newest * HEADROOM), folder_bytes(failed_dir))
    if free >= needed:
        return None
    return f"the write failed with {free / 2**20:.1f} MiB left of {needed / 2**20:.1f} MiB wanted"
