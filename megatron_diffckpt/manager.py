"""``DiffCheckpointManager``: the one object a training loop talks to.

Call sequence, every call on all ranks::

    manager = DiffCheckpointManager(config, save_dir, optimizer, rng_tracker, coords)
    iteration, scheduler_steps, consumed = manager.recover(base_iteration)  # base loaded first
    manager.start(iteration)
    for each iteration:
        optimizer.step(); scheduler.step(...)          # the hook captures inside step()
        manager.end_iteration(iteration, scheduler.num_steps, consumed)
        # when a base is published: manager.on_base_published(base_iteration)
    manager.close()

Bases are the training loop's stock dist checkpoints; the diff log runs continuously across them,
and recovery replays from the newest base the differentials after it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from typing import Any

import torch

from megatron_diffckpt import recovery, retention
from megatron_diffckpt.capture import GradShardCapture
from megatron_diffckpt.compression import make_compressor
from megatron_diffckpt.config import DiffCkptConfig
from megatron_diffckpt.durable_io import publish_file
from megatron_diffckpt.patches import optimizer_step
from megatron_diffckpt.storage.format import SegmentIdentity
from megatron_diffckpt.storage.reader import scan_rank_log
from megatron_diffckpt.storage.writer import DiffLogWriter

logger = logging.getLogger(__name__)

RUN_ID_FILE = "run.json"


def shard_layout_hash(optimizer: Any) -> str:
    """Hash of this rank's optimizer shard layout (inner optimizers, groups, shapes, dtypes)."""
    desc = [
        [[[list(p.shape), str(p.dtype)] for p in g["params"]] for g in inner.optimizer.param_groups]
        for inner in optimizer_step.inner_optimizers(optimizer)
    ]
    return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]


def _run_id(diff_dir: str) -> str:
    """The run's id, created by rank 0 on first use. All ranks, collectively."""
    path = os.path.join(diff_dir, RUN_ID_FILE)
    if torch.distributed.get_rank() == 0 and not os.path.exists(path):
        os.makedirs(diff_dir, exist_ok=True)
        run = json.dumps({"run_id": uuid.uuid4().hex}).encode()
        publish_file(path, lambda f: f.write(run))
    torch.distributed.barrier()
    with open(path) as f:
        return json.load(f)["run_id"]


class DiffCheckpointManager:
    """Captures every iteration's differential and recovers from base + differentials.

    Args:
        config: the ``--diffckpt-*`` settings.
        save_dir: the checkpoint folder (``--save``); the diff log defaults to
            ``save_dir/diffckpt``.
        optimizer: the megatron optimizer (chained or not).
        rng_tracker: megatron's tensor-parallel RNG tracker (``get_cuda_rng_tracker()``).
        coords: this rank's ``(tp, pp, dp)`` ranks.
    """

    def __init__(
        self,
        config: DiffCkptConfig,
        save_dir: str,
        optimizer: Any,
        rng_tracker: Any,
        coords: tuple[int, int, int],
    ):
        self.config = config
        self.save_dir = save_dir
        self.dir = config.dir or os.path.join(save_dir, "diffckpt")
        self.optimizer = optimizer
        self.rng_tracker = rng_tracker
        tp, pp, dp = coords
        self.identity = SegmentIdentity(_run_id(self.dir), tp, pp, dp, shard_layout_hash(optimizer))
        self.rank_dir = os.path.join(self.dir, self.identity.dirname())
        self.capture = GradShardCapture()
        self.writer: DiffLogWriter | None = None

    def recover(self, base_iteration: int) -> tuple[int, int | None, int | None]:
        """Replay the differentials after the loaded base. All ranks, collectively.

        Returns ``(iteration, scheduler_steps, consumed_samples)``; the last two are ``None`` when
        there was nothing to replay (the base's own values stand).
        """
        start = time.perf_counter()
        scan = scan_rank_log(self.rank_dir, self.identity, base_iteration)
        read_s = time.perf_counter() - start
        for problem in scan.problems:
            logger.warning("diff log %s: %s", self.identity.dirname(), problem)
        target = recovery.agree_on_iteration(scan)
        records = [r for r in scan.records if r.iteration <= target]
        logger.info(
            "recovery: base at iteration %d, %d differential(s) to replay, recovering to "
            "iteration %d (this rank's log reaches %d)",
            base_iteration,
            len(records),
            target,
            scan.last_iteration,
        )
        start = time.perf_counter()
        last = recovery.replay(self.optimizer, records, self.rng_tracker)
        logger.info(
            "recovery: read the diff log in %.3f s, replayed %d differential(s) in %.3f s",
            read_s,
            len(records),
            time.perf_counter() - start,
        )
        if os.path.isdir(self.rank_dir):
            recovery.truncate_log(self.rank_dir, scan, target)
        if last is None:
            return target, None, None
        return target, last.scalars["scheduler_steps"], last.scalars["consumed_samples"]

    def start(self, iteration: int) -> None:
        """Begin capturing after ``iteration``. All ranks."""
        self.writer = DiffLogWriter(
            self.dir,
            self.identity,
            make_compressor(self.config.compressor, self.config.topk_ratio).name,
            batch_size=self.config.batch_size,
            max_pending=self.config.max_pending,
            when_full=self.config.when_full,
            chain_start=iteration,
        )
        optimizer_step.attach(self.optimizer, self.capture.on_ready_grads)

    def end_iteration(self, iteration: int, scheduler_steps: int, consumed_samples: int) -> None:
        """Hand ``iteration``'s differential to the background writer. All ranks."""
        record = self.capture.take_record(
            iteration, scheduler_steps, consumed_samples, self.rng_tracker
        )
        self.writer.append(record)

    def on_base_published(self, iteration: int) -> None:
        """A base of ``iteration`` is published: durability counts from it, and retention applies.
        All ranks, after the tracker moved (rank 0 prunes bases, every rank its differentials)."""
        if self.writer is not None:
            self.writer.rebase(iteration)
        keep = self.config.keep_bases
        if keep < 1:
            return
        if torch.distributed.get_rank() == 0:
            retention.prune_bases(self.save_dir, keep)
        retention.prune_diff_log(self.save_dir, self.rank_dir, keep)

    @property
    def durable_iteration(self) -> int:
        return self.writer.durable_iteration if self.writer else 0

    def close(self) -> None:
        """Write what is pending and stop. All ranks."""
        optimizer_step.detach(self.optimizer)
        if self.writer is not None:
            self.writer.close()
