"""Publishing a file durably and atomically: the one way this project writes what must survive.

``publish_file`` writes to ``<path>.tmp``, fsyncs it, renames it over ``<path>`` and fsyncs the
folder. A crash at any point leaves either the previous file (or none) or the complete new one,
never a torn one under the final name; a ``.tmp`` left behind is never read. Any rank.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import BinaryIO, TypeVar

T = TypeVar("T")


def fsync_dir(path: str) -> None:
    """Make a folder's entries (creations, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_file(path: str, write: Callable[[BinaryIO], T]) -> T:
    """Write ``path`` through ``write(f)``; durable and visible at once when this returns.

    On an error (a full disk, say) the partial ``.tmp`` is removed and the error raised; the
    previous ``path``, if any, is untouched."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")
    return result
