"""Publishing a file durably and atomically: the one way this project writes what must survive.

Every publication writes ``<path>.tmp``, fsyncs it, renames it over ``<path>`` and fsyncs the
folder. A crash at any point leaves either the previous file (or none) or the complete new one,
never a torn one under the final name; a ``.tmp`` left behind is never read. Any rank.

Two ways to get the bytes into ``<path>.tmp``:

- :func:`publish_file`: through the page cache (small files: markers, trackers, JSON).
- :class:`StagedPublisher`: the file is serialised into a reusable page-aligned host buffer
  first, then written with direct I/O (``O_DIRECT``), which moves the bytes from that buffer to
  the device without copying them into the page cache. For the diff log's segments (tens of MB
  per rank and iteration in LowDiff+) this is most of their cost on a busy host: a buffered
  write of 25.8 MB took 5 to 73 ms of the writing thread's CPU here (page allocation and
  reclaim under a full page cache) plus the kernel's writeback threads, a direct one under 1 ms
  (``tests/test_durable_io.py`` checks the bytes, ``benchmarks/lowdiff_plus_overhead.py`` the
  effect). A filesystem that refuses direct I/O (``EINVAL``: some network and FUSE
  filesystems) gets the same bytes through the page cache, said once in the log.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
from collections.abc import Callable
from typing import BinaryIO, TypeVar

import numpy as np

T = TypeVar("T")

logger = logging.getLogger(__name__)

ALIGN = 4096
"""Direct I/O's alignment of buffer address, file offset and length (a page: what every Linux
block device and filesystem accepts)."""

_DIRECT_CHUNK = 1 << 30
"""Bytes per direct write call (Linux caps one write at just under 2 GiB)."""


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
        _remove_quietly(tmp)
        raise
    _rename_durably(tmp, path)
    return result


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def _rename_durably(tmp: str, path: str) -> None:
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


class StagingBuffer:
    """A page-aligned, growable host buffer with the ``write``/``tell`` of a binary file: what a
    serialiser writes into before the bytes go to storage in one direct write. One thread."""

    def __init__(self) -> None:
        self._map: mmap.mmap | None = None
        self._bytes: np.ndarray | None = None  # the map as an array: copies without the GIL
        self._size = 0

    def reset(self) -> None:
        """Empty it (the memory stays for the next file)."""
        self._size = 0

    def write(self, data) -> int:
        with memoryview(data) as view, view.cast("B") as flat:
            n = flat.nbytes
            if n:
                self._reserve(self._size + n)
                self._bytes[self._size : self._size + n] = np.frombuffer(flat, dtype=np.uint8)
        self._size += n
        return n

    def tell(self) -> int:
        return self._size

    def view(self, start: int, end: int) -> memoryview:
        """The bytes written in ``[start, end)``, without a copy; release it (``with``) before
        the next write, which may move them."""
        if not 0 <= start <= end <= self._size:
            raise ValueError(f"bytes {start}-{end} are not within the {self._size} written")
        if self._map is None:
            return memoryview(b"")
        return memoryview(self._map)[start:end]

    def overwrite(self, offset: int, data: bytes) -> None:
        """Replace written bytes from ``offset`` on (a header whose room was written first)."""
        if offset < 0 or offset + len(data) > self._size:
            raise ValueError(f"{len(data)} bytes at {offset} pass the {self._size} written")
        self._bytes[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)

    @property
    def capacity(self) -> int:
        """Bytes held (a page-aligned mapping; 0 until the first write)."""
        return len(self._map) if self._map is not None else 0

    def padded(self) -> memoryview:
        """The bytes written, zero-padded to a multiple of :data:`ALIGN` (direct I/O's unit)."""
        end = -(-self._size // ALIGN) * ALIGN
        if not end:
            return memoryview(b"")
        self._reserve(end)
        self._map[self._size : end] = bytes(end - self._size)
        return memoryview(self._map)[:end]

    def close(self) -> None:
        """Give the memory back."""
        if self._map is not None:
            self._bytes = None
            self._map.close()
            self._map = None
        self._size = 0

    def _reserve(self, n: int) -> None:
        if n <= self.capacity:
            return
        grown = mmap.mmap(-1, max(-(-n // ALIGN) * ALIGN, 2 * self.capacity))
        array = np.frombuffer(grown, dtype=np.uint8)
        if self._map is not None:
            array[: self._size] = self._bytes[: self._size]
            self._bytes = None
            self._map.close()
        self._map, self._bytes = grown, array


class StagedPublisher:
    """Publishes files serialised into a reusable :class:`StagingBuffer`, with direct I/O where
    the filesystem takes it (see the module's docstring). One thread (the diff log's writer).

    Args:
        direct: try direct I/O (``False``: always through the page cache).
        what: names the files in the one log line that says direct I/O was refused.
    """

    def __init__(self, direct: bool = True, what: str = "files"):
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.what = what
        self.staging = StagingBuffer()

    def publish(
        self,
        path: str,
        serialise: Callable[[StagingBuffer], T],
        written: Callable[[], None] | None = None,
    ) -> T:
        """Serialise into the staging buffer, write it to ``path.tmp`` (then ``written()``: the
        bytes are in the file, neither fsynced nor published), fsync, rename to ``path``, fsync
        the folder. Durable and visible when this returns; on an error the ``.tmp`` is removed
        and the previous ``path`` untouched, as with :func:`publish_file`."""
        self.staging.reset()
        result = serialise(self.staging)
        self.publish_staged(path, self.staging, written)
        return result

    def publish_staged(
        self, path: str, staging: StagingBuffer, written: Callable[[], None] | None = None
    ) -> None:
        """:meth:`publish` of the bytes a caller serialised into ``staging`` (a buffer of its
        own, left as it is)."""
        tmp = path + ".tmp"
        try:
            fd = self._write(tmp, staging)
            try:
                if written is not None:
                    written()
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            _remove_quietly(tmp)
            raise
        _rename_durably(tmp, path)

    def close(self) -> None:
        self.staging.close()

    def _write(self, tmp: str, staging: StagingBuffer) -> int:
        """``tmp`` holding the staged bytes; returns its open descriptor."""
        if self.direct:
            try:
                return self._write_file(tmp, staging, direct=True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False
                logger.info(
                    "%s: %s refuses direct I/O (%s); writing through the page cache",
                    self.what,
                    os.path.dirname(tmp) or ".",
                    exc.strerror,
                )
        return self._write_file(tmp, staging, direct=False)

    @staticmethod
    def _write_file(tmp: str, staging: StagingBuffer, direct: bool) -> int:
        size = staging.tell()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        fd = os.open(tmp, flags, 0o644)
        try:
            with staging.padded() as padded:
                if not direct:
                    _write_all(fd, padded[:size])
                else:  # whole pages, then the padding, only direct I/O's unit, cut off
                    _write_all(fd, padded)
                    if len(padded) != size:
                        os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return fd


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        with data[done : done + _DIRECT_CHUNK] as chunk:
            n = os.write(fd, chunk)
        if n <= 0:  # a short write with no error: the filesystem is out of space
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += n
