"""The keeper's messages on the wire: frames, and payloads whose tensors travel as files.

Every message between a rank and its keeper, or between two keepers of a ring, is a frame
(``<IQ``: the JSON header's length, the payload's), the header, then the payload. A payload is
bytes; or, for what a keeper copies to another (a kept base, a replica, an iteration's dense
snapshot), a :class:`Parts`: bytes and tensor files of the keeper's shared-memory folder, sent in
order straight from the files (``sendfile``), never joined in the process's heap. The receiver
of such a message (:func:`receive`) writes each tensor its header describes (a
``{"shape", "dtype", "offset"}`` spec, anywhere in the header) into a new file of its own
shared-memory folder as the bytes arrive, and keeps in memory only the bytes between them
(records, counters, snapshot buckets). So a copy of a large model's shard (12 bytes per
parameter: 10 GiB per rank at 7B over 8 ranks) costs neither keeper its size again in heap,
and has no limit of its own: the keepers' caps bound it.

Any thread; a socket is used by one thread at a time (the callers serialise).
"""

from __future__ import annotations

import copy
import json
import os
import socket
import struct
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_diffckpt.shared_replica import (
    DTYPE_NAMES,
    create_tensor,
    remove_files,
    specs_of,
    tensor_nbytes,
)

FRAME = struct.Struct("<IQ")  # JSON length, payload length (a replica or base: past 4 GiB)
MAX_JSON = 1 << 20


class Parts:
    """A payload of bytes and tensor files, in order. The files are its own (hard links to a
    kept base's files, which never change, or copies of a replica's, which do: taken when the
    message is made, so that it is one iteration's state), in ``folder``; :meth:`release`
    removes them (and calls ``on_release``: the sender's accounting), once the message was sent
    or dropped. Until then it can be sent again (a retry)."""

    def __init__(self, folder: str, on_release: Callable[[], None] | None = None):
        self.folder = folder
        self.nbytes = 0
        self._items: list[bytes | tuple[str, int]] = []
        self._files: list[str] = []
        self._on_release = on_release

    def __len__(self) -> int:
        return self.nbytes

    def add(self, data: bytes) -> list[int]:
        """Append ``data``; its ``[offset, length]`` in the payload."""
        where = [self.nbytes, len(data)]
        if data:
            self._items.append(bytes(data))
            self.nbytes += len(data)
        return where

    def link(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Append the tensor in ``spec["file"]`` (a file that never changes) by a hard link:
        no bytes are copied, and the tensor outlives its holder's removing the file. Its spec
        for the receiver (``offset`` in place of ``file``)."""
        path = self._new_file()
        os.link(spec["file"], path)
        return self._add_file(path, spec)

    def copy(self, tensor: torch.Tensor) -> dict[str, Any]:
        """Append a copy of ``tensor`` as it is now, in a new file. Its spec for the receiver."""
        spec = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}
        path = self._new_file()
        create_tensor({**spec, "file": path}).copy_(tensor.detach())
        return self._add_file(path, spec)

    def packed(
        self, description: list[Any], tensors: list[torch.Tensor] | None = None
    ) -> list[Any]:
        """``description`` (:func:`~megatron_diffckpt.shared_replica.describe`'s) with each
        tensor spec appended: copied from ``tensors`` (in
        :func:`~megatron_diffckpt.shared_replica.specs_of` order), else linked from its file."""
        out = copy.deepcopy(description)
        specs = list(specs_of(out))
        sources = tensors if tensors is not None else [None] * len(specs)
        for spec, tensor in zip(specs, sources, strict=True):
            placed = self.copy(tensor) if tensor is not None else self.link(spec)
            spec.pop("file", None)
            spec.update(placed)
        return out

    def received(self, header: dict[str, Any]) -> Received:
        """What :func:`receive` makes of this payload sent with ``header``, without a socket (a
        keeper handing itself what it would hand a peer): each tensor ``header`` describes keeps
        its file, the result's now (its spec names it in place of its offset); every other item
        becomes the result's bytes. The files not handed over stay this payload's (:meth:`release`
        removes them)."""
        items, at = {}, 0
        for item in self._items:
            items[at] = item
            at += len(item) if isinstance(item, bytes) else item[1]
        out = Received(self.folder)
        try:
            for spec in sorted(tensor_specs(header), key=lambda s: s["offset"]):
                start, size = int(spec.pop("offset")), tensor_nbytes(spec)
                if size == 0:  # no item of its own: an empty file, as receive makes
                    spec["file"] = os.path.join(self.folder, f"in-{uuid.uuid4().hex}")
                    out.files.add(spec["file"])
                    create_tensor(spec)
                    continue
                item = items.pop(start, None)
                if not (isinstance(item, tuple) and item[1] == size):
                    raise ValueError(f"no tensor file at bytes {start}..{start + size}")
                self._files.remove(item[0])
                out.files.add(item[0])
                spec["file"] = item[0]
            for start, item in items.items():
                if not isinstance(item, bytes):
                    with open(item[0], "rb") as f:
                        item = f.read()
                out._gaps.append((start, bytearray(item)))
        except BaseException:
            out.release()
            raise
        return out

    def send(self, sock: socket.socket) -> None:
        """The payload's bytes, in order (files by ``sendfile``: kernel to kernel)."""
        for item in self._items:
            if isinstance(item, bytes):
                sock.sendall(item)
                continue
            path, n = item
            with open(path, "rb") as f:
                sent = sock.sendfile(f, 0, n)
            if sent != n:  # the stream is broken now: the receiver waits for bytes never sent
                raise OSError(f"{path} ended after {sent} of its {n} bytes")

    def release(self) -> None:
        """Remove its files; once."""
        files, self._files, self._items = self._files, [], []
        remove_files(files, self.folder)
        if self._on_release is not None:
            on_release, self._on_release = self._on_release, None
            on_release()

    def _new_file(self) -> str:
        path = os.path.join(self.folder, f"out-{uuid.uuid4().hex}")
        self._files.append(path)  # removed by release, made or not
        return path

    def _add_file(self, path: str, spec: dict[str, Any]) -> dict[str, Any]:
        n = tensor_nbytes(spec)
        placed = {"shape": list(spec["shape"]), "dtype": spec["dtype"], "offset": self.nbytes}
        if "sum" in spec:  # a sealed file's checksum travels with it, checked where it is used
            placed["sum"] = spec["sum"]
        if n:
            self._items.append((path, n))
            self.nbytes += n
        return placed


class Received:
    """A payload :func:`receive` took: its tensors in files (``files``, named in the header's
    specs), the bytes between them here (:meth:`span`). The files are removed by
    :meth:`release` unless :meth:`claim` gave them to a holder first."""

    def __init__(self, folder: str):
        self.folder = folder
        self.files: set[str] = set()
        self._gaps: list[tuple[int, bytearray]] = []

    def span(self, start: int, n: int) -> memoryview:
        """The payload's bytes ``[start, start + n)``, which lie between two of its tensors."""
        for offset, data in self._gaps:
            if offset <= start and start + n <= offset + len(data):
                return memoryview(data)[start - offset : start - offset + n]
        raise ValueError(f"bytes {start}..{start + n} of the message are not plain bytes")

    def claim(self, files: set[str]) -> None:
        """``files`` are a holder's now: :meth:`release` leaves them."""
        self.files -= files

    def release(self) -> None:
        remove_files(self.files, self.folder)
        self.files = set()


def span(payload: bytes | bytearray | Received, start: int, n: int) -> memoryview:
    """Bytes ``[start, start + n)`` of a payload, received whole or by :func:`receive`."""
    if isinstance(payload, Received):
        return payload.span(start, n)
    if start + n > len(payload):
        raise ValueError(f"bytes {start}..{start + n} of a message of {len(payload)}")
    return memoryview(payload)[start : start + n]


def tensor_specs(header: Any) -> Iterator[dict[str, Any]]:
    """Every ``{"shape", "dtype", "offset"}`` dict anywhere in ``header``: the tensors of the
    payload that :func:`receive` puts in files."""
    if isinstance(header, dict):
        if {"shape", "dtype", "offset"} <= header.keys():
            yield header
            return
        for value in header.values():
            yield from tensor_specs(value)
    elif isinstance(header, list):
        for value in header:
            yield from tensor_specs(value)


def send(sock: socket.socket, header: dict, payload: bytes | memoryview | Parts = b"") -> None:
    doc = json.dumps(header).encode()
    sock.sendall(FRAME.pack(len(doc), len(payload)) + doc)
    if isinstance(payload, Parts):
        payload.send(sock)
    elif payload:
        sock.sendall(payload)


RECV_CHUNK = 64 << 20


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """``n`` bytes from ``sock``; at most :data:`RECV_CHUNK` allocated ahead of what arrived
    (a frame claiming more than its peer sends costs what was sent)."""
    if n <= RECV_CHUNK:
        buf = bytearray(n)
        _recv_into(sock, memoryview(buf))
        return buf
    buf = bytearray()
    while len(buf) < n:
        chunk = bytearray(min(RECV_CHUNK, n - len(buf)))
        _recv_into(sock, memoryview(chunk), len(buf), n)
        buf += chunk
    return buf


def recv_header(sock: socket.socket) -> tuple[dict, int]:
    """A message's header (a JSON object) and its payload's length (the payload is next on
    ``sock``). Raises :class:`ConnectionError` when the stream ends or breaks,
    :class:`ValueError` for a header that is not one."""
    n, p = FRAME.unpack(recv_exact(sock, FRAME.size))
    if n > MAX_JSON:
        raise ConnectionError(f"keeper message header of {n} bytes exceeds {MAX_JSON}")
    try:
        header = json.loads(recv_exact(sock, n))
    except RecursionError:
        raise ValueError("keeper message header nested too deep") from None
    if not isinstance(header, dict):
        raise ValueError(f"keeper message header is a JSON {type(header).__name__}, not an object")
    return header, p


def recv(sock: socket.socket) -> tuple[dict, bytearray]:
    header, n = recv_header(sock)
    return header, recv_exact(sock, n)


def receive(sock: socket.socket, n: int, header: dict, folder: str) -> Received:
    """The payload of ``n`` bytes next on ``sock``, whose tensors ``header`` describes: each
    written into a new file of ``folder`` as it arrives (its spec names the file from then
    on, in place of its offset), the rest kept. On any failure, the files made are removed."""
    specs = sorted((_checked(s) for s in tensor_specs(header)), key=lambda s: s["offset"])
    out, at = Received(folder), 0
    try:
        for spec in specs:
            start, size = int(spec["offset"]), tensor_nbytes(spec)
            if start < at or start + size > n:
                raise ValueError(f"a tensor at bytes {start}..{start + size} of a message of {n}")
            if start > at:
                out._gaps.append((at, recv_exact(sock, start - at)))
            path = os.path.join(folder, f"in-{uuid.uuid4().hex}")
            out.files.add(path)
            spec.pop("offset")
            spec["file"] = path
            tensor = create_tensor(spec)
            if size:
                _recv_into(sock, memoryview(tensor.view(-1).view(torch.uint8).numpy()))
            del tensor
            at = start + size
        if at < n:
            out._gaps.append((at, recv_exact(sock, n - at)))
    except BaseException:
        out.release()
        raise
    return out


def _checked(spec: dict[str, Any]) -> dict[str, Any]:
    """A tensor spec of a received header, checked to be one (``ValueError`` otherwise)."""
    shape, offset = spec["shape"], spec["offset"]
    if not (
        isinstance(shape, list)
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        and isinstance(offset, int) and offset >= 0
        and isinstance(spec["dtype"], str) and spec["dtype"] in DTYPE_NAMES
    ):  # fmt: skip
        raise ValueError(f"a tensor spec of a keeper message is not one: {spec!r:.200}")
    return spec


def _recv_into(sock: socket.socket, view: memoryview, before: int = 0, total: int = 0) -> None:
    """Fill ``view`` from ``sock`` (bytes ``before`` on of a message of ``total``, for the
    error's words)."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError(
                f"the keeper's peer closed the connection ({before + got} of "
                f"{max(total, before + n)} bytes)"
            )
        got += k


def rank_name(key: tuple) -> str:
    """``rank_T_P_D`` of an identity key (a rank's folder in the diff log)."""
    who = dict(key)
    return f"rank_{who['tp_rank']}_{who['pp_rank']}_{who['dp_rank']}"
