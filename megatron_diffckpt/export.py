"""Export a base (a stock megatron dist checkpoint) as one torch file. Any process, offline.

The file is a ``torch.save`` of::

    {"format": EXPORT_FORMAT, "iteration": T, "source": "SAVE/iter_000000T",
     "tensors": {key: tensor or object, ...},   # every entry of the sharded checkpoint, whole
     "common": {...}}                           # the checkpoint's common.pt (scheduler, counters)

The keys are megatron's sharded-state-dict keys (``decoder.layers.self_attention.linear_qkv.weight``
with the layers stacked, ``optimizer.distributed...bucket_idx_0.exp_avg``, ...); each tensor is
the global one, reassembled from every rank's shards. No megatron import: the tensors are read
with PyTorch DCP, entry group by entry group, with progress. Reading ``common.pt`` and the sharded
objects unpickles (megatron's own format): export only checkpoints you trust.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from megatron_diffckpt.checkpoint_layout import checkpoint_dir, list_checkpoints
from megatron_diffckpt.dist_ckpt_io import (
    COMMON_STATE_KEY,
    entry_bytes,
    load_common,
    load_object,
    read_entries,
    read_metadata,
)
from megatron_diffckpt.durable_io import publish_file
from megatron_diffckpt.errors import DiffCkptUsageError
from megatron_diffckpt.progress import Progress

EXPORT_FORMAT = "megatron-diffckpt-export-v1"


class ExportError(DiffCkptUsageError, RuntimeError):
    """The requested iteration cannot be exported (message says why and what to do)."""


def export_base(root: str, iteration: int, out: str, progress: bool = True) -> dict[str, Any]:
    """Write base ``iteration`` of ``root`` to ``out`` (atomically). Returns a summary."""
    bases = dict(list_checkpoints(root)) if os.path.isdir(root) else {}
    if not bases.get(iteration):
        complete = sorted(i for i, ok in bases.items() if ok)
        raise ExportError(
            f"{root} has no complete base of iteration {iteration} (complete bases: "
            f"{complete or 'none'}); export a base, or resume training to {iteration} with "
            "--diffckpt-mode and save a base there"
        )
    path = checkpoint_dir(root, iteration)
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise ExportError(f"{path} is not a torch_dist checkpoint (no .metadata)")
    metadata = read_metadata(path)
    entries = metadata.state_dict_metadata
    total = sum(entry_bytes(m) for m in entries.values())
    label = f"export iter_{iteration:07d}"
    bar = Progress(label, len(entries), "entries", total, stream=sys.stderr if progress else None)
    tensors = {
        key: load_object(value) if isinstance(value, bytes) else value
        for key, value in read_entries(path, on_group=bar.update, metadata=metadata).items()
    }
    common = load_common(path, tensors)
    tensors.pop(COMMON_STATE_KEY, None)  # megatron-core 0.19 keeps it among the entries
    payload = {
        "format": EXPORT_FORMAT,
        "iteration": iteration,
        "source": os.path.abspath(path),
        "tensors": tensors,
        "common": common,
    }
    publish_file(out, lambda f: torch.save(payload, f))
    seconds = bar.close()
    return {
        "iteration": iteration,
        "out": out,
        "entries": len(entries),
        "tensor_bytes": total,
        "file_bytes": os.path.getsize(out),
        "seconds": seconds,
    }
