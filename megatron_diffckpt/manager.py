"""``DiffCheckpointManager``: the one object a training loop talks to.

Call sequence, every call on all ranks::

    manager = DiffCheckpointManager(config, save_dir, optimizer, rng_tracker, coords, chunks)
    iteration, scheduler_steps, consumed = manager.recover(base_iteration)  # base loaded first
    manager.start(iteration, full_interval)
    if manager.base_due(iteration):                     # a fresh job: its base at the start
        manager.save_base(iteration, save)
    for each iteration:
        optimizer.step(); scheduler.step(...)          # the hooks capture inside step()
        manager.end_iteration(iteration, scheduler.num_steps, consumed, train_seconds)
        manager.record_shard_map(make_sharded_state_dict, parallel)  # for `merge`; once
        if manager.base_due(iteration):
            manager.save_base(iteration, save)          # save(source): the loop's save path
        # when a base is published (the save's finalize step): manager.on_base_published(it)
    manager.close()

What happens every iteration is the strategy's (:mod:`megatron_diffckpt.strategy`): LowDiff
(:class:`~megatron_diffckpt.lowdiff.LowDiffStrategy`) or LowDiff+
(:class:`~megatron_diffckpt.plus.LowDiffPlusStrategy`); the manager does what both share:
recovery, the diff log, the bases' bookkeeping, retention and auto-tuning. Bases are the training
loop's stock dist checkpoints (written from the training state or from the LowDiff+ replica); the
diff log runs continuously across them, and recovery replays from the newest base the
differentials after it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import psutil
import torch

from megatron_diffckpt import failpoints, full_storage, recovery, retention
from megatron_diffckpt.autotune import (
    Decision,
    OnlineTuner,
    TunerSettings,
    load_decision,
    save_decision,
)
from megatron_diffckpt.background import children_die_with_this_process
from megatron_diffckpt.base_space import BaseSpace
from megatron_diffckpt.capture import capture_rng, restore_rng
from megatron_diffckpt.checkpoint_layout import CheckpointNotFoundError, find_latest_iteration
from megatron_diffckpt.compression import make_compressor
from megatron_diffckpt.config import DiffCkptConfig, KeeperPlan
from megatron_diffckpt.durable_io import publish_file
from megatron_diffckpt.errors import DiffCkptUsageError
from megatron_diffckpt.keeper import bases, replica_client
from megatron_diffckpt.keeper.client import KeeperClient
from megatron_diffckpt.keeper.logs import KeeperLogWriter
from megatron_diffckpt.keeper.protocol import Op
from megatron_diffckpt.lowdiff import LowDiffStrategy
from megatron_diffckpt.patches import base_checkpoint, optimizer_layout, optimizer_step
from megatron_diffckpt.plus import LowDiffPlusStrategy
from megatron_diffckpt.shard_map import ShardMap, ShardMapRecorder, build_shard_map
from megatron_diffckpt.storage.format import DiffRecord, SegmentIdentity
from megatron_diffckpt.storage.reader import RUN_ID_FILE, scan_rank_log
from megatron_diffckpt.storage.writer import DiffLogWriter
from megatron_diffckpt.strategy import PerIterationStrategy, SaveBase

logger = logging.getLogger(__name__)

PLUS_SLOW_HINT = (
    "LowDiff+ writes the dense gradient shard every iteration: run with "
    "--diffckpt-option diff_log=false (bases only, as often as storage writes them) or let "
    "--diffckpt-auto-tune choose from the measured costs"
)


def shard_layout_hash(optimizer: Any) -> str:
    """Hash of this rank's optimizer shard layout (inner optimizers, groups, shapes, dtypes)."""
    desc = [
        [[[list(p.shape), str(p.dtype)] for p in g["params"]] for g in inner.optimizer.param_groups]
        for inner in optimizer_step.inner_optimizers(optimizer)
    ]
    return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]


def _seconds_since_process_start() -> float:
    return time.time() - psutil.Process().create_time()


def _run_id(diff_dir: str, mode: str) -> str:
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


def format_metrics(metrics: dict[str, float]) -> str:
    """:meth:`DiffCheckpointManager.metrics` as fields of a Megatron-style log line."""
    text = f" recoverable lag: {int(metrics['recoverable_lag'])} |"
    if "bytes_per_iteration" in metrics:
        text += (
            f" diff bytes per iteration: {metrics['bytes_per_iteration'] / 1e3:.1f} KB |"
            f" writer backlog: {int(metrics['writer_backlog'])} |"
        )
    if "merge_backlog" in metrics:
        text += f" merge backlog: {int(metrics['merge_backlog'])} |"
    if "keeper_lag" in metrics:
        text += (
            f" keeper lag: {int(metrics['keeper_lag'])} |"
            f" keeper memory (MiB): {metrics['keeper_mib']:.1f}/{metrics['keeper_cap_mib']:.0f} |"
        )
    return text


class DiffCheckpointManager:
    """Captures every iteration's differential and recovers from base + differentials.

    Args:
        config: the ``--diffckpt-*`` settings.
        save_dir: the checkpoint folder (``--save``); the diff log defaults to
            ``save_dir/diffckpt``.
        optimizer: the megatron optimizer (chained or not).
        rng_tracker: megatron's tensor-parallel RNG tracker (``get_cuda_rng_tracker()``).
        coords: this rank's ``(tp, pp, dp)`` ranks.
        model_chunks: the megatron DDP modules (needed by ``--diffckpt-mode lowdiff-plus``, whose
            snapshots hook their gradient buckets).
        residuals: the compressed exchange's error-feedback residuals (``None``: dense), which a
            base kept in the node's keeper holds with the optimizer shard.
    """

    def __init__(
        self,
        config: DiffCkptConfig,
        save_dir: str,
        optimizer: Any,
        rng_tracker: Any,
        coords: tuple[int, int, int],
        model_chunks: list[Any] | None = None,
        residuals: Any = None,
    ):
        self.config = config
        self.residuals = residuals
        self.model_chunks = model_chunks or []
        self.strategy: PerIterationStrategy | None = None  # set by start()
        self.save_dir = save_dir
        self.space = BaseSpace(save_dir, config.when_full)
        self.dir = config.dir or os.path.join(save_dir, "diffckpt")
        self.optimizer = optimizer
        self.rng_tracker = rng_tracker
        tp, pp, dp = coords
        self.identity = SegmentIdentity(
            _run_id(self.dir, config.mode), tp, pp, dp, shard_layout_hash(optimizer)
        )
        self.rank_dir = os.path.join(self.dir, self.identity.dirname())
        self.keeper = KeeperClient.from_env(self.identity) if config.keeper != "off" else None
        """The node's keeper (:mod:`~megatron_diffckpt.keeper`), when the launcher runs one."""
        self.plan = config.keeper_plan() if self.keeper is not None else KeeperPlan()
        """What the keeper does for this rank (``--diffckpt-keeper``)."""
        self.writer: DiffLogWriter | None = None
        self.tuner: OnlineTuner | None = None
        self.full_interval = 0  # F; set by start()
        self._last_base = 0
        self._start_base: int | None = None  # a fresh job's starting point, until it is saved
        self._base_saved: tuple[int, float, float] | None = None  # (iteration, start, stall)
        self._published: dict[int, float] = {}  # base iteration -> when it was published
        self._published_bases: list[int] = []
        self._recovery: tuple[float, float | None, float] | None = None
        self._from_keeper: tuple[int, list[Any]] | None = None  # the keeper replica's, recovered
        self._in_keeper = False  # LowDiff+'s replica lives in the node's keeper
        # LowDiff's bases staged in the node's keeper too
        self._stager = (
            bases.BaseStager(self.keeper, replica=self.plan.replica)
            if self.plan.kept_bases
            else None
        )
        self._kept_refused = False
        self._ended: tuple[int, int, int] | None = None  # (iteration, scheduler steps, consumed)
        self._scanned: tuple[int, Any, recovery.TieredChain, float, float] | None = None
        self._shard_maps = ShardMapRecorder(self.rank_dir, config.when_full)
        self.last_diff_seconds = 0.0
        """Training-path time of the last differential: capture, record, hand-off."""

    def recover_from_keeper(
        self, storage_base: int | None = None, loaded: bool = False
    ) -> tuple[int, int, int] | None:
        """Recover from the node keepers' memory, before (instead of) loading a base when every
        rank can. All ranks, collectively.

        LowDiff+ with ``--diffckpt-option keeper_replica``: from the keepers' replicas (nothing
        replayed). LowDiff under a keeper: from the newest base every rank's keeper holds
        (:mod:`~megatron_diffckpt.keeper.bases`), when it is at least ``storage_base`` (storage's
        newest; newer than it when the loop ``loaded`` it already), then the differentials
        after it; with ``--diffckpt-option keeper_replica`` first from the keepers' replicas of that
        base stepped with the differentials (nothing replayed). Returns ``(iteration,
        scheduler_steps, consumed_samples)``; ``None``: load storage's newest base and
        :meth:`recover` as without keepers.
        """
        if self.config.mode == "lowdiff-plus" and self.plan.replica:
            return self._recover_replica()
        if self._stager is not None and storage_base is not None:
            if self._stager.replica:
                got = self._recover_rolled(storage_base)
                if got is not None:
                    return got
            return self._recover_kept_base(storage_base, loaded)
        return None

    def _torch_optimizers(self) -> list[Any]:
        return [
            None if getattr(o, "is_stub_optimizer", False) else o.optimizer
            for o in optimizer_step.inner_optimizers(self.optimizer)
        ]

    def _from_keepers_replicas(self, **lowdiff: Any) -> Any:
        """:func:`~megatron_diffckpt.keeper.replica_client.recover_from_keepers` for this rank
        (``lowdiff``: LowDiff's bounds and residuals). All ranks, collectively."""
        return replica_client.recover_from_keepers(
            self.keeper,
            self._torch_optimizers(),
            lambda: optimizer_step.publish_main_params(self.optimizer),
            self.rng_tracker,
            recovery.all_reduce_min,
            **lowdiff,
        )

    def _recover_replica(self) -> tuple[int, int, int] | None:
        since_process_start = _seconds_since_process_start()
        got = self._from_keepers_replicas()
        if got is None:
            return None
        target, record, seconds, description, tier = got
        logger.info(
            "recovery: iteration %d from the replica in %s in %.3f s (nothing replayed)",
            target,
            tier,
            seconds,
        )
        self._from_keeper = (target, description)
        self._recovery = (seconds, None, max(0.0, since_process_start))
        return target, record.scalars["scheduler_steps"], record.scalars["consumed_samples"]

    def _recover_rolled(self, storage_base: int) -> tuple[int, int, int] | None:
        """LowDiff with the keeper's replica: the state at the newest iteration every rank's
        keeper replica reaches (no older than storage's newest base, within every rank's chain),
        nothing replayed; storage's log is then made to reach it as after a replay."""
        since_process_start = _seconds_since_process_start()
        start = time.perf_counter()
        scan, chain, _, _ = self._chain(storage_base)
        got = self._from_keepers_replicas(
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
        self._replay_chain(
            scan, chain, target, target, time.perf_counter() - start, since_process_start
        )
        return target, record.scalars["scheduler_steps"], record.scalars["consumed_samples"]

    def _recover_kept_base(self, storage_base: int, loaded: bool) -> tuple[int, int, int] | None:
        since_process_start = _seconds_since_process_start()
        start = time.perf_counter()
        scan, chain, _, _ = self._chain(storage_base)
        offered = bases.offered_bases(self.keeper)
        agreed = bases.agree_on_kept_base(
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
        bases.load_kept_base(row, self._torch_optimizers(), self.residuals)
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
        last = self._replay_chain(scan, chain, base, target, load_s, since_process_start)
        last = last or record
        return target, last.scalars["scheduler_steps"], last.scalars["consumed_samples"]

    def _chain(self, base_iteration: int) -> tuple[Any, recovery.TieredChain, float, float]:
        """This rank's chain after ``base_iteration``: storage's diff log, then its keeper's
        records; with the seconds each tier took to read. Any rank (kept for :meth:`recover`
        after a look that did not recover)."""
        if self._scanned is not None and self._scanned[0] == base_iteration:
            return self._scanned[1:]
        self._quiesce_keepers_log()  # an earlier attempt's writer in the keeper: done
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

    def recover(
        self, base_iteration: int, base_load_s: float = 0.0
    ) -> tuple[int, int | None, int | None]:
        """Replay the differentials after the loaded base. All ranks, collectively.

        ``base_load_s`` (how long loading the base took) feeds the auto-tuner. Returns
        ``(iteration, scheduler_steps, consumed_samples)``; the last two are ``None`` when there
        was nothing to replay (the base's own values stand).
        """
        since_process_start = _seconds_since_process_start()
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
        last = self._replay_chain(
            scan, chain, base_iteration, target, base_load_s, since_process_start, read_s
        )
        if last is None:
            return target, None, None
        return target, last.scalars["scheduler_steps"], last.scalars["consumed_samples"]

    def _replay_chain(
        self,
        scan: Any,
        chain: recovery.TieredChain,
        after: int,
        target: int,
        base_load_s: float,
        since_process_start: float,
        read_s: float | None = None,
    ) -> DiffRecord | None:
        """Replay ``chain``'s records after ``after`` up to ``target``, then make storage's log
        end at ``target`` with every iteration the chain holds in it (those only a keeper held
        written back). The last record replayed, or ``None``. All ranks, collectively."""
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
        self._recovery = (
            base_load_s,
            replay_s / len(records) if records else None,
            max(0.0, since_process_start - base_load_s),
        )
        if os.path.isdir(self.rank_dir):
            self._quiesce_keepers_log()
            recovery.truncate_log(self.rank_dir, scan, target)
        recovery.fill_log(
            self.rank_dir,
            self.identity,
            self._compressor_name(),
            [r for r in chain.records if scan.last_iteration < r.iteration <= target],
        )
        return last

    def _quiesce_keepers_log(self) -> None:
        """Before this rank reads or cuts its diff log: when the node's keeper writes it
        (LowDiff+ with its replica there, LowDiff with ``--diffckpt-option keeper_writes_log``), the
        keeper writes what it holds and then nothing more until this rank opens its replica or
        log again, so nothing of an earlier attempt lands after the cut."""
        if self.config.mode == "lowdiff-plus" and self.plan.replica:
            self.keeper.call({"op": Op.REPLICA_LOG_FLUSH})
        elif self.config.mode == "lowdiff" and self.keeper:  # --diffckpt-option keeper_writes_log
            self.keeper.call({"op": Op.LOG_CLOSE})

    def _storage_tracker(self) -> int:
        """The iteration storage's tracker names (0: none yet)."""
        try:
            return find_latest_iteration(self.save_dir)
        except CheckpointNotFoundError:
            return 0

    def _compressor_name(self) -> str:
        return make_compressor(self.config.compressor, self.config.topk_ratio).name

    def _refuse_another_layout(self, scan: Any, base_iteration: int) -> None:
        """Differentials after the base written by this run under another optimizer shard layout
        (another TP, PP or DP size, or another model): replaying them is impossible, and
        resuming from the base alone would silently drop them. All ranks, collectively."""
        foreign = scan.foreign
        mine = foreign is not None and foreign.run_id == self.identity.run_id
        if recovery.all_reduce_min([0 if mine else 1])[0] == 1:
            return
        where = f" (this rank's log holds {foreign})" if mine else ""
        raise DiffCkptUsageError(
            f"the diff log {self.dir} holds differentials after base {base_iteration} written "
            f"under another parallel layout or model than this run's{where}; resume with the "
            "layout and model flags that wrote them, or first merge them into a base "
            f"(megatron-diffckpt merge {self.save_dir} --out DIR2) and --load DIR2"
        )

    def record_shard_map(
        self, make_sharded_state_dict: Callable[[], dict], parallel: tuple[int, int, int]
    ) -> None:
        """Write this rank's shard map beside its diff log, for ``megatron-diffckpt merge``.

        Call it after iterations; it acts once per process, after the first step that created
        the optimizer state (megatron's optimizer state dict needs it). ``make_sharded_state_dict``
        returns what a base of this rank holds (``{"model": ..., "optimizer": ...}``) from the
        training state; ``parallel`` is the (TP, PP, DP) sizes. Any rank (each writes its own);
        durable on return. An optimizer the map cannot describe (not megatron's distributed
        optimizer in the ``dp_reshardable`` format) is logged, and ``merge`` refuses the run.
        """
        if self._shard_maps.done or (self.writer is None and not self._in_keeper):
            return  # bases only: nothing past them to merge or place
        inner = [
            i
            for i in optimizer_step.inner_optimizers(self.optimizer)
            if not getattr(i, "is_stub_optimizer", False)
        ]
        if any(not i.optimizer.state for i in inner):
            return  # no step yet (or only skipped ones)

        def build() -> ShardMap:
            sources = optimizer_layout.main_param_sources(self.optimizer)
            torch_optimizers = [
                None if src is None else inner.optimizer
                for inner, src in zip(
                    optimizer_step.inner_optimizers(self.optimizer), sources, strict=True
                )
            ]
            return build_shard_map(
                make_sharded_state_dict(),
                torch_optimizers,
                sources,
                self.identity.layout_hash,
                (self.identity.tp_rank, self.identity.pp_rank, self.identity.dp_rank),
                parallel,
            )

        self._shard_maps.record(build)

    def start(self, iteration: int, full_interval: int) -> None:
        """Begin capturing after ``iteration``, with bases every ``full_interval`` (F). All ranks.

        With ``--diffckpt-auto-tune``, F and the write batch B then change at run time.
        """
        self.full_interval = full_interval
        self._last_base = iteration
        # A job that starts without a base to recover from (from scratch) has no recoverable
        # state until its first base: the training loop saves one at the start (base_due), and
        # it is published before the first iteration (LowDiff+ waits for its persister; a loop
        # with asynchronous saves finalizes it), so every iteration is recoverable.
        self._start_base = iteration if self._recovery is None else None
        children_die_with_this_process()  # megatron's writers never outlive a killed rank
        base_checkpoint.warm_up_writer()  # the first base then costs what later ones cost
        if self._recovery is None and os.path.isdir(self.rank_dir):
            # A start without recovery (training from scratch into a folder that holds a log):
            # differentials after ``iteration`` belong to an earlier incarnation and must never
            # be replayed into this one.
            scan = scan_rank_log(self.rank_dir, self.identity, iteration)
            self._quiesce_keepers_log()
            recovery.truncate_log(self.rank_dir, scan, iteration)
        batch_size, diff_log = self.config.batch_size, True
        if self.config.auto_tune:
            decided = load_decision(self.dir)
            if decided is not None:
                full_interval, batch_size = decided.full_interval, decided.batch_size
                self.full_interval, diff_log = full_interval, decided.diff_log
            settings = TunerSettings(
                mtbf_s=self.config.mtbf_hours * 3600.0,
                host_memory_budget=self.config.options.host_memory_budget * 2.0**20,
                max_pending=self.config.options.max_pending,
                plus=self.config.mode == "lowdiff-plus",
            )
            self.tuner = OnlineTuner(settings, full_interval, batch_size, diff_log)
            if self._recovery is not None:
                self.tuner.observe_recovery(*self._recovery)
            else:
                self.tuner.observe_start(_seconds_since_process_start())
        plus = self.config.mode == "lowdiff-plus"
        in_keeper = plus and self.plan.replica
        if plus and self.keeper is None and self.config.forced("keeper_replica"):
            logger.warning(
                "--diffckpt-option keeper_replica=true: no keeper runs on this node (start "
                "the job under megatron-diffckpt-launch --keeper-memory MIB); the replica "
                "stays in this process"
            )
        keeper_log = None
        if in_keeper and self.config.options.diff_log:
            # the keeper writes the diff log from its merges (keeper.replicas.ReplicaLog)
            keeper_log = {
                "root": self.dir,
                "compressor": self._compressor_name(),
                "batch_size": batch_size,
                "max_pending": self.config.options.max_pending,
                "when_full": self.config.when_full,
                "direct_io": not self.config.options.buffered_io,
                "slow_hint": PLUS_SLOW_HINT,
                # recovered from a keeper: storage's chain may end before (a peer's replica)
                "durable": self._storage_tracker() if self._from_keeper is not None else None,
            }
        writer_class = DiffLogWriter
        if self.plan.writes_log:
            writer_class = KeeperLogWriter  # the keeper writes the segments (keeper.logs)
        elif self.keeper is None and self.config.forced("keeper_writes_log"):
            logger.warning(
                "--diffckpt-option keeper_writes_log=true: no keeper runs on this node (start "
                "the job under megatron-diffckpt-launch --keeper-memory MIB); this rank writes "
                "its diff log"
            )
        if not (plus and (not self.config.options.diff_log or not diff_log or in_keeper)):
            self.writer = writer_class(
                self.dir,
                self.identity,
                self._compressor_name(),
                batch_size=batch_size,
                max_pending=self.config.options.max_pending,
                when_full=self.config.when_full,
                chain_start=iteration,
                **({"slow_hint": PLUS_SLOW_HINT} if plus else {}),
                sink=self.keeper,
                direct_io=not self.config.options.buffered_io,
            )
        if self.writer is None and self._from_keeper is None:
            self._published_bases.append(iteration)  # bases only: durable from the start on
        self._in_keeper = in_keeper
        if self.config.mode == "lowdiff-plus":
            trace = os.path.join(self.dir, "trace", f"{self.identity.dirname()}.json")
            self.strategy = LowDiffPlusStrategy(
                self.optimizer,
                self.model_chunks,
                self.config.options.max_pending,
                self.writer,
                self.rng_tracker,
                trace_path=trace,
                on_base_failed=self.base_failed,
                keeper=self.keeper if in_keeper else None,
                keeper_log=keeper_log,
                keeper_writes_bases=self.plan.writes_bases,
            )
            if in_keeper and self._from_keeper is not None:
                self.strategy.merger.resumed = self._from_keeper
        else:
            self.strategy = LowDiffStrategy(
                self.optimizer,
                self.writer,
                self.rng_tracker,
                before_step=self._kept_staged if self._stager is not None else None,
            )
        self.strategy.start(iteration)

    def end_iteration(
        self,
        iteration: int,
        scheduler_steps: int,
        consumed_samples: int,
        train_seconds: float | None = None,
    ) -> None:
        """Hand ``iteration``'s differential to the background. All ranks.

        ``train_seconds``, the iteration's forward, backward and optimizer step, feeds the
        auto-tuner; with it on, every ``--diffckpt-option retune_interval`` iterations this is
        also a collective that agrees on a new F and B.
        """
        cost = self.strategy.end_iteration(iteration, scheduler_steps, consumed_samples)
        self._ended = (iteration, scheduler_steps, consumed_samples)
        failpoints.reach("iteration-end")
        self.last_diff_seconds = cost.path_s
        if self.tuner is None:
            return
        for sample in self.writer.take_samples() if self.writer is not None else ():
            self.tuner.observe_write(sample.records, sample.nbytes, sample.write_s, sample.sync_s)
        if train_seconds is not None:
            self.tuner.observe_iteration(
                max(train_seconds - cost.inside_step_s, 1e-9), cost.path_s, cost.since_step_s
            )
        if iteration % self.config.options.retune_interval == 0:
            self._retune(iteration)

    def _retune(self, iteration: int) -> None:
        """Agree on the ranks' proposals (MIN of F and of B) and adopt them. All ranks."""
        full_interval, batch_size, log = recovery.all_reduce_min(
            list(self.tuner.propose(iteration))
        )
        diff_log = bool(log) and self.tuner.diff_log
        current_b = self.writer.batch_size if self.writer is not None else batch_size
        if (full_interval, batch_size, diff_log) != (
            self.full_interval,
            current_b,
            self.tuner.diff_log,
        ):
            logger.info(
                "auto-tune at iteration %d: F %d -> %d, B %d -> %d%s (agreed by all ranks)",
                iteration,
                self.full_interval,
                full_interval,
                current_b,
                batch_size,
                "" if diff_log else ", diff log off (LowDiff+ bases only)",
            )
            if torch.distributed.get_rank() == 0:
                save_decision(self.dir, Decision(full_interval, batch_size, diff_log, iteration))
        if not diff_log and self.tuner.diff_log:
            logger.warning(
                "auto-tune at iteration %d: LowDiff+ stops writing the diff log (storage cannot "
                "take a dense differential every iteration, and bases only is cheaper): a "
                "recoverable state at every base from now on, every %d iterations",
                iteration,
                full_interval,
            )
            self.strategy.stop_diff_log()
        self.tuner.apply(full_interval, batch_size, diff_log)
        self.full_interval = full_interval
        if self.writer is not None:
            self.writer.batch_size = batch_size  # segments may have any length: safe anytime

    def base_due(self, iteration: int) -> bool:
        """Whether ``iteration`` ends with a base. Any rank (all agree).

        Fixed F: Megatron's rule, every multiple of F. Auto-tuned F: F iterations after the
        newest base, so a new F applies from the newest base on. A job that started without
        recovering (from scratch) has its base due at the iteration it started from, until
        that base is saved.
        """
        if self._start_base is not None and iteration == self._start_base:
            return True
        if self.full_interval < 1:
            return False
        if self.tuner is None:
            return iteration % self.full_interval == 0
        return iteration - self._last_base >= self.full_interval

    def save_base(self, iteration: int, save: SaveBase) -> float:
        """Write a base of ``iteration`` through the training loop's ``save`` function (its
        protocol: :mod:`megatron_diffckpt.strategy`), from the training state (LowDiff) or from
        the host replica (LowDiff+, written in the background). Returns the seconds training was
        blocked. All ranks, collectively.

        A base that would not fit in the space left under ``--save``, or whose save fails for
        want of space, is handled by :meth:`base_failed`'s rules (skipped, or the job stopped)."""
        start = time.perf_counter()
        first = iteration == self._start_base
        waited = base_checkpoint.wait_for_writer()
        if not self._base_fits(iteration):
            return time.perf_counter() - start
        try:
            blocked = waited + self.strategy.save_base(iteration, save)
            if first:  # a job's starting point is published before its first iteration
                self.strategy.finish_bases()
                blocked = time.perf_counter() - start
        except full_storage.SAVE_FAILURES as exc:
            self.base_failed(iteration, exc)
            return time.perf_counter() - start
        if self._stager is not None:
            blocked += self._stage_kept_base(iteration)
        self.on_base_saved(iteration, blocked)
        return blocked

    def _stage_kept_base(self, iteration: int) -> float:
        """LowDiff under a keeper: begin staging the base of ``iteration`` (the training state,
        before the next step) in the keeper's memory too (:mod:`~megatron_diffckpt.keeper.bases`;
        the shard is copied while the next iteration's passes run, and its step waits for it);
        the seconds training was blocked. Only a base after an iteration this process trained
        (its counters are the last differential's): a job's starting point is storage's alone."""
        if self._ended is None or self._ended[0] != iteration:
            return 0.0
        start = time.perf_counter()
        self._kept_staged()
        _, steps, consumed = self._ended
        scalars, tensors = capture_rng(self.rng_tracker)
        record = DiffRecord(
            iteration, {"scheduler_steps": steps, "consumed_samples": consumed, **scalars}, tensors
        )
        self._stager.start(self._torch_optimizers(), self.residuals, record)
        return time.perf_counter() - start

    def _kept_staged(self) -> None:
        """Wait until the base being staged in the keeper is handed over (before the step that
        changes the state it copies); say once when the keeper did not take one."""
        why = self._stager.wait()
        if why and not self._kept_refused:
            self._kept_refused = True
            logger.warning(
                "the node's keeper did not take a base (%s): a restart loads storage's base (%s)",
                why,
                replica_client.KEEPER_FLAG_HINT,
            )

    def _base_fits(self, iteration: int) -> bool:
        """Whether a base of ``iteration`` fits in the space left under ``--save`` (see
        :meth:`BaseSpace.fits`); if not, it is given up. All ranks, collectively."""
        floor = recovery.all_reduce_sum([self._local_base_floor()])[0]
        reason = self.space.fits(floor)
        if reason is None:
            return True
        self._give_up_base(iteration, reason)
        return False

    def _local_base_floor(self) -> int:
        """The bytes this rank adds to a base at least (its distributed optimizer shard's fp32
        main parameters and moments), plus the diff-log bytes it may write during the save."""
        numel = sum(
            p.numel()
            for inner in optimizer_step.inner_optimizers(self.optimizer)
            if optimizer_layout.is_distributed(inner)
            for group in inner.optimizer.param_groups
            for p in group["params"]
        )
        in_flight = 0
        if self.writer is not None and self.writer.stats.records:
            per_record = self.writer.stats.bytes_written / self.writer.stats.records
            segments = self.writer.backlog + 1  # queued, and the one being written
            in_flight = int(per_record * self.writer.batch_size * segments)
        return 12 * numel + in_flight

    def base_failed(self, iteration: int, exc: BaseException) -> None:
        """The save or the finalize step of the base of ``iteration`` raised ``exc`` on every rank
        (megatron reports a failed save on all ranks together). All ranks, collectively.

        When storage is full on any rank: with ``--diffckpt-when-full skip`` the base is given
        up with one warning per incident (its partial folder removed; the newest published base
        and the diff log stand, and bases resume once there is space); with ``block`` the job
        stops with :class:`~megatron_diffckpt.full_storage.StorageFullError`. Any other error is
        raised again."""
        self._give_up_base(iteration, self.space.full_reason(iteration, exc))

    def _give_up_base(self, iteration: int, reason: str) -> None:
        """Base ``iteration`` cannot be written (:meth:`BaseSpace.give_up`); the next try comes
        F iterations later. All ranks, collectively."""
        self._last_base, self._start_base = iteration, None
        self.space.give_up(iteration, reason, self.durable_iteration)

    def on_base_saved(self, iteration: int, blocked_s: float) -> None:
        """A base of ``iteration`` was started; training was blocked ``blocked_s``. All ranks.

        :meth:`save_base` calls it; a loop that saves without it (Megatron-LM's, which decides
        by itself when to save) calls it after its save. A synchronous save is published before
        this call, an asynchronous one after.
        """
        self._last_base = iteration
        self._start_base = None
        self._base_saved = (iteration, time.perf_counter() - blocked_s, blocked_s)
        self._observe_base(iteration)

    def _observe_base(self, iteration: int) -> None:
        """Once a base is both saved and published: its stall and persist time to the tuner."""
        published = self._published.get(iteration)
        if self.tuner is None or published is None or self._base_saved is None:
            return
        saved, started, stall = self._base_saved
        if saved == iteration:
            self.tuner.observe_base(stall, max(0.0, published - started - stall))
            self._published.pop(iteration)

    def on_base_published(self, iteration: int) -> None:
        """A base of ``iteration`` is published: durability counts from it, and retention applies.
        All ranks, after the tracker moved (rank 0 prunes bases, every rank its differentials)."""
        self._published_bases.append(iteration)
        self.space.published(iteration)
        if self.writer is not None:
            self.writer.rebase(iteration)
        elif self._in_keeper:
            self.keeper.published(iteration)  # the keeper's writer of this rank's diff log
        if self.tuner is not None:
            self._published[iteration] = time.perf_counter()
            self._observe_base(iteration)
        keep = self.config.keep_bases
        if keep < 1:
            return
        if torch.distributed.get_rank() == 0:
            retention.prune_bases(self.save_dir, keep)
        retention.prune_diff_log(self.save_dir, self.rank_dir, keep)

    @property
    def durable_iteration(self) -> int:
        if self.writer is not None:
            return self.writer.durable_iteration
        elsewhere = self.strategy.durable_elsewhere() if self.strategy is not None else None
        return max(self._published_bases + ([elsewhere] if elsewhere is not None else []),
                   default=0)  # fmt: skip

    def metrics(self, iteration: int) -> dict[str, float]:
        """What to watch while training, after ``iteration``. Any rank, local values.

        ``diff_ms``: the last differential's (or LowDiff+ hand-off's) time on the training path;
        ``bytes_per_iteration``: diff-log bytes per record written so far; ``recoverable_lag``:
        iterations between now and the newest durable state; ``writer_backlog``: segments waiting
        for the writer; with the node's keeper, ``keeper_lag`` (iterations between now and the
        newest it holds), ``keeper_mib`` and ``keeper_cap_mib`` (what it holds, of all ranks of
        the node, and its cap); and the strategy's own (LowDiff+: ``merge_backlog``,
        ``slot_wait_ms``, ``copies_in_bubbles``; see its ``metrics``).
        """
        out = {
            "diff_ms": self.last_diff_seconds * 1000.0,
            "durable_iteration": float(self.durable_iteration),
            "recoverable_lag": float(iteration - self.durable_iteration),
        }
        if self.writer is not None:
            stats = self.writer.stats
            out["bytes_per_iteration"] = stats.bytes_written / max(stats.records, 1)
            out["writer_backlog"] = float(self.writer.backlog)
        kept = self.keeper.stats() if self.keeper is not None else {}
        if kept and (self.writer is not None or self._in_keeper):
            # the iteration the keeper holds: the diff log's records, or the replica's input
            out["keeper_lag"] = float(iteration - self.keeper.held_iteration)
            out["keeper_mib"] = (kept["bytes"] + kept.get("reserved", 0)) / 2**20
            out["keeper_cap_mib"] = kept["memory"] / 2**20
        if self.strategy is not None:
            out.update(self.strategy.metrics())
        return out

    def finish_bases(self) -> None:
        """Wait until every base in flight is published. All ranks, collectively (where the
        training loop waits for its own asynchronous saves)."""
        self.strategy.finish_bases()

    def replica_view(self) -> Any | None:
        """LowDiff+: the optimizer seen through the host replica (read only); else ``None``."""
        return self.strategy.replica_view() if self.strategy is not None else None

    def close(self) -> None:
        """Finish what is in flight (a pending base included), write what is pending, and
        stop. All ranks."""
        if self.strategy is not None:
            self.strategy.close()
            self.strategy = None
        if self.writer is not None:
            self.writer.close()
        if self._stager is not None:
            self._kept_staged()
        if self.keeper is not None:
            self.keeper.close()
