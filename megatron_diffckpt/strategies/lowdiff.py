"""LowDiff: every optimizer step's input, captured where megatron feeds it, is the differential.

Inside each inner optimizer's step (:mod:`~megatron_diffckpt.patches.optimizer_step`) the main
shard's gradients are exactly what the step consumes: reduced (with ``--diffckpt-compressor
topk``, the sparse aggregate of the compressed exchange), unscaled and clipped. They are copied
(sparse where that is smaller) with the step's learning rates and weight decays; at the end of
the iteration the record gets the scheduler's step count, the consumed samples and the RNG
states, and goes to the diff log's background writer. Bases are the training loop's own stock
saves of the training state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from megatron_diffckpt.capture import GradShardCapture
from megatron_diffckpt.patches import optimizer_step
from megatron_diffckpt.storage.writer import DiffLogWriter
from megatron_diffckpt.strategies.base import (
    BaseSource,
    IterationCost,
    PerIterationStrategy,
    SaveBase,
)


class LowDiffStrategy(PerIterationStrategy):
    """``--diffckpt-mode lowdiff`` on one rank.

    Args:
        optimizer: the megatron optimizer (chained or not).
        writer: the diff log.
        rng_tracker: megatron's tensor-parallel RNG tracker.
        before_step: called before each optimizer step (see :attr:`before_step`).
    """

    name = "lowdiff"

    def __init__(
        self,
        optimizer: Any,
        writer: DiffLogWriter,
        rng_tracker: Any,
        before_step: Callable[[], None] | None = None,
    ):
        self.optimizer = optimizer
        self.before_step = before_step
        """Called before each optimizer step changes the state (a base being staged off the
        training thread waits there)."""
        self.writer = writer
        self.rng_tracker = rng_tracker
        self.capture = GradShardCapture()
        self._step_start: float | None = None
        self._capture_s = 0.0

    def start(self, iteration: int) -> None:
        optimizer_step.attach(self.optimizer, self._on_ready_grads)

    def _on_ready_grads(self, inner_index: int, torch_optimizer: Any) -> None:
        if self.before_step is not None:
            self.before_step()
        now = time.perf_counter()
        if self._step_start is None:
            self._step_start = now
        self.capture.on_ready_grads(inner_index, torch_optimizer)
        self._capture_s += time.perf_counter() - now

    def end_iteration(self, iteration: int, scheduler_steps: int, consumed: int) -> IterationCost:
        start = time.perf_counter()
        since_step = start - self._step_start if self._step_start is not None else 0.0
        record = self.capture.take_record(iteration, scheduler_steps, consumed, self.rng_tracker)
        self.writer.append(record)
        capture_s = self._capture_s
        self._step_start, self._capture_s = None, 0.0
        return IterationCost(capture_s + time.perf_counter() - start, capture_s, since_step)

    def save_base(self, iteration: int, save: SaveBase) -> float:
        start = time.perf_counter()
        save(BaseSource(self.optimizer))
        return time.perf_counter() - start

    def close(self) -> None:
        optimizer_step.detach(self.optimizer)
