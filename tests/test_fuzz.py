"""Fuzz tests (hypothesis, bounded examples, derandomized so that CI is reproducible) of the code
that parses bytes from disk or from a socket: the diff log's segment reader and the keeper's
frame parser. Random, truncated, bit-flipped, spliced and oversized inputs give a clear error or
the longest valid prefix: never another exception, a hang, or an allocation larger than what the
input holds (a length field claiming terabytes is refused or read as far as the bytes go)."""

from __future__ import annotations

import io
import json
import socket
import struct
import threading
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_diffckpt.keeper import wire
from megatron_diffckpt.storage.format import (
    DiffLogFormatError,
    DiffRecord,
    SegmentHeader,
    SegmentIdentity,
    iter_records,
    write_segment,
)
from megatron_diffckpt.storage.reader import read_segment

FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
IDENTITY = SegmentIdentity(run_id="fuzz", tp_rank=0, pp_rank=0, dp_rank=1, layout_hash="ab")
TERABYTE = 1 << 40


def _records() -> list[DiffRecord]:
    g = torch.Generator().manual_seed(0)
    return [
        DiffRecord(
            it,
            {"lr": 1e-3 * it, "skipped": False},
            {"values": torch.randn(37, generator=g), "indices": torch.arange(it * 5)},
        )
        for it in range(3, 7)
    ]


RECORDS = _records()


def _segment() -> bytes:
    buf = io.BytesIO()
    header = SegmentHeader(IDENTITY, "topk", RECORDS[0].iteration, RECORDS[-1].iteration, 4)
    write_segment(buf, header, RECORDS)
    return buf.getvalue()


SEGMENT = _segment()


def _assert_a_prefix(got: list[DiffRecord]) -> None:
    """``got`` is the first records of :data:`RECORDS`, bit for bit."""
    assert len(got) <= len(RECORDS)
    for rec, want in zip(got, RECORDS, strict=False):
        assert rec.iteration == want.iteration and rec.scalars == want.scalars
        assert rec.tensors.keys() == want.tensors.keys()
        for name, t in want.tensors.items():
            assert torch.equal(rec.tensors[name], t)


def _read(tmp_path: Path, data: bytes):
    path = tmp_path / "seg_fuzz.bin"
    path.write_bytes(data)
    return read_segment(str(path), IDENTITY)


@st.composite
def damaged_segments(draw) -> bytes:
    """The valid segment, then truncated, bit-flipped, overwritten or spliced."""
    data = bytearray(SEGMENT)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["truncate", "flip", "overwrite", "splice"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "truncate":
            del data[at:]
        elif kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "overwrite":
            chunk = draw(st.binary(min_size=1, max_size=16))
            data[at : at + len(chunk)] = chunk
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=64))
    return bytes(data)


@FUZZ
@given(data=damaged_segments())
def test_a_damaged_segment_gives_its_longest_valid_prefix_or_a_clear_error(tmp_path, data):
    scan = _read(tmp_path, data)
    _assert_a_prefix(scan.records)
    if data != SEGMENT:
        assert scan.error or len(scan.records) == len(RECORDS), scan  # said, unless harmless


@FUZZ
@given(data=st.binary(max_size=4096))
def test_random_bytes_are_refused_with_a_clear_error(tmp_path, data):
    scan = _read(tmp_path, data)
    assert scan.records == [] and scan.error, scan


def _record_bytes(iteration: int, meta: bytes, payload: bytes, payload_len: int | None = None):
    """A record frame with a valid checksum (what a hostile writer can make)."""
    head = struct.pack("<4sQIQ", b"REC\0", iteration, len(meta), len(payload) if
                       payload_len is None else payload_len)  # fmt: skip
    crc = zlib.crc32(payload, zlib.crc32(meta, zlib.crc32(head)))
    return head + meta + payload + struct.pack("<I", crc)


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),  # fmt: skip
    max_leaves=12,
)


@st.composite
def record_docs(draw):
    """Record JSON that checks out (a valid checksum) but says anything: tensors outside the
    payload, unknown dtypes, shapes that do not fit, wrong types anywhere."""
    tensor = st.fixed_dictionaries(
        {
            "name": JSONISH,
            "dtype": st.sampled_from(["float32", "int64", "uint8", "complex128", "pickle"])
            | JSONISH,
            "shape": st.lists(st.integers(-3, 2**40), max_size=3) | JSONISH,
            "offset": st.integers(-8, 2**62) | JSONISH,
            "nbytes": st.integers(-8, 2**62) | JSONISH,
        }
    )
    doc = draw(st.fixed_dictionaries({"scalars": JSONISH, "tensors": st.lists(tensor, max_size=3)})
               | JSONISH)  # fmt: skip
    return json.dumps(doc).encode()


@FUZZ
@given(meta=record_docs(), payload=st.binary(max_size=256))
def test_a_record_with_a_valid_checksum_and_hostile_json_is_refused_or_read(meta, payload):
    try:
        (rec,) = iter_records(io.BytesIO(_record_bytes(9, meta, payload)))
    except DiffLogFormatError:
        return
    for t in rec.tensors.values():  # what was read lies in the payload
        assert t.untyped_storage().nbytes() <= max(len(payload), 1)


@FUZZ
@given(
    claimed=st.integers(0, 2**64 - 1),
    present=st.binary(max_size=64),
    meta_len=st.integers(0, 2**32 - 1),
)
def test_lengths_that_claim_more_than_is_there_allocate_nothing_of_it(claimed, present, meta_len):
    """A record header claiming up to 2**64 bytes of payload, or of JSON, over a few bytes: a
    clear error, without allocating what it claims."""
    head = struct.pack("<4sQIQ", b"REC\0", 1, meta_len, claimed)
    with pytest.raises(DiffLogFormatError):
        list(iter_records(_NoBigReads(head + present)))


class _NoBigReads(io.BytesIO):
    """A stream that fails a test asking it for more than a terabyte at once."""

    def read(self, n: int | None = -1) -> bytes:
        assert n is None or n < TERABYTE, f"asked to read {n} bytes at once"
        return super().read(n)


# ------------------------------------------------------------------------- keeper frames


def _frame(header: bytes, payload: bytes, payload_len: int | None = None) -> bytes:
    claimed = len(payload) if payload_len is None else payload_len
    return wire.FRAME.pack(len(header), claimed) + header + payload


def _parse(data: bytes, tmp_path: Path):
    """Feed ``data`` then end-of-stream to the keeper's parser (header, then the payload:
    tensors into files when the header describes some)."""
    a, b = socket.socketpair()
    a.settimeout(30)
    b.settimeout(30)
    writer = threading.Thread(target=lambda: (b.sendall(data), b.shutdown(socket.SHUT_WR)))
    writer.start()
    try:
        header, n = wire.recv_header(a)
        if any(True for _ in wire.tensor_specs(header)):
            got = wire.receive(a, n, header, str(tmp_path))
            got.release()
            return header, None
        return header, wire.recv_exact(a, n)
    finally:
        writer.join(30)
        a.close()
        b.close()


FRAME_ERRORS = (ConnectionError, ValueError)


@st.composite
def frames(draw) -> bytes:
    header = draw(
        st.fixed_dictionaries(
            {
                "op": st.text(max_size=8),
                "base": st.fixed_dictionaries(
                    {
                        "shape": st.lists(st.integers(-2, 2**20), max_size=3) | JSONISH,
                        "dtype": st.sampled_from(["float32", "uint8", "bogus"]) | JSONISH,
                        "offset": st.integers(-4, 2**40) | JSONISH,
                    }
                ),
            }
        )
        | JSONISH
    )
    doc = json.dumps(header).encode()
    payload = draw(st.binary(max_size=512))
    data = _frame(doc, payload, payload_len=draw(st.none() | st.integers(0, 2**64 - 1)))
    cut = draw(st.none() | st.integers(0, len(data)))
    return data if cut is None else data[:cut]


@FUZZ
@given(data=frames() | st.binary(max_size=512))
def test_a_hostile_keeper_frame_gives_a_clear_error_never_a_crash_or_a_hang(tmp_path, data):
    try:
        header, payload = _parse(data, tmp_path)
    except FRAME_ERRORS:
        assert not list(tmp_path.glob("in-*"))  # the files of a failed receive are removed
        return
    assert isinstance(header, dict)
    assert payload is None or len(payload) <= len(data)
