"""Megatron-LM's checkpoint directory layout: find and publish checkpoints. No megatron import.

::

    SAVE/iter_0000100/                       one dist checkpoint (its metadata.json written last)
    SAVE/latest_checkpointed_iteration.txt   the tracker; moved forward only after a save completes

Stock Megatron-LM reads the same tracker, so a directory written here loads there.
"""

from __future__ import annotations

import os
import re

from megatron_diffckpt.durable_io import publish_file
from megatron_diffckpt.errors import DiffCkptUsageError

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
# dist_checkpointing writes this file in the save's finalize step, after every rank's data.
COMPLETE_MARKER = "metadata.json"
_BASE_RE = re.compile(r"^iter_(\d{7})$")


class CheckpointNotFoundError(DiffCkptUsageError, FileNotFoundError):
    """A load directory holds no complete checkpoint."""


def checkpoint_dir(root: str, iteration: int) -> str:
    """``root/iter_<iteration, 7 digits>``."""
    return os.path.join(root, f"iter_{iteration:07d}")


def has_tracker(root: str) -> bool:
    """Whether ``root`` is a folder with a tracker (a checkpoint was published there once)."""
    return os.path.isfile(os.path.join(root, TRACKER_FILENAME))


def find_latest_iteration(root: str) -> int:
    """The iteration named by ``root``'s tracker, checked to be complete. Any rank.

    Raises:
        CheckpointNotFoundError: ``root`` is missing, has no tracker, or the tracker names an
            incomplete checkpoint; the message says which.
    """
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"{root}: no such directory")
    tracker = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(tracker):
        found = sorted(d for d in os.listdir(root) if d.startswith("iter_"))
        hint = f" ({', '.join(found)} present, none completed)" if found else ""
        raise CheckpointNotFoundError(f"{root} holds no checkpoint: no {TRACKER_FILENAME}{hint}")
    with open(tracker) as f:
        text = f.read().strip()
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointNotFoundError(
            f"{tracker} holds {text!r}, not an iteration number"
        ) from None
    ckpt = checkpoint_dir(root, iteration)
    if not os.path.isfile(os.path.join(ckpt, COMPLETE_MARKER)):
        raise CheckpointNotFoundError(
            f"{tracker} names iteration {iteration}, but {ckpt} has no {COMPLETE_MARKER}"
        )
    return iteration


def publish_iteration(root: str, iteration: int) -> None:
    """Atomically point the tracker at ``iteration``; durable on return. One rank (rank 0)."""
    publish_file(os.path.join(root, TRACKER_FILENAME), lambda f: f.write(str(iteration).encode()))


def list_checkpoints(root: str) -> list[tuple[int, bool]]:
    """``(iteration, complete)`` of every ``iter_NNNNNNN`` folder in ``root``, oldest first."""
    out = []
    for name in os.listdir(root):
        m = _BASE_RE.match(name)
        if m:
            out.append((int(m.group(1)), os.path.isfile(os.path.join(root, name, COMPLETE_MARKER))))
    return sorted(out)
