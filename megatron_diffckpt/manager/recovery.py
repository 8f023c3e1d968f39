"""Recovery across tiers: the node keepers' replicas, their kept bases, then storage.

:class:`TieredRecovery` is the manager's recovery (:meth:`~megatron_diffckpt.manager.
DiffCheckpointManager.recover`, its one entry point, tries the tiers in this order):

1. **The keepers' replicas** (nothing replayed): LowDiff+ with its replica in the keeper, or
   LowDiff's replica of a kept base stepped with every differential; every rank must reach the
   iteration the ranks agree on, else all go to the next tier.
2. **The keepers' kept bases** (LowDiff): the newest base every rank's keeper holds, no older
   than storage's newest, then the differentials after it (storage's log, then the keepers').
3. **Storage**: the newest base (the training loop loads it), then the diff log every rank
   holds durably, and the keepers' records after it.

Every step is all ranks, collectively (each tier's decision is one all-reduce MIN); after any
tier, storage's log is made to reach the recovered iteration (what only a keeper held is
written back), so a later recovery from storage alone gets there too.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import psutil

from megatron_diffckpt import recovery
from megatron_diffckpt.capture import restore_rng
from megatron_diffckpt.checkpoint_layout import CheckpointNotFoundError, find_latest_iteration
from megatron_diffckpt.config import KeeperPlan
from megatron_diffckpt.errors import DiffCkptUsageError
from megatron_diffckpt.keeper import base_stager, replica_client
from megatron_diffckpt.keeper.client import KeeperClient
from megatron_diffckpt.keeper.protocol import Op
from megatron_diffckpt.patches import optimizer_step
from megatron_diffckpt.storage.format import DiffRecord, SegmentIdentity
from megatron_diffckpt.storage.reader import scan_rank_log

logger = logging.getLogger(__name__)


def seconds_since_process_start() -> float:
    return time.time() - psutil.Process().create_time()


@dataclass(frozen=True)
class Recovered:
    """Where a recovery left the training state, and what it cost."""

    iteration: int
    """The iteration the state is at (every rank the same)."""
    scheduler_steps: int | None
    """The scheduler's steps at it; ``None``: nothing was replayed (the loaded base's stand)."""
    consumed_samples: int | None
    """The samples consumed at it (``None`` as ``scheduler_steps``)."""
    tier: str
    """``"keepers"`` (no base read from storage) or ``"storage"``."""
    base: int | None
    """The storage base the state came from (``None``: the keepers')."""
    base_load_s: float
    """Seconds to load the base (or copy the replica)."""
    replay_s: float | None
    """Seconds per replayed differential (``None``: none replayed)."""
    startup_s: float
    """Seconds from the process's start to the recovery's."""
    replica: tuple[int, list[Any]] | None = None
    """LowDiff+ recovered from a keeper's replica: its iteration and description."""


def _counters(record: DiffRecord | None) -> tuple[int | None, int | None]:
    """The scheduler's steps and the consumed samples a record carries (``None``: no record)."""
    if record is None:
        return None, None
    return record.scalars["scheduler_steps"], record.scalars["consumed_samples"]


def _from_keepers(
    target: int, record: DiffRecord, load_s: float, replay_s: float | None, since_start: float
) -> Recovered:
    """A LowDiff recovery from the keepers (a replica, or a kept base and its replay) to
    ``target``, whose counters ``record`` carries; ``since_start``: the process's age when the
    recovery began, ``load_s`` of which went to the keepers' copy."""
    return Recovered(
        target,
        *_counters(record),
        tier="keepers",
        base=None,
        base_load_s=load_s,
        replay_s=replay_s,
        startup_s=max(0.0, since_start - load_s),
    )


class TieredRecovery:
    """One rank's recovery (see the module). Its methods are all ranks, collectively."""

    def __init__(
        self,
        *,
        mode: str,
        plan: KeeperPlan,
        keeper: KeeperClient | None,
        identity: SegmentIdentity,
        rank_dir: str,
        diff_dir: str,
        save_dir: str,
        optimizer: Any,
        rng_tracker: Any,
        residuals: Any,
        compressor: str,
    ):
        self.mode, self.plan, self.keeper = mode, plan, keeper
        self.identity, self.rank_dir, self.diff_dir = identity, rank_dir, diff_dir
        self.save_dir, self.optimizer, self.rng_tracker = save_dir, optimizer, rng_tracker
        self.residuals, self.compressor = residuals, compressor
        self._scanned: tuple[int, Any, recovery.TieredChain, float, float] | None = None

    # --- the keepers -------------------------------------------------------------------------

    def from_keepers(self, storage_base: int | None, loaded: bool) -> Recovered | None:
        """Tiers 1 and 2, before (instead of) loading a base when every rank can.
        ``storage_base``: storage's newest base (``None``: none); ``loaded``: the training loop
        loaded it already (Megatron-LM's), so a kept base must be newer to replace it.
        ``None``: load storage's newest base and :meth:`from_storage`."""
        if self.mode == "lowdiff-plus" and self.plan.replica:
            return self._plus_replica(storage_base)
        if self.plan.kept_bases and self.keeper is not None and storage_base is not None:
            if self.plan.replica:
                got = self._rolled(storage_base)
                if got is not None:
                    return got
            return self._kept_base(storage_base, loaded)
        return None

    def torch_optimizers(self) -> list[Any]:
        return [
            None if getattr(o, "is_stub_optimizer", False) else o.optimizer
            for o in optimizer_step.inner_optimizers(self.optimizer)
        ]

    def _keepers_replicas(self, **lowdiff: Any) -> Any:
        """:func:`~megatron_diffckpt.keeper.replica_client.recover_from_keepers` for this rank
        (``lowdiff``: LowDiff's bounds and residuals)."""
        return replica_client.recover_from_keepers(
            self.keeper,
            self.torch_optimizers(),
            lambda: optimizer_step.publish_main_params(self.optimizer),
            self.rng_tracker,
            recovery.all_reduce_min,
            **lowdiff,
        )

    def _plus_replica(self, storage_base: int | None) -> Recovered | None:
        since_process_start = seconds_since_process_start()
        # never older than storage's newest base: after a pause (max_merge_wait_ms) a base is
        # staged from the training state and may be published before the keepers' replicas
        # are anchored to it
        got = self._keepers_replicas(floor=storage_base or 0)
        if got is None:
            return None
        target, record, seconds, description, tier = got
        logger.info(
            "recovery: iteration %d from the replica in %s in %.3f s (nothing replayed)",
            target,
            tier,
            seconds,
        )
        return Recovered(
            target,
            *_counters(record),
            tier="keepers",
            base=None,
            base_load_s=seconds,
            replay_s=None,
            startup_s=max(0.0, since_process_start),
            replica=(target, description),
        )

    def _rolled(self, storage_base: int) -> Recovered | None:
        """LowDiff with the keeper's replica: the state at the newest iteration every rank's
        keeper replica reaches (no older than storage's newest base, within every rank's chain),
        nothing replayed; storage's log is then made to reach it as after a replay."""
        since_process_start = seconds_since_process_start()
        start = time.perf_counter()
        scan, chain, _, _ = self._chain(storage_base)
        got = self._keepers_replicas(
            floor=storage_base,
            ceiling=chain.last_iteration,
            residuals=self.residuals,
            fallback="the keepers' bases or storage",
        )
        if got is None:
            return None
        target, record, seconds, _, tier = got
        logger.info(
            "recovery: iteration %d from the replica in %s in %.3f s (nothing replayed; "
            "storage's newest base: %d, not read)",
            target,
            tier,
            seconds,
            storage_base,
        )
        self._scanned = None
        load_s = time.perf_counter() - start
        _, costs = self._replay_chain(scan, chain, target, target)
        return _from_keepers(target, record, load_s, costs, since_process_start)

    def _kept_base(self, storage_base: int, loaded: bool) -> Recovered | None:
        since_process_start = seconds_since_process_start()
        start = time.perf_counter()
        scan, chain, _, _ = self._chain(storage_base)
        offered = base_stager.offered_bases(self.keeper)
        agreed = base_stager.agree_on_kept_base(
            offered, storage_base, chain.last_iteration, loaded, recovery.all_reduce_min
        )
        if agreed is None:
            logger.info(
                "recovery: the node keepers hold no base every rank can recover from (this "
                "rank's keeper: %s; storage's newest base: %d): loading storage's",
                ", ".join(map(str, sorted(offered.bases))) or "none",
                storage_base,
            )
            return None
        base, target = agreed
        row, record = offered.bases[base]
        base_stager.load_kept_base(row, self.torch_optimizers(), self.residuals)
        optimizer_step.publish_main_params(self.optimizer)
        restore_rng([record], self.rng_tracker)
        load_s = time.perf_counter() - start
        logger.info(
            "recovery: base of iteration %d from %s in %.3f s (storage's newest base: %d, not "
            "read)",
            base,
            row.get("tier", "the node's keeper"),
            load_s,
            storage_base,
        )
        self._scanned = None
        last, costs = self._replay_chain(scan, chain, base, target)
        return _from_keepers(target, last or record, load_s, costs, since_process_start)

    # --- storage -----------------------------------------------------------------------------

    def from_storage(self, base_iteration: int, base_load_s: float = 0.0) -> Recovered:
        """Tier 3: replay the differentials after the loaded base ``base_iteration``, which
        took ``base_load_s`` to load."""
        since_process_start = seconds_since_process_start()
        scan, chain, read_s, kept_s = self._chain(base_iteration)
        self._scanned = None
        target = recovery.agree_on_iteration(chain)
        logger.info(
            "recovery: base at iteration %d, %d differential(s) to replay, recovering to "
            "iteration %d (this rank's log reaches %d%s): %s",
            base_iteration,
            sum(1 for r in chain.records if r.iteration <= target),
            target,
            scan.last_iteration,
            ""
            if self.keeper is None
            else f", its keeper {chain.last_iteration} in {kept_s * 1000:.1f} ms",
            chain.served(target),
        )
        last, costs = self._replay_chain(scan, chain, base_iteration, target, read_s)
        return Recovered(
            target,
            *_counters(last),
            tier="storage",
            base=base_iteration,
            base_load_s=base_load_s,
            replay_s=costs,
            startup_s=max(0.0, since_process_start - base_load_s),
        )

    def _chain(self, base_iteration: int) -> tuple[Any, recovery.TieredChain, float, float]:
        """This rank's chain after ``base_iteration``: storage's diff log, then its keeper's
        records; with the seconds each tier took to read (kept for :meth:`from_storage` after
        a look that did not recover)."""
        if self._scanned is not None and self._scanned[0] == base_iteration:
            return self._scanned[1:]
        self.quiesce_keepers_log()  # an earlier attempt's writer in the keeper: done
        start = time.perf_counter()
        scan = scan_rank_log(self.rank_dir, self.identity, base_iteration)
        read_s = time.perf_counter() - start
        for problem in scan.problems:
            logger.warning("diff log %s: %s", self.identity.dirname(), problem)
        self._refuse_another_layout(scan, base_iteration)
        start = time.perf_counter()
        kept = self.keeper.chain(scan.last_iteration) if self.keeper is not None else []
        kept_s = time.perf_counter() - start
        chain = recovery.join_tiers(scan, kept, self.keeper.served_by if kept else "")
        self._scanned = (base_iteration, scan, chain, read_s, kept_s)
        return scan, chain, read_s, kept_s

    def _replay_chain(
        self,
        scan: Any,
        chain: recovery.TieredChain,
        after: int,
        target: int,
        read_s: float | None = None,
    ) -> tuple[DiffRecord | None, float | None]:
        """Replay ``chain``'s records after ``after`` up to ``target``, then make storage's log
        end at ``target`` with every iteration the chain holds in it (those only a keeper held
        written back). The last record replayed (or ``None``), and the seconds per record."""
        records = [r for r in chain.records if after < r.iteration <= target]
        start = time.perf_counter()
        targets = optimizer_step.replay_targets(self.optimizer)
        last = recovery.replay(targets, records, self.rng_tracker)
        replay_s = time.perf_counter() - start
        logger.info(
            "recovery: %sreplayed %d differential(s) in %.3f s",
            "" if read_s is None else f"read the diff log in {read_s:.3f} s, ",
            len(records),
            replay_s,
        )
        if os.path.isdir(self.rank_dir):
            self.quiesce_keepers_log()
            recovery.truncate_log(self.rank_dir, scan, target)
        recovery.fill_log(
            self.rank_dir,
            self.identity,
            self.compressor,
            [r for r in chain.records if scan.last_iteration < r.iteration <= target],
        )
        return last, replay_s / len(records) if records else None

    # --- shared with the start -----------------------------------------------------------------

    def quiesce_keepers_log(self) -> None:
        """Before this rank reads or cuts its diff log: when the node's keeper writes it
        (LowDiff+ with its replica there, LowDiff with ``keeper_writes_log``), the keeper writes
        what it holds and then nothing more until this rank opens its replica or log again, so
        nothing of an earlier attempt lands after the cut. Any rank."""
        if self.mode == "lowdiff-plus" and self.plan.replica:
            self.keeper.call({"op": Op.REPLICA_LOG_FLUSH})
        elif self.mode == "lowdiff" and self.keeper:
            self.keeper.call({"op": Op.LOG_CLOSE})

    def storage_tracker(self) -> int:
        """The iteration storage's tracker names (0: none yet). Any rank."""
        try:
            return find_latest_iteration(self.save_dir)
        except CheckpointNotFoundError:
            return 0

    def _refuse_another_layout(self, scan: Any, base_iteration: int) -> None:
        """Differentials after the base written by this run under another optimizer shard layout
        (another TP, PP or DP size, or another model): replaying them is impossible, and
        resuming from the base alone would silently drop them."""
        foreign = scan.foreign
        mine = foreign is not None and foreign.run_id == self.identity.run_id
        if recovery.all_reduce_min([0 if mine else 1], what="recovery: a keeper's copy?")[0] == 1:
            return
        where = f" (this rank's log holds {foreign})" if mine else ""
        raise DiffCkptUsageError(
            f"the diff log {self.diff_dir} holds differentials after base {base_iteration} "
            "written under another parallel layout or model than this run's"
            f"{where}; resume with the layout and model flags that wrote them, or first merge "
            f"them into a base (megatron-diffckpt merge {self.save_dir} --out DIR2) and --load "
            "DIR2"
        )
