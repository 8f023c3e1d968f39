"""Durable publication through the staging buffer: the exact bytes under the final name, direct
I/O that leaves the page cache alone, the page-cache fallback for a filesystem that refuses it,
and a full filesystem that leaves the previous file untouched."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
from pathlib import Path

import pytest
import torch

from megatron_diffckpt import durable_io
from megatron_diffckpt.durable_io import ALIGN, StagedPublisher, StagingBuffer
from megatron_diffckpt.storage import DiffLogWriter, DiffRecord, SegmentIdentity, read_segment

IDENTITY = SegmentIdentity("run-a", 0, 0, 0, "layout-1")


def _payload(n: int, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()


def _filesystem(path: Path) -> str:
    """The type of the filesystem ``path`` lies on (``/proc/mounts``' longest matching mount)."""
    best, kind = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            _, point, fstype = line.split()[:3]
            if str(path).startswith(point) and len(point) > len(best):
                best, kind = point, fstype
    return kind


def _resident_pages(path: Path) -> int:
    """Pages of ``path`` that the page cache holds (mincore(2) over a mapping never touched)."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        pages = -(-size // mmap.PAGESIZE)
        vec = ctypes.create_string_buffer(pages)
        address = ctypes.addressof(ctypes.c_char.from_buffer(m))
        if libc.mincore(ctypes.c_void_p(address), size, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return sum(b & 1 for b in vec.raw)


def test_staging_buffer_keeps_every_byte_across_growth_and_pads_to_the_alignment():
    buf = StagingBuffer()
    parts = [_payload(n, seed=n) for n in (1, ALIGN - 1, 3 * ALIGN + 5, 1 << 20)]
    for part in parts:
        assert buf.write(part) == len(part)
    whole = b"".join(parts)
    assert buf.tell() == len(whole) and buf.capacity >= len(whole)
    with buf.padded() as padded:
        assert len(padded) % ALIGN == 0 and len(padded) - len(whole) < ALIGN
        assert bytes(padded[: len(whole)]) == whole
        assert not any(padded[len(whole) :])
    # a tensor's bytes (a non-byte format) go in as they lie in memory
    buf.reset()
    t = torch.arange(10, dtype=torch.float32)
    buf.write(t.numpy())
    with buf.padded() as padded:
        assert bytes(padded[: buf.tell()]) == t.numpy().tobytes()
    buf.close()
    assert buf.capacity == 0


@pytest.mark.parametrize("size", [0, 1, ALIGN, ALIGN + 1, 5 * (1 << 20) + 3])
def test_direct_publication_holds_exactly_the_serialised_bytes(tmp_path, size):
    publisher = StagedPublisher(direct=True)
    data = _payload(size, seed=size)
    seen = []
    final = tmp_path / "seg.bin"
    result = publisher.publish(
        str(final), lambda f: f.write(data), written=lambda: seen.append(os.listdir(tmp_path))
    )
    assert result == size
    assert seen == [["seg.bin.tmp"]]  # the bytes were in the .tmp before it was published
    assert final.read_bytes() == data  # the padding was cut off
    assert os.listdir(tmp_path) == ["seg.bin"]
    assert publisher.direct


def test_direct_publication_bypasses_the_page_cache(tmp_path):
    if _filesystem(tmp_path) == "tmpfs":
        pytest.skip("on tmpfs the page cache is the file")
    data = _payload(8 << 20)
    direct, buffered = tmp_path / "direct.bin", tmp_path / "buffered.bin"
    StagedPublisher(direct=True).publish(str(direct), lambda f: f.write(data))
    StagedPublisher(direct=False).publish(str(buffered), lambda f: f.write(data))
    pages = len(data) // mmap.PAGESIZE
    assert _resident_pages(direct) < pages // 10
    assert _resident_pages(buffered) > pages // 2  # what the test would see without O_DIRECT
    assert direct.read_bytes() == data == buffered.read_bytes()


def test_a_filesystem_refusing_direct_io_is_written_through_the_page_cache(
    tmp_path, monkeypatch, caplog
):
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(durable_io.os, "open", refusing_open)
    publisher = StagedPublisher(direct=True, what="diff log rank_0_0_0")
    with caplog.at_level(logging.INFO, logger="megatron_diffckpt.durable_io"):
        for i in range(3):
            data = _payload(100_000 + i, seed=i)
            publisher.publish(str(tmp_path / f"f{i}"), lambda f, d=data: f.write(d))
            assert (tmp_path / f"f{i}").read_bytes() == data
    assert not publisher.direct
    said = [r.getMessage() for r in caplog.records if "refuses direct I/O" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("diff log rank_0_0_0: ")


def test_a_full_filesystem_keeps_the_previous_file_and_leaves_no_tmp(tmpfs):
    small = tmpfs("small", "1m")
    publisher = StagedPublisher(direct=True)
    before = _payload(100_000)
    publisher.publish(str(small / "seg.bin"), lambda f: f.write(before))
    with pytest.raises(OSError) as raised:
        publisher.publish(str(small / "seg.bin"), lambda f: f.write(_payload(2 << 20, seed=1)))
    assert raised.value.errno == errno.ENOSPC
    assert (small / "seg.bin").read_bytes() == before
    assert os.listdir(small) == ["seg.bin"]


@pytest.mark.parametrize("direct_io", [True, False])
def test_the_diff_log_reads_back_what_either_way_wrote(tmp_path, direct_io):
    w = DiffLogWriter(str(tmp_path), IDENTITY, "none", batch_size=2, direct_io=direct_io)
    records = []
    for it in range(1, 6):
        g = torch.Generator().manual_seed(it)
        record = DiffRecord(it, {"lr": 0.1 * it}, {"grad": torch.randn(10_001, generator=g)})
        records.append(record)
        w.append(record)
    assert w.flush() == 5
    w.close()
    got = []
    for name in sorted(os.listdir(tmp_path / IDENTITY.dirname())):
        if name.startswith("seg_"):
            scan = read_segment(str(tmp_path / IDENTITY.dirname() / name), IDENTITY)
            assert scan.error is None, scan.error
            got += scan.records
    assert [r.iteration for r in got] == [1, 2, 3, 4, 5]
    for want, have in zip(records, got, strict=True):
        assert have.scalars == want.scalars
        assert torch.equal(have.tensors["grad"], want.tensors["grad"])
