"""The auto-tuner's side of the manager (``--diffckpt-auto-tune``): a tuner started from the
run's last decision and what the start or recovery cost (:func:`start_tuner`), and the agreement
on a new F and B every ``retune_interval`` iterations (:func:`retune`)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from megatron_diffckpt import recovery
from megatron_diffckpt.autotune import (
    Decision,
    OnlineTuner,
    TunerSettings,
    load_decision,
    save_decision,
)
from megatron_diffckpt.config import DiffCkptConfig
from megatron_diffckpt.manager.recovery import Recovered, seconds_since_process_start

logger = logging.getLogger(__name__)


def start_tuner(
    config: DiffCkptConfig, diff_dir: str, full_interval: int, recovered: Recovered | None
) -> tuple[OnlineTuner, int, int, bool]:
    """The tuner of this run, and the F, B and diff log to start with: the run's last decision
    (``diff_dir``), else ``full_interval`` and ``--diffckpt-batch-size``. Any rank (all
    read the same decision)."""
    batch_size, diff_log = config.batch_size, True
    decided = load_decision(diff_dir)
    if decided is not None:
        full_interval, batch_size = decided.full_interval, decided.batch_size
        diff_log = decided.diff_log
    settings = TunerSettings(
        mtbf_s=config.mtbf_hours * 3600.0,
        host_memory_budget=config.options.host_memory_budget * 2.0**20,
        max_pending=config.options.max_pending,
        plus=config.mode == "lowdiff-plus",
    )
    tuner = OnlineTuner(settings, full_interval, batch_size, diff_log)
    if recovered is not None:
        tuner.observe_recovery(recovered.base_load_s, recovered.replay_s, recovered.startup_s)
    else:
        tuner.observe_start(seconds_since_process_start())
    return tuner, full_interval, batch_size, diff_log


def retune(
    tuner: OnlineTuner,
    iteration: int,
    full_interval: int,
    writer: Any,
    strategy: Any,
    diff_dir: str,
) -> int:
    """Agree on the ranks' proposals (MIN of F and of B) and adopt them: the writer's batch,
    the strategy's diff log; returns the new F. All ranks, collectively."""
    proposed_f, batch_size, log = recovery.all_reduce_min(
        list(tuner.propose(iteration)), what="auto-tuning: F and B"
    )
    diff_log = bool(log) and tuner.diff_log
    current_b = writer.batch_size if writer is not None else batch_size
    if (proposed_f, batch_size, diff_log) != (full_interval, current_b, tuner.diff_log):
        logger.info(
            "auto-tune at iteration %d: F %d -> %d, B %d -> %d%s (agreed by all ranks)",
            iteration,
            full_interval,
            proposed_f,
            current_b,
            batch_size,
            "" if diff_log else ", diff log off (LowDiff+ bases only)",
        )
        if torch.distributed.get_rank() == 0:
            save_decision(diff_dir, Decision(proposed_f, batch_size, diff_log, iteration))
    if not diff_log and tuner.diff_log:
        logger.warning(
            "auto-tune at iteration %d: LowDiff+ stops writing the diff log (storage cannot "
            "take a dense differential every iteration, and bases only is cheaper): a "
            "recoverable state at every base from now on, every %d iterations",
            iteration,
            proposed_f,
        )
        strategy.stop_diff_log()
    tuner.apply(proposed_f, batch_size, diff_log)
    if writer is not None:
        writer.batch_size = batch_size  # segments may have any length: safe anytime
    return proposed_f
