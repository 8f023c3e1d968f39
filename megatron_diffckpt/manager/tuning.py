"""The auto-tuner's side of the manager (``--diffckpt-auto-tune``): a tuner started from the
run's last decision and what the start or recovery cost (:func:`start_tuner`), and the agreement
on a new F and B (and LowDiff+'s diff log, merge wait bound and replica) every
``retune_interval`` iterations (:func:`retune`)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from megatron_diffckpt import recovery
from megatron_diffckpt.autotune import (
    PAUSED_BASES_TO_DROP,
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
    config: DiffCkptConfig,
    diff_dir: str,
    full_interval: int,
    recovered: Recovered | None,
    replica_in_keeper: bool = False,
) -> tuple[OnlineTuner, int, int, bool]:
    """The tuner of this run, and the F, B and diff log to start with: the run's last decision
    (``diff_dir``), else ``full_interval`` and ``--diffckpt-batch-size``; its bound on
    LowDiff+'s merge wait is the tuner's ``merge_wait_ms``, whether LowDiff+ keeps its replica
    its ``replica`` (a replica in the node's keeper, ``replica_in_keeper``, is never dropped).
    Any rank (all read the same decision)."""
    batch_size, diff_log, merge_wait_ms, replica = config.batch_size, True, 0, True
    decided = load_decision(diff_dir)
    if decided is not None:
        full_interval, batch_size = decided.full_interval, decided.batch_size
        diff_log = decided.diff_log
        merge_wait_ms = decided.merge_wait_ms
        replica = decided.replica
    plus = config.mode == "lowdiff-plus"
    bound = plus and not config.options.max_merge_wait_ms  # the user's bound stays as it is
    droppable = plus and not replica_in_keeper
    settings = TunerSettings(
        mtbf_s=config.mtbf_hours * 3600.0,
        host_memory_budget=config.options.host_memory_budget * 2.0**20,
        max_pending=config.options.max_pending,
        plus=plus,
        bound_merge_wait=bound,
        drop_replica=droppable,
        max_interval=config.options.max_full_interval or TunerSettings.max_interval,
    )
    tuner = OnlineTuner(
        settings,
        full_interval,
        batch_size,
        diff_log,
        merge_wait_ms if bound else 0,
        replica or not droppable or not diff_log,
    )
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
    """Agree on the ranks' proposals (MIN of F and of B, the longest bound on LowDiff+'s merge
    wait any rank proposes, its replica dropped where any rank drops it: a base waits for every
    rank, so one rank staging its bases from the training state makes the others' replicas buy
    none) and adopt them: the writer's batch, the strategy's diff log, merge wait and replica;
    returns the new F. All ranks, collectively."""
    if getattr(strategy, "has_replica", False):
        tuner.observe_paused_bases(strategy.paused_bases)
    f, b, log, wait_ms, kept = tuner.propose(iteration)
    proposed_f, batch_size, log, neg_wait_ms, kept = recovery.all_reduce_min(
        [f, b, log, -wait_ms, kept], what="auto-tuning: F and B"
    )
    diff_log = bool(log) and tuner.diff_log
    merge_wait_ms = tuner.merge_wait_ms or -neg_wait_ms
    # a rank's stop of the log outweighs another's drop: bases only are the replica's bases
    replica = (bool(kept) or not diff_log) and tuner.replica
    current_b = writer.batch_size if writer is not None else batch_size
    decided = (proposed_f, batch_size, diff_log, merge_wait_ms, replica)
    if decided != (full_interval, current_b, tuner.diff_log, tuner.merge_wait_ms, tuner.replica):
        logger.info(
            "auto-tune at iteration %d: F %d -> %d, B %d -> %d%s%s%s (agreed by all ranks)",
            iteration,
            full_interval,
            proposed_f,
            current_b,
            batch_size,
            "" if diff_log else ", diff log off (LowDiff+ bases only)",
            f", merge wait bounded at {merge_wait_ms} ms" if merge_wait_ms else "",
            "" if replica else ", LowDiff+ without a replica",
        )
        if torch.distributed.get_rank() == 0:
            save_decision(
                diff_dir,
                Decision(proposed_f, batch_size, diff_log, iteration, merge_wait_ms, replica),
            )
    if merge_wait_ms and not tuner.merge_wait_ms:
        logger.warning(
            "auto-tune at iteration %d: training waited %.1f ms per iteration for this rank's "
            "merger; from now on it waits at most %d ms for a snapshot slot, and past that the "
            "merger skips to the next base, staged from the training state%s (as "
            "--diffckpt-option max_merge_wait_ms=%d)",
            iteration,
            1000.0 * tuner.mean_merge_wait_s(),
            merge_wait_ms,
            "; the diff log goes on" if diff_log else "",
            merge_wait_ms,
        )
        strategy.bound_merge_wait(merge_wait_ms / 1000.0)
    if not diff_log and tuner.diff_log:
        logger.warning(
            "auto-tune at iteration %d: LowDiff+ stops writing the diff log (storage cannot "
            "take a dense differential every iteration, and bases only is cheaper): a "
            "recoverable state at every base from now on, every %d iterations",
            iteration,
            proposed_f,
        )
        strategy.stop_diff_log()
    if not replica and tuner.replica:
        freed = strategy.drop_replica()
        logger.warning(
            "auto-tune at iteration %d: LowDiff+ drops its replica (%s): every base is staged "
            "from the training state from now on, the diff log goes on between them, and "
            "nothing is merged; %.1f MB of host memory freed (one way; saved for a restart)",
            iteration,
            f"{'this' if tuner.paused_bases >= PAUSED_BASES_TO_DROP else 'another'} rank's "
            f"merges paused in each of its last {PAUSED_BASES_TO_DROP} base intervals, and "
            "every base waits for every rank",
            freed / 1e6,
        )
    tuner.apply(proposed_f, batch_size, diff_log, merge_wait_ms, replica)
    if writer is not None:
        writer.batch_size = batch_size  # segments may have any length: safe anytime
    return proposed_f
