"""Reading and writing a ``torch_dist`` checkpoint's entries in one process, without megatron.

A megatron ``torch_dist`` checkpoint is a PyTorch DCP checkpoint: every ``ShardedTensor`` key is
one global tensor (stored as the chunks the ranks saved), every ``ShardedObject`` one bytes entry
``<key>/shard_<offset>_<shape>`` holding ``torch.save([object])``, beside megatron's
``metadata.json`` and ``common.pt``. Here a process reads whole global tensors (DCP reassembles
the chunks) and the bytes entries *as bytes* (nothing is unpickled), and writes such entries back
as a checkpoint megatron's loader reads (one chunk per tensor; DCP reshards on load).
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType

# Entries read per DCP load: bounds the reads in flight, and paces the progress line.
GROUP_BYTES = 256 * 2**20


class _RawBytesLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, but a bytes entry is kept as its raw bytes (never unpickled)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = value.read()


class _RawBytesSavePlanner(DefaultSavePlanner):
    """DCP's save planner, but a bytes entry is written as the bytes given (DCP's own would
    pickle the buffer object again); megatron's planner does the same."""

    def transform_object(self, write_item: Any, object: Any) -> Any:  # noqa: A002 (DCP's name)
        if write_item.type == WriteItemType.BYTE_IO:
            return object
        return super().transform_object(write_item, object)


def read_metadata(path: str) -> Metadata:
    return FileSystemReader(path).read_metadata()


def entry_bytes(meta: Any) -> int:
    """The size of a tensor entry (0 for a bytes entry, whose size the metadata does not say)."""
    if isinstance(meta, TensorStorageMetadata):
        return meta.size.numel() * meta.properties.dtype.itemsize
    return 0


def read_entries(
    path: str,
    keys: Iterable[str] | None = None,
    on_group: Callable[[int, int], None] | None = None,
    metadata: Metadata | None = None,
) -> dict[str, torch.Tensor | bytes]:
    """The entries ``keys`` (default: all) of the checkpoint at ``path``: global tensors, and
    bytes entries as raw bytes. Reads in groups of about :data:`GROUP_BYTES`, calling
    ``on_group(entries, nbytes)`` after each. ``metadata``: the checkpoint's, when the caller has
    read it already. Any process; no process group needed."""
    metadata = metadata if metadata is not None else read_metadata(path)
    wanted = sorted(metadata.state_dict_metadata if keys is None else keys)
    missing = [k for k in wanted if k not in metadata.state_dict_metadata]
    if missing:
        raise KeyError(f"{path} has no entries {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    out: dict[str, torch.Tensor | bytes] = {}
    group: dict[str, Any] = {}
    group_bytes = 0
    for i, key in enumerate(wanted):
        meta = metadata.state_dict_metadata[key]
        if isinstance(meta, TensorStorageMetadata):
            group[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        else:
            group[key] = b""
        group_bytes += entry_bytes(meta)
        if group_bytes >= GROUP_BYTES or i == len(wanted) - 1:
            planner = _RawBytesLoadPlanner()
            with warnings.catch_warnings():  # "assuming ... a single process": it is one
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(group, storage_reader=FileSystemReader(path), planner=planner)
            out.update(planner.state_dict)
            if on_group is not None:
                on_group(len(group), group_bytes)
            group, group_bytes = {}, 0
    return out


def write_entries(path: str, entries: dict[str, torch.Tensor | bytes]) -> None:
    """Write ``entries`` (global tensors; bytes entries as raw bytes) as the DCP part of a
    checkpoint in the new folder ``path`` (its ``.metadata`` last, as DCP does). One process.
    The caller adds ``metadata.json``, and megatron's ``common.pt`` where the common state is not
    one of ``entries`` (:func:`store_common`)."""
    os.makedirs(path, exist_ok=False)
    state = {
        k: io.BytesIO(v) if isinstance(v, (bytes, bytearray)) else v for k, v in entries.items()
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            state,
            storage_writer=FileSystemWriter(path, single_file_per_rank=True),
            planner=_RawBytesSavePlanner(),
        )


# megatron-core 0.19 keeps a checkpoint's common (non-sharded) state inside its DCP part, as this
# ShardedObject entry; 0.16 writes it to common.pt beside it. Its loader reads either.
COMMON_STATE_KEY = "common_state/shard_0_1"
COMMON_FILE = "common.pt"


def load_common(path: str, entries: dict[str, Any]) -> dict[str, Any]:
    """Megatron's common state of checkpoint ``path``: its ``common.pt``, or the
    ``common_state`` entry of ``entries`` (``read_entries(path)``). This unpickles."""
    legacy = os.path.join(path, COMMON_FILE)
    if os.path.exists(legacy) or COMMON_STATE_KEY not in entries:
        return torch.load(legacy, map_location="cpu", weights_only=False)
    raw = entries[COMMON_STATE_KEY]
    return load_object(raw) if isinstance(raw, (bytes, bytearray)) else raw


def store_common(common: dict[str, Any], entries: dict[str, Any]) -> bool:
    """Put ``common`` where a checkpoint read into ``entries`` kept it: into its ``common_state``
    entry (True), or, when it had none, nowhere (False: the caller writes ``common.pt``)."""
    if COMMON_STATE_KEY not in entries:
        return False
    entries[COMMON_STATE_KEY] = dump_object(common)
    return True


def load_object(raw: bytes) -> Any:
    """The object of a megatron ``ShardedObject`` entry (``torch.save([object])``).

    This unpickles: megatron's own format for these entries. Only for checkpoints you trust."""
    return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)[0]


def dump_object(obj: Any) -> bytes:
    """The bytes of a ``ShardedObject`` entry holding ``obj``, as megatron writes them."""
    buf = io.BytesIO()
    torch.save([obj], buf)
    return buf.getvalue()
