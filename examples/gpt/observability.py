"""What the GPT example reports about checkpointing: Megatron timers, the log line, TensorBoard.

- Megatron's own ``Timers`` time the training thread's checkpoint work, ``diffckpt-diff`` (the
  differential, or LowDiff+'s hand-off) and ``save-checkpoint`` (what a base blocked), and print
  their min/max across ranks at every log interval, as Megatron-LM does.
- The log line gains the manager's metrics: recoverable lag (iterations since the newest durable
  state), diff-log bytes per iteration, writer backlog, and with LowDiff+ the merge backlog.
- With ``--tensorboard-dir`` (and the ``tensorboard`` package installed), the last rank writes the
  loss, the iteration time, the learning rate, the timers and the metrics as scalars, as
  Megatron-LM's TensorBoard writer does.

Collective rule: :meth:`Observer.log` is called by all ranks together (the timers gather).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from megatron_diffckpt.manager import format_metrics

logger = logging.getLogger("pretrain_gpt")

TIMERS = ("diffckpt-diff", "save-checkpoint")


class Observer:
    """The example's checkpoint observability; inert pieces when not asked for."""

    def __init__(self, args: Any, manager: Any):
        from megatron.core.timers import Timers

        self.manager = manager
        self.timers = Timers(log_level=1, log_option="minmax")
        for name in TIMERS:  # every rank knows every timer, used or not
            self.timers(name, log_level=1)
        self.tensorboard = bool(args.tensorboard_dir)  # the same on every rank
        self.writer = None
        if args.tensorboard_dir and torch.distributed.get_rank() == (
            torch.distributed.get_world_size() - 1
        ):
            self.writer = _tensorboard_writer(args.tensorboard_dir)

    @contextlib.contextmanager
    def timer(self, name: str) -> Iterator[None]:
        self.timers(name, log_level=1).start()
        try:
            yield
        finally:
            self.timers(name).stop()

    def line(self, iteration: int) -> str:
        """The manager's metrics for the log line ("" without differential checkpointing)."""
        if self.manager is None:
            return ""
        return format_metrics(self.manager.metrics(iteration))

    def log(self, iteration: int, iterations: int, scalars: dict[str, float]) -> None:
        """Timers (min/max across ranks) to the log and, with the scalars, to TensorBoard.
        All ranks, collectively."""
        names = list(TIMERS)
        if self.tensorboard:
            self.timers.write(names, self.writer, iteration, normalizer=iterations, reset=False)
        self.timers.log(names, rank=0, normalizer=iterations)
        if self.writer is None:
            return
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, iteration)
        if self.manager is not None:
            for key, value in self.manager.metrics(iteration).items():
                self.writer.add_scalar(f"diffckpt/{key}", value, iteration)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _tensorboard_writer(path: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        logger.warning(
            "--tensorboard-dir %s: the tensorboard package is not installed; not writing "
            "TensorBoard logs (pip install tensorboard)",
            path,
        )
        return None
    return SummaryWriter(log_dir=path, max_queue=1000)
