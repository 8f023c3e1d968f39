"""Segment bytes: round trip, and every kind of damage is caught by header or checksum."""

from __future__ import annotations

import io
import json
import struct

import pytest
import torch

from megatron_diffckpt.storage.format import (
    DiffLogFormatError,
    DiffRecord,
    SegmentHeader,
    SegmentIdentity,
    encode_file_header,
    encode_record,
    iter_records,
    read_header,
    write_segment,
)

IDENTITY = SegmentIdentity("run-a", tp_rank=0, pp_rank=1, dp_rank=0, layout_hash="abc123")


def _records(first: int, n: int) -> list[DiffRecord]:
    g = torch.Generator().manual_seed(first)
    return [
        DiffRecord(
            iteration=first + i,
            scalars={"lr": 1e-3 * (i + 1), "skipped": False, "loss_scale": 1.0},
            tensors={
                "values": torch.randn(50, generator=g),
                "indices": torch.randint(0, 1000, (50,), dtype=torch.int32, generator=g),
                "bf16": torch.randn(3, 4, generator=g).bfloat16(),
                "empty": torch.empty(0),
            },
        )
        for i in range(n)
    ]


def _segment(records) -> bytes:
    buf = io.BytesIO()
    header = SegmentHeader(
        IDENTITY, "topk", records[0].iteration, records[-1].iteration, len(records)
    )
    write_segment(buf, header, records)
    return buf.getvalue()


def _read(data: bytes) -> tuple[SegmentHeader, list[DiffRecord]]:
    f = io.BytesIO(data)
    header = read_header(f)
    return header, list(iter_records(f))


def test_round_trip_is_exact():
    records = _records(11, 3)
    header, back = _read(_segment(records))
    assert header.identity == IDENTITY and header.compressor == "topk"
    assert (header.first_iteration, header.last_iteration, header.num_records) == (11, 13, 3)
    for a, b in zip(records, back, strict=True):
        assert a.iteration == b.iteration and a.scalars == b.scalars
        assert a.tensors.keys() == b.tensors.keys()
        for k in a.tensors:
            assert a.tensors[k].dtype == b.tensors[k].dtype
            assert torch.equal(a.tensors[k], b.tensors[k]), k


def test_payload_is_raw_bytes_not_pickle():
    data = _segment(_records(1, 1))
    assert b"\x80\x04" not in data[:64]  # no pickle protocol header up front
    values = _records(1, 1)[0].tensors["values"]
    assert values.numpy().tobytes() in data


def _flip(data: bytes, position: int) -> bytes:
    b = bytearray(data)
    b[position] ^= 0x10
    return bytes(b)


def test_bit_flip_in_payload_is_caught_after_the_valid_records():
    data = _segment(_records(1, 3))
    second_start = len(_segment(_records(1, 1)))  # header + first record
    flipped = _flip(data, second_start + 200)
    f = io.BytesIO(flipped)
    read_header(f)
    it = iter_records(f)
    assert next(it).iteration == 1
    with pytest.raises(DiffLogFormatError, match="iteration 2"):
        next(it)


def test_bit_flip_in_header_is_caught():
    with pytest.raises(DiffLogFormatError, match="header checksum"):
        _read(_flip(_segment(_records(1, 1)), 20))


@pytest.mark.parametrize("cut", [5, 30, -1, -7, -300])
def test_truncation_is_caught(cut):
    data = _segment(_records(1, 2))
    with pytest.raises(DiffLogFormatError, match="truncated"):
        _read(data[:cut])


def test_not_a_segment():
    with pytest.raises(DiffLogFormatError, match="not a diff log segment"):
        _read(b"PK\x03\x04" + bytes(100))


def test_unknown_version_is_refused_with_advice():
    data = bytearray(_segment(_records(1, 1)))
    struct.pack_into("<H", data, 8, 99)
    with pytest.raises(DiffLogFormatError, match="version 99 is not supported"):
        _read(bytes(data))


def test_absurd_lengths_are_refused_before_allocating():
    data = bytearray(_segment(_records(1, 1)))
    struct.pack_into("<I", data, 10, 2**31)
    with pytest.raises(DiffLogFormatError, match="exceeds"):
        _read(bytes(data))


def test_unsupported_dtype_is_refused_at_write():
    rec = DiffRecord(1, {}, {"x": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(ValueError, match="not supported"):
        _segment([rec])


def test_header_json_is_plain_data():
    data = _segment(_records(1, 1))
    (n,) = struct.unpack_from("<I", data, 10)
    doc = json.loads(data[14 : 14 + n])
    assert doc["identity"]["layout_hash"] == "abc123" and doc["format_version"] == 1


def test_a_header_padded_to_its_room_reads_as_the_plain_one():
    """A writer that serialised the records after a room for the header (the diff log writer
    with ``serialise_at_append``) fills it exactly: the padded header reads back the same, the
    records follow it, and a header that cannot fit is refused, not cut."""
    records = _records(5, 2)
    header = SegmentHeader(IDENTITY, "none", 5, 6, 2)
    padded = encode_file_header(header, 1024)
    assert len(padded) == 1024 and len(encode_file_header(header)) < 1024
    back_header, back = _read(padded + b"".join(encode_record(r) for r in records))
    assert back_header == header and [r.iteration for r in back] == [5, 6]
    assert torch.equal(back[1].tensors["values"], records[1].tensors["values"])
    damaged = bytearray(padded)
    damaged[1000] = ord("x")  # the padding is under the header's checksum too
    with pytest.raises(DiffLogFormatError):
        read_header(io.BytesIO(bytes(damaged)))
    with pytest.raises(ValueError, match="exceeds"):
        encode_file_header(header, 100)


def test_the_checksum_is_zlib_ngs_and_either_crc_reads_what_the_other_wrote(monkeypatch):
    """zlib-ng (a pinned dependency) computes the checksums; a segment written with zlib's
    CRC-32 (where zlib-ng has no wheel) reads back with zlib-ng's, and the other way round."""
    import zlib

    from zlib_ng import zlib_ng

    from megatron_diffckpt.storage import format as fmt

    assert fmt.crc32 is zlib_ng.crc32
    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator())
    view = memoryview(data.numpy())
    assert zlib_ng.crc32(view) == zlib.crc32(view)
    assert zlib_ng.crc32(view[7:], 0xDEADBEEF) == zlib.crc32(view[7:], 0xDEADBEEF)
    records = _records(5, 2)
    for writer, reader in ((zlib.crc32, zlib_ng.crc32), (zlib_ng.crc32, zlib.crc32)):
        monkeypatch.setattr(fmt, "crc32", writer)
        segment = _segment(records)
        monkeypatch.setattr(fmt, "crc32", reader)
        _, back = _read(segment)
        assert [r.iteration for r in back] == [5, 6]
        assert all(torch.equal(a.tensors["values"], b.tensors["values"])
                   for a, b in zip(records, back, strict=True))  # fmt: skip
        with pytest.raises(DiffLogFormatError, match="iteration 6"):
            _read(_flip(segment, len(segment) - 40))
