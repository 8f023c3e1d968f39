"""LowDiff+'s base files written by the node's keeper: no base writing in the ranks.

With LowDiff+'s replica in the keeper (``--diffckpt-option keeper_replica``), a base is still
planned by the ranks as for any asynchronous save (megatron's planner and its write buckets:
which tensor goes into which file, under which key; the optimizer state in per-bucket tensors
megatron builds for it) and published by them (the collective finalize, metadata last). What
takes the cores in between is the writing: serialising every tensor, writing and syncing the
files. That part runs in the keeper:

1. The rank (:class:`HandedWrites`, on its persister thread, over a connection of its own)
   stages every tensor of the write plan in a :class:`StagingArea` (buffers in the keeper's
   shared-memory folder, one per storage, reused base after base: one host memcpy) and sends
   the writer's name and its arguments, pickled with every staged tensor by reference (file,
   dtype, shape, strides, offset; none of its bytes travel) and the small ones by value.
2. The keeper (:class:`KeeperWrites`) has a writer process of the rank's (started when the
   rank connects, at lower CPU priority, megatron imported once) map the files and call the
   writer, and replies with its result: megatron's write results, or the error a file hit.
   The rank hands it to megatron's finalize step as if it had written the files: same files,
   same bytes (a tensor's whole storage is staged, its offset and strides kept).

Trust: a request names its writer, one of :data:`WRITERS`; its arguments are read by an
unpickler that resolves no function, only the plain classes a write plan is made of (torch
DCP's planner items, dtypes, layouts, sizes, ``io.BytesIO``); tensors never go through torch's
own unpickling, and a referenced file must lie in the keeper's folder. The keeper takes these
requests on its Unix socket only (a socket only its user can open), never from peers. The reply
is read by the rank with plain ``pickle``: it comes from its own node's keeper.

Failures: a keeper lost mid-write (the connection ends) leaves the rank to write every file
itself; a rank killed mid-write leaves the keeper to finish files that no finalize publishes
(metadata is written last, by the ranks, as for any base). The staging files are the rank's;
the keeper remembers the newest set each rank named and removes a set no later request names
(a restarted rank's predecessor's), and the whole folder when it stops.

Which threads: :class:`HandedWrites` is called by one rank thread at a time (the persister);
:class:`KeeperWrites` by the keeper's connection threads, one write per rank at a time, each
rank's in its writer process.
"""

from __future__ import annotations

import importlib
import io
import logging
import multiprocessing
import os
import pickle
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from megatron_diffckpt.background import die_with_parent, lower_priority
from megatron_diffckpt.keeper.protocol import Op
from megatron_diffckpt.keeper.wire import rank_name
from megatron_diffckpt.shared_replica import SharedArena, remove_files, tensor_bytes

logger = logging.getLogger(__name__)

WRITERS = ("megatron_diffckpt.patches.base_checkpoint:write_files",)
"""The writers a keeper runs (``module:function``); the keeper imports a writer's module when a
rank first names it (megatron's, for a base's files)."""

_BUILTINS = frozenset({"set", "frozenset", "slice", "bytearray", "complex"})
_CLASSES = frozenset({("collections", "OrderedDict"), ("_io", "BytesIO"), ("io", "BytesIO")})
_PLAN_MODULE = "torch.distributed.checkpoint"


def writer_name(writer: Callable[..., Any]) -> str:
    return f"{writer.__module__}:{writer.__qualname__}"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(f"not a torch dtype: {name!r}")
    return dtype


STAGE_MIN_BYTES = 64 * 1024
"""Tensors smaller than this travel by value (a file each would cost more than the bytes)."""


class StagingArea:
    """Buffers in the keeper's shared-memory folder that a rank stages its base's tensors in.

    A tensor is staged with its whole storage (its offset and strides kept, so the keeper's
    ``torch.save`` writes the same bytes), or as a contiguous copy when its storage is over
    twice its size (a narrow view). Buffers are kept by size and reused by the next base, whose
    plan is the same: :meth:`begin` starts a new round. The rank's persister thread."""

    def __init__(self, folder: str):
        self.arena = SharedArena(folder)
        self._buffers: dict[int, list[torch.Tensor]] = {}
        self._used: dict[int, int] = {}

    def begin(self) -> None:
        self._used = {}

    def stage(self, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """``(file, staged)``: ``tensor``'s copy over a buffer of this area."""
        nbytes = tensor.numel() * tensor.element_size()
        narrow = tensor.untyped_storage().nbytes() > 2 * nbytes
        buffer = self._buffer(nbytes if narrow else tensor.untyped_storage().nbytes())
        if narrow:  # its elements only, copied straight into the buffer
            staged = buffer.view(tensor.dtype).view(tensor.shape)
            staged.copy_(tensor)
        else:
            buffer.untyped_storage().copy_(tensor.untyped_storage())
            staged = buffer.view(tensor.dtype).as_strided(
                tensor.shape, tensor.stride(), tensor.storage_offset()
            )
        return self.arena.spec(buffer)["file"], staged

    def _buffer(self, size: int) -> torch.Tensor:
        """This round's next buffer of ``size`` bytes (the last round's, or a new one)."""
        buffers = self._buffers.setdefault(size, [])
        index = self._used.get(size, 0)
        self._used[size] = index + 1
        if index == len(buffers):
            buffers.append(self.arena.empty((size,), torch.uint8))
        return buffers[index]

    def files(self) -> list[str]:
        return self.arena.files()

    @property
    def folder(self) -> str:
        return self.arena.folder


class _Pickler(pickle.Pickler):
    """Tensors staged and passed as references to their files, small ones as raw bytes (never
    torch's pickling)."""

    def __init__(self, file: io.BytesIO, staging: StagingArea | None):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.staging = staging
        self.by_reference = 0
        self.by_value = 0

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        tensor = obj.detach().cpu()
        dtype = str(tensor.dtype).removeprefix("torch.")
        nbytes = tensor.numel() * tensor.element_size()
        if self.staging is not None and nbytes >= STAGE_MIN_BYTES:
            file, staged = self.staging.stage(tensor)
            self.by_reference += nbytes
            shape, stride = list(staged.shape), list(staged.stride())
            return ("file", file, dtype, shape, stride, staged.storage_offset())
        self.by_value += nbytes
        return ("bytes", dtype, list(tensor.shape), tensor_bytes(tensor))


class _Unpickler(pickle.Unpickler):
    """Reads what :class:`_Pickler` wrote, resolving only the names a write plan needs and
    mapping only files of ``folder``."""

    def __init__(self, file: io.BytesIO, folder: str, mapped: Mappings):
        super().__init__(file)
        self.folder = folder
        self.mapped = mapped

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _BUILTINS or (module, name) in _CLASSES:
            return super().find_class(module, name)
        if module == "torch" and name in ("Size", "device"):
            return super().find_class(module, name)
        if module == "torch":  # dtypes, layouts, memory formats (tensor properties)
            found = getattr(torch, name, None)
            if isinstance(found, torch.dtype | torch.layout | torch.memory_format):
                return found
            raise pickle.UnpicklingError(f"a write request may not name torch.{name}")
        if (module, name) == ("torch.serialization", "_get_layout"):  # a name -> a layout
            return super().find_class(module, name)
        if module == _PLAN_MODULE or module.startswith(_PLAN_MODULE + "."):
            found = super().find_class(module, name)
            if isinstance(found, type):  # a plan's classes (items, enums), no function
                return found
        raise pickle.UnpicklingError(f"a write request may not name {module}.{name}")

    def persistent_load(self, pid: Any) -> torch.Tensor:
        if pid[0] == "bytes":
            _, dtype, shape, raw = pid
            if not raw:
                return torch.empty(shape, dtype=_dtype(dtype))
            return torch.frombuffer(bytearray(raw), dtype=_dtype(dtype)).view(shape)
        if pid[0] != "file":
            raise pickle.UnpicklingError(f"unknown tensor reference {pid[0]!r}")
        _, file, dtype, shape, stride, offset = pid
        return self._map(file, _dtype(dtype)).as_strided(shape, stride, offset)

    def _map(self, file: str, dtype: torch.dtype) -> torch.Tensor:
        if os.path.dirname(os.path.abspath(file)) != self.folder:
            raise pickle.UnpicklingError(f"{file} is not in the keeper's folder {self.folder}")
        return self.mapped.get(file, dtype)


class Mappings:
    """The files a writer process has mapped, kept from one request to the next: a rank's
    staging buffers are the same files base after base, and the first touch of every page of a new
    mapping is a page fault (measured: 128 MB written in 0.20-0.23 s from new mappings, 0.10 s
    from the rank's own pages). A file replaced (another inode or size) is mapped again; a file
    the last request did not name is let go (its pages may be freed)."""

    def __init__(self) -> None:
        self._maps: dict[tuple[str, torch.dtype], tuple[tuple[int, int], torch.Tensor]] = {}
        self._used: set[tuple[str, torch.dtype]] = set()

    def get(self, file: str, dtype: torch.dtype) -> torch.Tensor:
        """The whole file as a flat tensor of ``dtype`` (mapped, never created: a file that is
        gone is an error, not a new zeroed one)."""
        stat = os.stat(file)  # FileNotFoundError: the rank removed it meanwhile
        if stat.st_size % dtype.itemsize:
            raise pickle.UnpicklingError(
                f"{file}: {stat.st_size} bytes is no whole number of {dtype}"
            )
        identity = (stat.st_ino, stat.st_size)
        self._used.add((file, dtype))
        known = self._maps.get((file, dtype))
        if known is not None and known[0] == identity:
            return known[1]
        count = stat.st_size // dtype.itemsize
        flat = torch.from_file(file, shared=True, size=count, dtype=dtype)
        self._maps[(file, dtype)] = (identity, flat)
        return flat

    def keep_used(self) -> None:
        """Let go of every file the request since the last call did not name."""
        for key in set(self._maps) - self._used:
            del self._maps[key]
        self._used = set()


def dumps(args: tuple, staging: StagingArea | None) -> tuple[bytes, int, int]:
    """``args`` pickled for a keeper, their tensors staged in ``staging`` (a new round); with
    the bytes staged and the bytes sent by value."""
    buf = io.BytesIO()
    if staging is not None:
        staging.begin()
    pickler = _Pickler(buf, staging)
    pickler.dump(args)
    return buf.getvalue(), pickler.by_reference, pickler.by_value


def loads(payload: bytes | bytearray, folder: str, mapped: Mappings | None = None) -> tuple:
    """What :func:`dumps` wrote, as the keeper reads it (see the module doc); files mapped
    through ``mapped`` (default: new mappings)."""
    mapped = mapped if mapped is not None else Mappings()
    try:
        return _Unpickler(io.BytesIO(payload), folder, mapped).load()
    finally:
        mapped.keep_used()


class HandedWrites:
    """The rank's side: ``handed(writer, *args)`` runs ``writer(*args)`` in the node's keeper and
    returns its result; where the keeper cannot (lost, or it failed before writing), here.

    ``client``: a :class:`~megatron_diffckpt.keeper.client.KeeperClient` of its own, without a
    timeout (a write takes what it takes; the handover thread keeps its own connection);
    ``staging``: where the tensors go for the keeper to read; ``warm``: a writer the keeper
    gets ready now.
    """

    def __init__(self, client: Any, staging: StagingArea, warm: Callable[..., Any] | None = None):
        self.client = client
        self.staging = staging
        if warm is not None:  # the keeper starts this rank's writer process and imports it now
            self.client.call({"op": Op.WRITE_FILES, "writer": writer_name(warm), "warm": True})
        self.in_keeper = 0
        """Writes the keeper ran."""
        self.here = 0
        """Writes this rank ran itself (its keeper lost or failing)."""
        self.last: dict[str, float] = {}
        """The last write in the keeper: seconds, bytes staged and sent by value."""
        self.last_in_keeper = False
        """Whether the last call ran in the keeper."""

    def __call__(self, writer: Callable[..., Any], *args: Any) -> Any:
        name = writer_name(writer)
        if name not in WRITERS:
            raise ValueError(f"{name} is not a writer the keeper runs ({', '.join(WRITERS)})")
        began = time.perf_counter()
        payload, referenced, copied = dumps(args, self.staging)
        request = {"op": Op.WRITE_FILES, "writer": name, "files": self.staging.files()}
        reply = self.client.call(request, payload)
        if reply is None or "error" in reply[0]:
            why = "the keeper is lost" if reply is None else reply[0]["error"]
            if not self.here:
                logger.warning("LowDiff+: this rank writes its base's files itself (%s)", why)
            self.here += 1
            self.last_in_keeper = False
            return writer(*args)
        self.in_keeper += 1
        self.last_in_keeper = True
        self.last = {
            "seconds": time.perf_counter() - began,
            "staged_bytes": referenced,
            "sent_bytes": copied,
        }
        return pickle.loads(reply[1])

    def close(self) -> None:
        """Remove the staging files (mappings stay valid) and end the connection."""
        remove_files(self.staging.files(), self.staging.folder)
        self.staging.arena.specs.clear()
        self.client.close()


class _WriterProcess:
    """A process of the keeper that runs one rank's writers (spawned: a fresh interpreter, no
    lock of the keeper's threads inherited). Each rank's writes run in a process of their own,
    as they did in the rank: one interpreter would serialise the ranks' ``torch.save`` calls.
    It dies with the keeper's thread that started it (the rank's connection), and runs at lower
    CPU priority."""

    def __init__(self, folder: str):
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(
            target=_serve_writes, args=(child, folder), name="diffckpt-keeper-writer", daemon=True
        )
        self.process.start()
        child.close()
        self.owner = _connection()
        """The connection (thread) that started it, and that it dies with."""
        self._warming = 0

    def warm(self, name: str) -> None:
        """Import the writer's module now (its first write then costs what later ones do)."""
        self._conn.send(("warm", name, b""))
        self._warming += 1

    def run(self, name: str, payload: bytes) -> tuple[bool, Any]:
        """``(True, the pickled result)`` or ``(False, why)``. Raises ``EOFError`` /
        ``OSError`` when the process is gone."""
        while self._warming:
            self._conn.recv()
            self._warming -= 1
        self._conn.send(("run", name, payload))
        return self._conn.recv()

    def close(self) -> None:
        """End it (it reads the end of its pipe and returns); idle, so at once."""
        self._conn.close()
        self.process.join(5)


_THREAD = threading.local()


def _connection() -> object:
    """A token of the calling thread (a keeper's connection): unlike its thread id, never the
    token of a thread that ended."""
    if not hasattr(_THREAD, "token"):
        _THREAD.token = object()
    return _THREAD.token


def _serve_writes(conn: Any, folder: str) -> None:
    """A writer process's loop (see :class:`_WriterProcess`); it ends when the keeper closes
    its end (or dies)."""
    die_with_parent()
    lower_priority()
    # megatron's import-time notes (no transformer-engine / apex) were the ranks' to print
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    mapped = Mappings()
    while True:
        try:
            op, name, payload = conn.recv()
            try:
                module, function = name.split(":")
                writer = getattr(importlib.import_module(module), function)
                if op == "warm":
                    reply: tuple[bool, Any] = (True, b"")
                else:
                    result = writer(*loads(payload, folder, mapped))
                    reply = (True, pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
            except Exception as exc:  # noqa: BLE001 - said to the rank, which writes itself
                reply = (False, f"{type(exc).__name__}: {exc}")
            conn.send(reply)
        except (EOFError, OSError):
            return


class KeeperWrites:
    """The keeper's side: runs the writers ranks hand over (see the module doc), each rank's in
    a :class:`_WriterProcess` of its own."""

    def __init__(self, folder: str):
        self.folder = folder
        self._lock = threading.Lock()
        self._rank_locks: dict[tuple, threading.Lock] = {}
        self._processes: dict[tuple, _WriterProcess] = {}
        self._files: dict[tuple, set[str]] = {}
        self._done: dict[tuple, dict[str, Any]] = {}

    def handle(self, key: tuple, req: dict, payload: bytearray) -> tuple[dict, bytes]:
        """One ``write_files`` request of the rank ``key``: ``({"ok"}, pickled result)`` or
        ``({"error"}, b"")`` when the writer could not be run (the rank then writes);
        ``"warm"``: start the rank's writer process and import the writer, answered at once."""
        name = req.get("writer")
        if name not in WRITERS:
            return {"error": f"the keeper runs no writer {name!r}"}, b""
        with self._lock:
            rank_lock = self._rank_locks.setdefault(key, threading.Lock())
        if req.get("warm"):
            if rank_lock.acquire(blocking=False):  # not while a predecessor's process writes
                try:
                    with self._lock:
                        self._process(key).warm(name)
                finally:
                    rank_lock.release()
            return {"ok": True}, b""
        with rank_lock:  # a restarted rank's write waits for its predecessor's
            self._own(key, set(req.get("files", ())))
            began = time.perf_counter()
            try:
                done, result = self._run(key, name, bytes(payload))
            except (EOFError, OSError) as exc:
                done, result = False, f"the keeper's writer process ended ({exc!r})"
            if not done:
                logger.warning("keeper: a write request of %s failed: %s", rank_name(key), result)
                return {"error": result}, b""
            self._done[key] = {
                "writes": self._done.get(key, {}).get("writes", 0) + 1,
                "last_s": time.perf_counter() - began,
            }
            return {"ok": True}, result

    def _process(self, key: tuple) -> _WriterProcess:
        """The rank's writer process of the calling connection, started by its thread (it
        dies with it); a predecessor's (another connection's, idle) is ended first. Under the
        rank's lock and ``_lock``."""
        process = self._processes.get(key)
        if process is not None and (
            process.owner is not _connection() or not process.process.is_alive()
        ):
            process.close()
            process = None
        if process is None:
            process = self._processes[key] = _WriterProcess(self.folder)
        return process

    def _run(self, key: tuple, name: str, payload: bytes) -> tuple[bool, Any]:
        """Under the rank's lock."""
        with self._lock:
            process = self._process(key)
        try:
            return process.run(name, payload)
        except (EOFError, OSError):
            # the process ended meanwhile: once more in a new one
            with self._lock:
                self._processes.pop(key).close()
                process = self._process(key)
            return process.run(name, payload)

    def close(self) -> None:
        """End the writer processes (the keeper stops)."""
        with self._lock:
            for process in self._processes.values():
                process.close()
            self._processes.clear()

    def _own(self, key: tuple, files: set[str]) -> None:
        """Remember ``files`` as the rank's; remove those of its earlier set it no longer
        names (never one outside the folder)."""
        before = self._files.get(key, set())
        remove_files(before - files, self.folder)
        self._files[key] = files

    def stats(self) -> list[dict[str, Any]]:
        rows = []
        for key, done in sorted(self._done.items()):
            files = self._files.get(key, set())
            nbytes = sum(os.stat(f).st_size for f in files if os.path.exists(f))
            rows.append({**dict(key), **done, "files_mib": nbytes / 2**20})
        return rows
