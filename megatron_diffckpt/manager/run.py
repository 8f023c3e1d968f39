"""The run's identity, which every segment header carries: the run's id (created once per
diff-log folder) and the hash of this rank's optimizer shard layout (a differential replays only
onto the layout that made it)."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from typing import Any

import torch

from megatron_diffckpt.durable_io import publish_file
from megatron_diffckpt.patches import optimizer_step
from megatron_diffckpt.storage.reader import RUN_ID_FILE


def shard_layout_hash(optimizer: Any) -> str:
    """Hash of this rank's optimizer shard layout (inner optimizers, groups, shapes, dtypes)."""
    desc = [
        [[[list(p.shape), str(p.dtype)] for p in g["params"]] for g in inner.optimizer.param_groups]
        for inner in optimizer_step.inner_optimizers(optimizer)
    ]
    return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]


def run_id(diff_dir: str, mode: str) -> str:
    """The run's id, created by rank 0 on first use (with the mode that created the folder, for
    ``megatron-diffckpt inspect``). All ranks, collectively."""
    path = os.path.join(diff_dir, RUN_ID_FILE)
    if torch.distributed.get_rank() == 0 and not os.path.exists(path):
        os.makedirs(diff_dir, exist_ok=True)
        run = json.dumps({"run_id": uuid.uuid4().hex, "mode": mode}).encode()
        publish_file(path, lambda f: f.write(run))
    torch.distributed.barrier()
    with open(path) as f:
        return json.load(f)["run_id"]
