"""The diff log's segment format: a versioned header and raw tensor bytes, never pickle.

A segment holds the differentials of consecutive iterations of one rank, written in one piece and
published by atomic rename, so a reader never sees a half-written segment under its final name.
Corruption after publication (truncation, bit flips, another rank's or run's file) is caught by
the header's identity and the per-record checksums. Everything is little-endian::

    segment   = file_header records*
    file_header:
        8s   magic  b"DIFFSEG\\0"
        u16  format version (FORMAT_VERSION)
        u32  n, the length of the header JSON
        n    header JSON (UTF-8): identity, compressor, first/last iteration, record count
        u32  CRC-32 of the header JSON
    record:
        4s   magic  b"REC\\0"
        u64  iteration
        u32  m, the length of the record JSON
        u64  p, the length of the payload
        m    record JSON: {"scalars": {...}, "tensors": [{name, dtype, shape, offset, nbytes}]}
        p    payload: the tensors' raw bytes, concatenated
        u32  CRC-32 of everything of the record before it

Parsing allocates only what the checksummed lengths describe and the file holds, looks dtypes
up in a fixed table, and never evaluates anything it reads (``tests/test_fuzz.py``).

The checksum is zlib's CRC-32; zlib-ng computes the same values with vector instructions (6.9 GB/s
against zlib's 1.96 on the CI machines' cores, over 200 MB: the gradients of a 50M-parameter
shard, which LowDiff+ logs every iteration) and without the GIL. It is used where installed (a
dependency of the package), zlib elsewhere: either reads what the other wrote.
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, BinaryIO

import torch

from megatron_diffckpt.errors import DiffCkptError

try:
    from zlib_ng.zlib_ng import crc32
except ImportError:  # no wheel for this platform: the same checksum, slower
    from zlib import crc32

MAGIC = b"DIFFSEG\0"
RECORD_MAGIC = b"REC\0"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)

_FILE_HEAD = struct.Struct("<8sHI")  # magic, version, header length
_RECORD_HEAD = struct.Struct("<4sQIQ")  # magic, iteration, json length, payload length
_CRC = struct.Struct("<I")
# Bounds on lengths read from a file, so a damaged length cannot ask for absurd allocations.
MAX_JSON_BYTES = 16 << 20

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class DiffLogFormatError(DiffCkptError, ValueError):
    """A segment is damaged, truncated, of an unknown version, or not a segment at all."""


class ForeignSegmentError(DiffLogFormatError):
    """A valid segment that belongs to another rank, run or shard layout."""


@dataclass(frozen=True)
class SegmentIdentity:
    """Whose differentials a segment holds; a reader refuses a segment whose identity differs.

    Attributes:
        run_id: identifies the training run (set once, saved with every base).
        tp_rank, pp_rank, dp_rank: the rank's coordinates.
        layout_hash: hash of the rank's optimizer shard layout (parameter ranges and dtypes),
            so a segment is never replayed into a differently sharded optimizer.
    """

    run_id: str
    tp_rank: int
    pp_rank: int
    dp_rank: int
    layout_hash: str

    def dirname(self) -> str:
        """``rank_<tp>_<pp>_<dp>``: the rank's folder in the diff log."""
        return f"rank_{self.tp_rank}_{self.pp_rank}_{self.dp_rank}"


@dataclass
class DiffRecord:
    """The differential of one iteration on one rank: step scalars and named tensors (CPU)."""

    iteration: int
    scalars: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class EncodedRecord:
    """A record already in the diff log's encoding (:func:`encode_record`): what the node's
    keeper holds, and writes into segments as it is (no decoding, no second checksum). A
    ``memoryview`` ``data`` (a writer's staging buffer, handed to its sink) is valid only during
    the call it is handed to."""

    iteration: int
    data: bytes | bytearray | memoryview

    @classmethod
    def of(cls, iteration: int, data: bytes | bytearray) -> EncodedRecord:
        """``data`` checked to frame exactly one record of ``iteration`` (its checksum is the
        reader's to check); raises :class:`DiffLogFormatError`."""
        if len(data) < _RECORD_HEAD.size + _CRC.size:
            raise DiffLogFormatError(f"an encoded record of {len(data)} bytes is truncated")
        magic, it, m, p = _RECORD_HEAD.unpack_from(data)
        if magic != RECORD_MAGIC or it != iteration:
            raise DiffLogFormatError(
                f"not an encoded record of iteration {iteration} (magic {magic!r}, iteration {it})"
            )
        if len(data) != _RECORD_HEAD.size + m + p + _CRC.size:
            raise DiffLogFormatError(
                f"the encoded record of iteration {iteration} frames {m + p} bytes, "
                f"holds {len(data) - _RECORD_HEAD.size - _CRC.size}"
            )
        return cls(iteration, data)


@dataclass(frozen=True)
class SegmentHeader:
    identity: SegmentIdentity
    compressor: str
    first_iteration: int
    last_iteration: int
    num_records: int
    format_version: int = FORMAT_VERSION


def segment_filename(first: int, last: int) -> str:
    return f"seg_{first:010d}_{last:010d}.bin"


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous()
    if t.device.type != "cpu":
        raise ValueError(f"diff log tensors must be on the CPU, got {t.device}")
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(b"")


def write_segment(
    f: BinaryIO, header: SegmentHeader, records: list[DiffRecord] | list[EncodedRecord]
) -> int:
    """Serialise a segment to ``f``; returns the bytes written. Any rank."""
    written = f.write(encode_file_header(header))
    for rec in records:
        written += f.write(rec.data) if isinstance(rec, EncodedRecord) else write_record(f, rec)
    return written


def encode_file_header(header: SegmentHeader, size: int | None = None) -> bytes:
    """The segment's file header; ``size``: exactly that many bytes, the JSON padded with
    spaces (which a JSON reader skips), for a writer that put the records after a room of
    that size before it knew the segment's last iteration. Raises ``ValueError`` when the
    header does not fit in ``size``."""
    head_json = json.dumps(dict(asdict(header)), sort_keys=True).encode()
    if size is not None:
        room = size - _FILE_HEAD.size - _CRC.size
        if len(head_json) > room:
            raise ValueError(f"a segment header of {len(head_json)} bytes exceeds {room}")
        head_json += b" " * (room - len(head_json))
    head = _FILE_HEAD.pack(MAGIC, header.format_version, len(head_json))
    return head + head_json + _CRC.pack(crc32(head_json))


def encode_record(rec: DiffRecord) -> bytes:
    """``rec`` as a segment holds it (header, JSON, payload, checksum): what the node's keeper
    holds; :func:`iter_records` reads such records back."""
    buf = io.BytesIO()
    write_record(buf, rec)
    return buf.getvalue()


_CRC_CHUNK = 256 << 10
"""Payload bytes checksummed, then written, at a time: the write reads them from the cache the
checksum left them in, so the payload crosses memory once, not twice."""


def write_record(f: BinaryIO, rec: DiffRecord) -> int:
    """Serialise one record to ``f`` (what :func:`encode_record` returns); the bytes written."""
    descs, views, offset = [], [], 0
    for name, t in rec.tensors.items():
        if t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensor {name}: dtype {t.dtype} is not supported by the diff log")
        view = _tensor_bytes(t)
        descs.append(
            {
                "name": name,
                "dtype": _DTYPE_NAMES[t.dtype],
                "shape": list(t.shape),
                "offset": offset,
                "nbytes": view.nbytes,
            }
        )
        views.append(view)
        offset += view.nbytes
    meta = json.dumps({"scalars": rec.scalars, "tensors": descs}, sort_keys=True).encode()
    head = _RECORD_HEAD.pack(RECORD_MAGIC, rec.iteration, len(meta), offset)
    crc = crc32(meta, crc32(head))
    n = f.write(head) + f.write(meta)
    for view in views:
        for start in range(0, view.nbytes, _CRC_CHUNK):
            with view[start : start + _CRC_CHUNK] as piece:
                crc = crc32(piece, crc)
                n += f.write(piece)
    return n + f.write(_CRC.pack(crc))


_READ_CHUNK = 64 << 20


def _read_exact(f: BinaryIO, n: int, what: str) -> bytes | bytearray:
    """``n`` bytes of ``f``, read at most :data:`_READ_CHUNK` at a time: a damaged length that
    claims more than the file holds costs what is there, not what it claims."""
    if n <= _READ_CHUNK:
        data: bytes | bytearray = f.read(n)
    else:
        data = bytearray()
        while len(data) < n:
            piece = f.read(min(_READ_CHUNK, n - len(data)))
            if not piece:
                break
            data += piece
    if len(data) != n:
        raise DiffLogFormatError(f"truncated {what}: expected {n} bytes, found {len(data)}")
    return data


def read_header(f: BinaryIO) -> SegmentHeader:
    """Parse and check the file header. Raises :class:`DiffLogFormatError` when invalid."""
    magic, version, n = _FILE_HEAD.unpack(_read_exact(f, _FILE_HEAD.size, "file header"))
    if magic != MAGIC:
        raise DiffLogFormatError(f"not a diff log segment (magic {magic!r}, expected {MAGIC!r})")
    if version not in SUPPORTED_VERSIONS:
        raise DiffLogFormatError(
            f"segment format version {version} is not supported (this reader supports "
            f"{SUPPORTED_VERSIONS}); read it with the version that wrote it"
        )
    if n > MAX_JSON_BYTES:
        raise DiffLogFormatError(f"header length {n} exceeds {MAX_JSON_BYTES}")
    head_json = _read_exact(f, n, "header")
    (crc,) = _CRC.unpack(_read_exact(f, _CRC.size, "header checksum"))
    if crc != crc32(head_json):
        raise DiffLogFormatError("header checksum mismatch")
    try:
        head = json.loads(head_json)
        return SegmentHeader(identity=SegmentIdentity(**head.pop("identity")), **head)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        raise DiffLogFormatError(f"malformed header: {exc}") from None


def iter_records(f: BinaryIO) -> Iterator[DiffRecord]:
    """Yield records after the header until the end of ``f``.

    Raises :class:`DiffLogFormatError` at the first damaged record, after yielding the valid ones
    before it.
    """
    while True:
        head = f.read(_RECORD_HEAD.size)
        if not head:
            return
        if len(head) != _RECORD_HEAD.size:
            raise DiffLogFormatError(f"truncated record header ({len(head)} bytes)")
        magic, iteration, m, p = _RECORD_HEAD.unpack(head)
        if magic != RECORD_MAGIC:
            raise DiffLogFormatError(f"bad record magic {magic!r}")
        if m > MAX_JSON_BYTES:
            raise DiffLogFormatError(f"record JSON length {m} exceeds {MAX_JSON_BYTES}")
        meta = _read_exact(f, m, f"record of iteration {iteration}")
        payload = _read_exact(f, p, f"payload of iteration {iteration}")
        payload = payload if isinstance(payload, bytearray) else bytearray(payload)
        (crc,) = _CRC.unpack(_read_exact(f, _CRC.size, "record checksum"))
        if crc != crc32(payload, crc32(meta, crc32(head))):
            raise DiffLogFormatError(f"checksum mismatch in the record of iteration {iteration}")
        yield _decode_record(iteration, meta, payload)


def _decode_record(iteration: int, meta: bytes, payload: bytearray) -> DiffRecord:
    try:
        doc = json.loads(meta)
        tensors = {}
        for d in doc["tensors"]:
            dtype = _DTYPES[d["dtype"]]
            start, nbytes = int(d["offset"]), int(d["nbytes"])
            if start < 0 or start + nbytes > len(payload):
                raise ValueError(f"tensor {d['name']} lies outside the payload")
            raw = (
                torch.frombuffer(payload, dtype=torch.uint8, offset=start, count=nbytes)
                if nbytes
                else torch.empty(0, dtype=torch.uint8)
            )
            tensors[d["name"]] = raw.view(dtype).reshape(d["shape"])
        return DiffRecord(iteration, doc["scalars"], tensors)
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise DiffLogFormatError(f"malformed record of iteration {iteration}: {exc}") from None
