"""A progress line for long offline operations (the CLI's export and prune): stderr, throttled."""

from __future__ import annotations

import time
from typing import TextIO


class Progress:
    """``[label] 12/31 tensors, 40.2 of 96.0 MB, 3.1 s`` on one rewritten line.

    Args:
        label: what is being done.
        total: the number of items; ``total_bytes`` their size when known.
        stream: where to write (the CLI passes ``sys.stderr``); nothing is written when it is
            ``None``.
    """

    def __init__(
        self,
        label: str,
        total: int,
        unit: str = "items",
        total_bytes: int | None = None,
        *,
        stream: TextIO | None,
        every_s: float = 0.5,
    ):
        self.label, self.total, self.unit = label, total, unit
        self.total_bytes, self.stream, self.every_s = total_bytes, stream, every_s
        self.done_items, self.done_bytes = 0, 0
        self._start = self._last = time.perf_counter()

    def update(self, items: int = 1, nbytes: int = 0) -> None:
        self.done_items += items
        self.done_bytes += nbytes
        now = time.perf_counter()
        if now - self._last >= self.every_s or self.done_items >= self.total:
            self._last = now
            self._write("\r")

    def close(self) -> float:
        """End the line; returns the seconds since the start."""
        if self.done_items < self.total:
            self._write("\r")
        if self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()
        return time.perf_counter() - self._start

    def _write(self, prefix: str) -> None:
        if self.stream is None:
            return
        text = f"[{self.label}] {self.done_items}/{self.total} {self.unit}"
        if self.total_bytes:
            text += f", {self.done_bytes / 1e6:.1f} of {self.total_bytes / 1e6:.1f} MB"
        text += f", {time.perf_counter() - self._start:.1f} s"
        self.stream.write(prefix + text)
        self.stream.flush()
