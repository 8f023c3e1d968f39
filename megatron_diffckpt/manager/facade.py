"""``DiffCheckpointManager``: the one object a training loop talks to.

Call sequence, every call on all ranks::

    manager = DiffCheckpointManager(config, save_dir, optimizer, rng_tracker, coords, chunks)
    got = manager.recover(storage_newest, load_base)   # on a resume: keepers, then storage
    manager.start(got.iteration if got else 0, full_interval)
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

What happens every iteration is the strategy's (:mod:`megatron_diffckpt.strategies.base`): LowDiff
(:class:`~megatron_diffckpt.strategies.lowdiff.LowDiffStrategy`) or LowDiff+
(:class:`~megatron_diffckpt.strategies.lowdiff_plus.LowDiffPlusStrategy`); the manager does what
both share: recovery (:mod:`.recovery`), the diff log, the bases' bookkeeping (:mod:`.bases`),
retention and auto-tuning (:mod:`.tuning`). Bases are the training loop's stock dist checkpoints
(written from the training state or from the LowDiff+ replica); the diff log runs continuously
across them, and recovery replays from the newest base the differentials after it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from megatron_diffckpt import failpoints, out_of_space, recovery, retention
from megatron_diffckpt.autotune import (
    OnlineTuner,
)
from megatron_diffckpt.background import (
    helpers_die_with_this_rank,
    quiet_child_exits_at_exit,
)
from megatron_diffckpt.base_space import BaseSpace
from megatron_diffckpt.compression import make_compressor
from megatron_diffckpt.config import DiffCkptConfig, KeeperPlan
from megatron_diffckpt.control import JobControl
from megatron_diffckpt.keeper.base_stager import BaseStager
from megatron_diffckpt.keeper.client import KeeperClient
from megatron_diffckpt.keeper.logs import KeeperLogWriter
from megatron_diffckpt.manager.bases import KeptBaseStaging, base_floor_bytes
from megatron_diffckpt.manager.metrics import collect_metrics
from megatron_diffckpt.manager.recovery import (
    Recovered,
    TieredRecovery,
)
from megatron_diffckpt.manager.run import run_id, shard_layout_hash
from megatron_diffckpt.manager.tuning import retune, start_tuner
from megatron_diffckpt.patches import base_checkpoint, optimizer_layout, optimizer_step
from megatron_diffckpt.shard_map import ShardMap, ShardMapRecorder, build_shard_map
from megatron_diffckpt.storage.format import SegmentIdentity
from megatron_diffckpt.storage.reader import scan_rank_log
from megatron_diffckpt.storage.writer import DiffLogWriter
from megatron_diffckpt.strategies.base import PerIterationStrategy, SaveBase
from megatron_diffckpt.strategies.lowdiff import LowDiffStrategy
from megatron_diffckpt.strategies.lowdiff_plus import LowDiffPlusStrategy

logger = logging.getLogger(__name__)

PLUS_SLOW_HINT = (
    "LowDiff+ writes the dense gradient shard every iteration: run with "
    "--diffckpt-option diff_log=false (bases only, as often as storage writes them) or let "
    "--diffckpt-auto-tune choose from the measured costs"
)


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
            run_id(self.dir, config.mode), tp, pp, dp, shard_layout_hash(optimizer)
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
        self.recovered: Recovered | None = None
        self.control: JobControl | None = None  # started by recover() or start()
        """What :meth:`recover` did (``None``: a fresh start)."""
        self._ended: tuple[int, int, int] | None = None  # (iteration, scheduler steps, consumed)
        self._shard_maps = ShardMapRecorder(self.rank_dir, config.when_full)
        self.last_diff_seconds = 0.0
        """Training-path time of the last differential: capture, record, hand-off."""
        self.tiers = TieredRecovery(
            mode=config.mode,
            plan=self.plan,
            keeper=self.keeper,
            identity=self.identity,
            rank_dir=self.rank_dir,
            diff_dir=self.dir,
            save_dir=save_dir,
            optimizer=optimizer,
            rng_tracker=rng_tracker,
            residuals=residuals,
            compressor=make_compressor(config.compressor, config.topk_ratio).name,
        )
        """The recovery across tiers (:meth:`recover`)."""
        self._kept = (  # LowDiff's bases staged in the node's keeper too
            KeptBaseStaging(
                BaseStager(self.keeper, replica=self.plan.replica),
                self.tiers.torch_optimizers,
                residuals,
                rng_tracker,
            )
            if self.plan.kept_bases
            else None
        )

    @property
    def _replica_in_keeper(self) -> bool:
        """LowDiff+'s replica and merger live in the node's keeper (``--diffckpt-keeper``)."""
        return self.config.mode == "lowdiff-plus" and self.plan.replica

    def recover(
        self,
        storage_base: int | None,
        load_base: Callable[[], int] | None = None,
        base_load_s: float = 0.0,
    ) -> Recovered:
        """Recover the training state, trying the tiers in order: the node keepers' replicas,
        their kept bases, then storage (:mod:`~megatron_diffckpt.manager.recovery`). All ranks,
        collectively; call it before :meth:`start` when the loop resumes (``--load``).

        ``storage_base`` is storage's newest base (``None``: none). ``load_base`` loads it into
        the model and optimizer and returns its iteration; the loop gives it when it has not
        loaded a base yet, and it is called only when no keeper tier served (``None``: the loop
        loaded ``storage_base`` already, Megatron-LM's, and a keeper tier must be newer to
        replace it). ``base_load_s`` is time the loop spent loading before this call (it feeds
        the auto-tuner, with what ``load_base`` takes). The result says where the state is:
        its ``scheduler_steps`` and ``consumed_samples`` are ``None`` when nothing was replayed
        onto the loaded base (the base's own values stand).
        """
        self._control()
        got = self.tiers.from_keepers(storage_base, loaded=load_base is None)
        if got is None:
            start = time.perf_counter()
            base = load_base() if load_base is not None else storage_base
            got = self.tiers.from_storage(base or 0, base_load_s + time.perf_counter() - start)
        self.recovered = got
        return got

    def _control(self) -> JobControl:
        """This attempt's control plane (:mod:`megatron_diffckpt.control`), started at the
        first call. All ranks, collectively."""
        if self.control is None:
            self.control = JobControl.start(self.config.options.collective_timeout)
        return self.control

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
        if self._shard_maps.done or (self.writer is None and not self._replica_in_keeper):
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
        self._control()
        self.full_interval = full_interval
        self._last_base = iteration
        # A job that starts without a base to recover from (from scratch) has no recoverable
        # state until its first base: the training loop saves one at the start (base_due), and
        # it is published before the first iteration (LowDiff+ waits for its persister; a loop
        # with asynchronous saves finalizes it), so every iteration is recoverable.
        self._start_base = iteration if self.recovered is None else None
        helpers_die_with_this_rank()  # megatron's writers never outlive a killed rank
        quiet_child_exits_at_exit()  # the DataLoader workers' exits: no stray line at the end
        base_checkpoint.warm_up_writer()  # the first base then costs what later ones cost
        if self.recovered is None and os.path.isdir(self.rank_dir):
            # A start without recovery (training from scratch into a folder that holds a log):
            # differentials after ``iteration`` belong to an earlier incarnation and must never
            # be replayed into this one.
            scan = scan_rank_log(self.rank_dir, self.identity, iteration)
            self.tiers.quiesce_keepers_log()
            recovery.truncate_log(self.rank_dir, scan, iteration)
        batch_size, diff_log = self.config.batch_size, True
        if self.config.auto_tune:
            self.tuner, full_interval, batch_size, diff_log = start_tuner(
                self.config, self.dir, full_interval, self.recovered, self._replica_in_keeper
            )
            self.full_interval = full_interval
        plus = self.config.mode == "lowdiff-plus"
        in_keeper = self._replica_in_keeper
        # recovered from a keeper's LowDiff+ replica: (its iteration, its description)
        replica = self.recovered.replica if self.recovered is not None else None
        if plus and self.keeper is None and self.config.forced("keeper_replica"):
            logger.warning(
                "--diffckpt-option keeper_replica=true: no keeper runs on this node (start "
                "the job under megatron-diffckpt-launch --keeper-memory MIB); the replica "
                "stays in this process"
            )
        keeper_log = None
        if in_keeper and self.config.options.diff_log:
            # the keeper writes the diff log from its merges (keeper.hosted_replica.ReplicaLog)
            keeper_log = {
                "root": self.dir,
                "compressor": self.tiers.compressor,
                "batch_size": batch_size,
                "max_pending": self.config.options.max_pending,
                "when_full": self.config.when_full,
                "direct_io": not self.config.options.buffered_io,
                "slow_hint": PLUS_SLOW_HINT,
                # recovered from a keeper: storage's chain may end before (a peer's replica)
                "durable": self.tiers.storage_tracker() if replica is not None else None,
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
                self.tiers.compressor,
                batch_size=batch_size,
                max_pending=self.config.options.max_pending,
                when_full=self.config.when_full,
                chain_start=iteration,
                **({"slow_hint": PLUS_SLOW_HINT} if plus else {}),
                sink=self.keeper,
                direct_io=not self.config.options.buffered_io,
                # LowDiff+'s merger hands over records that lie in a snapshot slot
                **({"serialise_at_append": True} if plus and writer_class is DiffLogWriter else {}),
            )
        if self.writer is None and replica is None:
            self._published_bases.append(iteration)  # bases only: durable from the start on
        if self.config.mode == "lowdiff-plus":
            trace = os.path.join(self.dir, "trace", f"{self.identity.dirname()}.json")
            self.strategy = LowDiffPlusStrategy(
                self.optimizer,
                self.model_chunks,
                self.config.options.max_pending,
                self.writer,
                self.rng_tracker,
                trace_path=trace,
                agree_on_base=self.agree_on_base,
                keeper=self.keeper if in_keeper else None,
                keeper_log=keeper_log,
                keeper_writes_bases=self.plan.writes_bases,
                max_merge_wait_s=self._max_merge_wait_ms() / 1000.0 or None,
                replica=self.tuner.replica if self.tuner is not None else True,
                kernel=self.config.options.replica_kernel,
            )
            if in_keeper and replica is not None:
                self.strategy.merger.resumed = replica
        else:
            self.strategy = LowDiffStrategy(
                self.optimizer,
                self.writer,
                self.rng_tracker,
                before_step=self._kept.wait if self._kept is not None else None,
            )
        self.strategy.start(iteration)

    def _max_merge_wait_ms(self) -> int:
        """LowDiff+'s bound on training's wait for its merger: the user's, else the
        auto-tuner's (0: none)."""
        tuned = self.tuner.merge_wait_ms if self.tuner is not None else 0
        return self.config.options.max_merge_wait_ms or tuned

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
        if self.config.when_full == "strict" and self.writer is not None:
            # LowDiff's append waited already; LowDiff+'s log thread appends once the
            # iteration's snapshots have landed
            self.writer.wait_durable(iteration - self.writer.batch_size)
        failpoints.reach("iteration-end")
        self.last_diff_seconds = cost.path_s
        if self.tuner is None:
            return
        for sample in self.writer.take_samples() if self.writer is not None else ():
            self.tuner.observe_write(sample.records, sample.nbytes, sample.write_s, sample.sync_s)
        if train_seconds is not None:
            self.tuner.observe_iteration(
                max(train_seconds - cost.inside_step_s, 1e-9),
                cost.path_s - cost.merge_wait_s,
                cost.since_step_s,
                cost.merge_wait_s,
            )
        if iteration % self.config.options.retune_interval == 0:
            self.full_interval = retune(
                self.tuner, iteration, self.full_interval, self.writer, self.strategy, self.dir
            )

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
        protocol: :mod:`megatron_diffckpt.strategies.base`), from the training state (LowDiff) or
        from
        the host replica (LowDiff+, written in the background). Returns the seconds training was
        blocked. All ranks, collectively.

        A base that would not fit in the space left under ``--save``, or whose save fails for
        want of space, is handled by :meth:`base_failed`'s rules (skipped, or the job stopped)."""
        start = time.perf_counter()
        first = iteration == self._start_base
        waited = base_checkpoint.wait_for_writer()
        if not self._base_fits(iteration):
            return time.perf_counter() - start
        blocked, error = 0.0, None
        try:
            blocked = waited + self.strategy.save_base(iteration, save)
            if first:  # a job's starting point is published before its first iteration
                self.strategy.finish_bases()
                blocked = time.perf_counter() - start
        except out_of_space.SAVE_FAILURES as exc:  # agreed on with every rank below
            error = exc
        if not self.agree_on_base(iteration, "save", error):
            return time.perf_counter() - start
        if self._kept is not None:
            blocked += self._kept.stage(iteration, self._ended)
        self.on_base_saved(iteration, blocked)
        return blocked

    def _base_fits(self, iteration: int) -> bool:
        """Whether a base of ``iteration`` fits in the space left under ``--save`` (see
        :meth:`BaseSpace.fits`); if not, it is given up. All ranks, collectively."""
        floor = recovery.all_reduce_sum(
            [base_floor_bytes(self.optimizer, self.writer)], what=f"base {iteration}: its size"
        )[0]
        reason = self.space.fits(floor)
        if reason is None:
            return True
        self._give_up_base(iteration, reason)
        return False

    def base_failed(self, iteration: int, exc: BaseException) -> None:
        """The finalize step of the base of ``iteration`` raised ``exc`` on this rank: agreed
        on with the others, which reach the same exchange in :meth:`on_base_published` (or
        theirs failed too), by :meth:`agree_on_base`'s rules. All ranks, collectively."""
        self.agree_on_base(iteration, "finalize", exc)

    def agree_on_base(self, iteration: int, step: str, error: BaseException | None) -> bool:
        """Whether the ``step`` (``save`` or ``finalize``) of the base of ``iteration``
        succeeded on every rank; ``error``: this rank's failure. One exchange every rank
        reaches, failed or not, before any acts (:meth:`JobControl.agree
        <megatron_diffckpt.control.JobControl.agree>`).

        When storage is full on any rank: with ``--diffckpt-when-full skip`` the base is given
        up with one warning per incident (its partial folder removed; the newest published
        base and the diff log stand, and bases resume once there is space): ``False``; with
        ``block`` the job stops with :class:`~megatron_diffckpt.out_of_space.StorageFullError`.
        Any other failure on any rank stops every rank with
        :class:`~megatron_diffckpt.control.JobFault`, in one line naming the first failed rank
        and its cause; a failed rank whose peers do not come to the exchange (they wait in a
        collective of megatron's it left) stops the job after
        :data:`~megatron_diffckpt.control.FAILED_WAIT_S`. All ranks, collectively."""
        what = f"base {iteration}: {step}"
        reason = self.space.full_reason(iteration, error) if error is not None else None
        agreed = self._control().agree(what, error, full=reason is not None)
        if not agreed.failed:
            return True
        if not agreed.full:
            self._control().stop_agreed(what, agreed, error)
        self._give_up_base(iteration, reason or "storage is full on another rank")
        return False

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
        All ranks, after the tracker moved (rank 0 prunes bases, every rank its differentials),
        once every rank's finalize step agreed it succeeded (:meth:`agree_on_base`)."""
        if not self.agree_on_base(iteration, "finalize", None):
            return
        self._published_bases.append(iteration)
        self.space.published(iteration)
        if self.writer is not None:
            self.writer.rebase(iteration)
        elif self._replica_in_keeper:
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
        return collect_metrics(
            iteration,
            self.last_diff_seconds,
            self.durable_iteration,
            self.writer,
            self.keeper if self.writer is not None or self._replica_in_keeper else None,
            self.strategy,
        )

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
        if self._kept is not None:
            self._kept.wait()
        if self.keeper is not None:
            self.keeper.close()
        if self.control is not None:
            self.control.close()
