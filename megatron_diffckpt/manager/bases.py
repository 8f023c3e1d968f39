"""The manager's parts of a base beyond the save itself: the copy of each LowDiff base into the
node's keeper (:class:`KeptBaseStaging`), and the space a base needs at least
(:func:`base_floor_bytes`, which :class:`~megatron_diffckpt.base_space.BaseSpace` checks)."""

from __future__ import annotations

import logging
import time
from typing import Any

from megatron_diffckpt.capture import capture_rng
from megatron_diffckpt.keeper.base_stager import BaseStager
from megatron_diffckpt.keeper.replica_client import KEEPER_FLAG_HINT
from megatron_diffckpt.patches import optimizer_layout, optimizer_step
from megatron_diffckpt.storage.format import DiffRecord

logger = logging.getLogger(__name__)


class KeptBaseStaging:
    """LowDiff under a keeper: each base also goes to the keeper's memory
    (:mod:`~megatron_diffckpt.keeper.bases`), copied while the next iteration's passes run; the
    next optimizer step waits for the hand-over (:meth:`wait`, the strategy's ``before_step``).
    The training thread."""

    def __init__(self, stager: BaseStager, torch_optimizers: Any, residuals: Any, rng: Any):
        self.stager = stager
        self._torch_optimizers = torch_optimizers  # () -> the inner torch optimizers
        self._residuals, self._rng = residuals, rng
        self._refused = False

    def stage(self, iteration: int, ended: tuple[int, int, int] | None) -> float:
        """Begin staging the base of ``iteration`` (the training state, before the next step);
        the seconds training was blocked. Only a base after an iteration this process trained
        (``ended``: its iteration and counters, as the last differential's): a job's starting
        point is storage's alone."""
        if ended is None or ended[0] != iteration:
            return 0.0
        start = time.perf_counter()
        self.wait()
        _, steps, consumed = ended
        scalars, tensors = capture_rng(self._rng)
        record = DiffRecord(
            iteration, {"scheduler_steps": steps, "consumed_samples": consumed, **scalars}, tensors
        )
        self.stager.start(self._torch_optimizers(), self._residuals, record)
        return time.perf_counter() - start

    def wait(self) -> None:
        """Wait until the base being staged is handed over (before the step that changes the
        state it copies); say once when the keeper did not take one."""
        why = self.stager.wait()
        if why and not self._refused:
            self._refused = True
            logger.warning(
                "the node's keeper did not take a base (%s): a restart loads storage's base (%s)",
                why,
                KEEPER_FLAG_HINT,
            )


def base_floor_bytes(optimizer: Any, writer: Any) -> int:
    """The bytes this rank adds to a base at least (its distributed optimizer shard's fp32 main
    parameters and moments), plus the diff-log bytes its ``writer`` may write during the save.
    Any rank."""
    numel = sum(
        p.numel()
        for inner in optimizer_step.inner_optimizers(optimizer)
        if optimizer_layout.is_distributed(inner)
        for group in inner.optimizer.param_groups
        for p in group["params"]
    )
    in_flight = 0
    if writer is not None and writer.stats.records:
        per_record = writer.stats.bytes_written / writer.stats.records
        segments = writer.backlog + 1  # queued, and the one being written
        in_flight = int(per_record * writer.batch_size * segments)
    return 12 * numel + in_flight
