"""LowDiff+ on one rank: snapshots, merger and base persistence, wired to megatron's hooks.

The :class:`~megatron_diffckpt.manager.DiffCheckpointManager` owns one
:class:`LowDiffPlusStrategy` in ``--diffckpt-mode lowdiff-plus`` (the
:class:`~megatron_diffckpt.strategies.base.PerIterationStrategy` of training without compression);
this module holds the order of things:

1. backward pass: each bucket's reduced shard -> host slot (:mod:`~megatron_diffckpt.snapshot`,
   hooked by :mod:`~megatron_diffckpt.patches.bucket_snapshot`; bubbles with PP > 1 by
   :mod:`~megatron_diffckpt.patches.pipeline_bubbles`);
2. optimizer step: flush the copies before megatron clips in place; record the clipping
   coefficient, learning rates and weight decays;
3. end of iteration: the slot and those scalars go to the :class:`ReplicaMerger` thread, which
   steps the host replica (and appends the exact step input to the diff log);
4. base due: once the replica holds the iteration, the training thread copies it into a persist
   buffer (a host memcpy; the merger goes on with the next iterations) and the training loop's
   save function plans a stock dist checkpoint of the copy (a collective; see
   :mod:`megatron_diffckpt.strategies.base` for its protocol); a persister thread writes it (with
   the replica in the node's keeper and ``--diffckpt-option keeper_writes_bases``: the keeper writes
   the files, staged in shared memory, :mod:`~megatron_diffckpt.keeper.writes`), and once
   every rank has written, the training thread finalizes it (metadata last) and publishes it.

Collective rule: :meth:`start`, :meth:`end_iteration`, :meth:`save_base` and :meth:`close` are
called by all ranks together (``end_iteration`` is a collective while a base is being written).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from megatron_diffckpt import failpoints, out_of_space, recovery
from megatron_diffckpt.background import CpuMeter, lower_priority
from megatron_diffckpt.capture import capture_rng, step_hyperparameters
from megatron_diffckpt.keeper.replica_client import KeeperReplicaMerger
from megatron_diffckpt.keeper.writes import HandedWrites, StagingArea
from megatron_diffckpt.patches import (
    base_checkpoint,
    bucket_snapshot,
    optimizer_step,
    pipeline_bubbles,
)
from megatron_diffckpt.patches.replica_state import ReplicaModelParams, replica_view
from megatron_diffckpt.replica_merger import (
    MergeJob,
    ReplicaMerger,
    StepInputs,
    host_group_like,
    refresh_replicas,
    replica_is_exact,
    take_group_options,
)
from megatron_diffckpt.snapshot import BucketSnapshotter, summarize_traces
from megatron_diffckpt.storage.writer import DiffLogWriter
from megatron_diffckpt.strategies.base import (
    BaseSource,
    IterationCost,
    PerIterationStrategy,
    SaveBase,
)

logger = logging.getLogger(__name__)


def _pipeline_size(model_chunks: list[Any]) -> int:
    return int(getattr(model_chunks[0].config, "pipeline_model_parallel_size", 1) or 1)


def _optimizer_bytes(optimizers: list[torch.optim.Optimizer | None]) -> int:
    """Bytes of the parameters and tensor state of host ``optimizers``."""
    total = 0
    for opt in optimizers:
        if opt is None:
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                total += p.nbytes
                total += sum(v.nbytes for v in opt.state.get(p, {}).values() if torch.is_tensor(v))
    return total


class LowDiffPlusStrategy(PerIterationStrategy):
    """``--diffckpt-mode lowdiff-plus`` on one rank. Built by the manager in ``start``.

    Args:
        optimizer: the megatron (distributed) optimizer.
        model_chunks: the megatron DDP modules.
        slots: snapshot slots = the merger's backlog bound (``--diffckpt-option max_pending``).
        writer: the diff log, or ``None`` to persist bases only.
        rng_tracker: megatron's RNG tracker (for the differentials' RNG states).
        trace_path: where :meth:`close` writes the recent iterations' snapshot trace (JSON).
        agree_on_base: ``(iteration, step, error) -> bool``, all ranks together, after a
            base's write (``error``: this rank's persister failed, or ``None``) and when its
            finalize step raised: every rank's outcome agreed, ``False`` when the base is
            skipped (a full disk); it stops the job for what it does not skip
            (:meth:`~megatron_diffckpt.manager.DiffCheckpointManager.agree_on_base`).
        keeper: the node's keeper client when the replica and its merger live there
            (:mod:`~megatron_diffckpt.keeper.replicas`; one more snapshot slot, in shared memory).
        keeper_log: with ``keeper``, the settings of the diff log the keeper writes from its
            merges (:class:`~megatron_diffckpt.keeper.hosted_replica.ReplicaLog`); ``None``: none.
        keeper_writes_bases: with ``keeper``, the keeper writes each base's files (the tensors
            megatron's planner hands its writer, staged in the keeper's shared-memory folder);
            else this rank does.
        max_merge_wait_s: how long an iteration may wait for a free snapshot slot; past it,
            nothing is merged nor logged until the next base, which re-anchors the replica to
            the training state (``--diffckpt-option max_merge_wait_ms``); ``None``: as long as
            it takes. In the keeper: the wait for the previous iteration's hand-over.
        replica: ``False`` to run without the replica from the start (the auto-tuner's
            decision, :meth:`drop_replica`; the merger in this process, with the diff log).
        kernel: what the replica steps with (``"auto"`` or ``"fused"``, see
            :func:`~megatron_diffckpt.replica_merger.replica_kernel`); a replica that is not
            bit-identical to the training state (``"fused"``, or training on GPUs) is
            re-anchored to it at every base.
    """

    name = "lowdiff-plus"

    def __init__(
        self,
        optimizer: Any,
        model_chunks: list[Any],
        slots: int,
        writer: DiffLogWriter | None,
        rng_tracker: Any,
        trace_path: str | None = None,
        agree_on_base: Callable[[int, str, BaseException | None], bool] | None = None,
        keeper: Any = None,
        keeper_log: dict[str, Any] | None = None,
        keeper_writes_bases: bool = False,
        max_merge_wait_s: float | None = None,
        replica: bool = True,
        kernel: str = "auto",
    ):
        if not model_chunks:
            raise ValueError(
                "LowDiff+ needs the model chunks (DDP modules): its snapshots hook them"
            )
        self.optimizer = optimizer
        self.trace_path = trace_path
        self.agree_on_base = agree_on_base
        self.model_chunks = model_chunks
        self.rng_tracker = rng_tracker
        self.writer = writer
        layout, shards, _ = bucket_snapshot.shard_layout(optimizer)
        inners = optimizer_step.inner_optimizers(optimizer)
        self._torch_optimizers = [
            None if getattr(o, "is_stub_optimizer", False) else o.optimizer for o in inners
        ]
        device = "cpu"
        for o in self._torch_optimizers:
            for group in o.param_groups if o is not None else []:
                for p in group["params"]:
                    device = p.device.type
        self.device = device
        self.pipelined = _pipeline_size(model_chunks) > 1
        self.cpu = CpuMeter()
        """CPU seconds by activity: the background work (snapshot copy, merge input and step,
        diff log record, base persist) and, to compare the merge step with, the training optimizer's
        step on the training thread."""
        self.in_keeper = keeper is not None
        buffer = None
        if self.in_keeper:
            keeper_merger = KeeperReplicaMerger(
                keeper, layout, cpu=self.cpu, log=keeper_log, kernel=kernel
            )
            buffer, slots = keeper_merger.slot_buffer, slots + 1  # the keeper holds one
        self.snapshotter = BucketSnapshotter(
            shards,
            slots=slots,
            device=device,
            defer_to_bubbles=self.pipelined,
            cpu=self.cpu,
            buffer=buffer,
        )
        self.snapshotter.max_wait_s = max_merge_wait_s
        # past the bound the merges are skipped while every iteration is still logged (the
        # log thread, or the keeper, reads every slot); without a log the snapshots pause
        self._keeper_logs = self.in_keeper and keeper_log is not None
        if (keeper is None and writer is not None) or self._keeper_logs:
            self.snapshotter.on_full = self._skip_merges
        self._unmerged_from: int | None = None  # the first iteration not merged (paused)
        # the in-rank merger with the log: a base waits at most the bound for the merger too
        self._bounds_base_wait = keeper is None and writer is not None
        self._anchored_at = -1  # the newest base staged from the training state in a pause
        if self.in_keeper:
            keeper_merger.attach(self.snapshotter)
            self.merger: ReplicaMerger | KeeperReplicaMerger = keeper_merger
        else:
            self.merger = ReplicaMerger(
                layout, self.snapshotter, writer, cpu=self.cpu, kernel=kernel
            )
        self.exact = replica_is_exact(self._torch_optimizers, kernel)
        """Whether the replica stays bit-identical to the training state; if not, every base
        re-anchors it first (the drift between bases is rounding)."""
        self._first_param = {}
        for i, o in enumerate(self._torch_optimizers):
            params = [p for g in o.param_groups for p in g["params"]] if o is not None else []
            if params:
                self._first_param[id(params[0])] = i
        dp_group = next(o for o in inners if not getattr(o, "is_stub_optimizer", False))
        made: dict[tuple[int, ...], Any] = {}  # per inner optimizer (experts: their DP group)
        host_groups = [
            host_group_like(
                getattr(o, "data_parallel_group", None) or dp_group.data_parallel_group, made
            )
            for o in inners
        ]
        self._handed: HandedWrites | None = None  # the keeper writing the base files
        if self.in_keeper and keeper_writes_bases:
            staging = StagingArea(keeper_merger.arena.folder)  # the keeper's folder
            self._handed = HandedWrites(
                keeper.sibling(timeout=None), staging, warm=base_checkpoint.write_files
            )
        self.model_params = ReplicaModelParams(optimizer, layout, host_groups)
        self._persist_copies: list[torch.optim.Optimizer | None] | None = None
        self._persister = ThreadPoolExecutor(1, thread_name_prefix="diffckpt-persister")
        self._inputs = StepInputs()
        self._submitted = 0
        self._persist: tuple[int, Future, Callable[[], None]] | None = None
        self.base_stall_seconds = 0.0
        self._bases = 0
        self._first_iteration = 0
        self._logging = writer is not None
        self._step_seconds = 0.0  # the training optimizer's last step (the tuner's replay)
        self.paused_bases = 0
        """How many of the newest bases in a row ended an interval in which the merges paused
        (``max_merge_wait_ms``; the bases staged from the training state): the auto-tuner drops
        the replica after two."""
        if not replica and not self.can_drop_replica:
            raise ValueError(
                "LowDiff+ runs without a replica only with its merger in this process and the "
                "diff log"
            )
        self._replica = replica
        self._dropped_at: int | None = None  # the iteration the replica was dropped after

    def start(self, iteration: int) -> None:
        """Anchor the replica to the training state after ``iteration`` and hook megatron."""
        if self._replica:
            self.merger.anchor(self._torch_optimizers, iteration)
        else:
            self.merger.drop_replica(self._torch_optimizers, iteration)
        self._submitted = self._first_iteration = iteration
        self._time_training_steps(True)
        bucket_snapshot.attach(self.model_chunks, self.optimizer, self.snapshotter)
        bucket_snapshot.add_clip_observer(self._on_clip)
        if self.pipelined:
            pipeline_bubbles.activate(self.snapshotter)
        optimizer_step.attach(self.optimizer, self._on_ready_grads)
        logger.info(
            "LowDiff+: %d snapshot slot(s) of %.1f MB in %s (%s copies%s), %s",
            self.snapshotter.slots,
            self.snapshotter.nbytes / 1e6,
            "shared memory" if self.in_keeper else "host memory",
            self.device,
            ", deferred to pipeline bubbles" if self.pipelined else "",
            f"replica anchored at iteration {iteration}"
            + (", merged by the node's keeper" if self.in_keeper else "")
            + ("" if self.exact else ", stepped with the fused host kernel, anchored at every base")
            if self._replica
            else "no replica (the auto-tuner's decision): bases staged from the training state, "
            "the diff log between them",
        )

    # ----------------------------------------------------------------- hooks (training thread)
    def _on_clip(self, params: list[torch.Tensor], coeff: float | None) -> None:
        self.snapshotter.flush()  # megatron is about to scale the gradients in place
        if coeff is None or not params:
            return
        inner = self._first_param.get(id(params[0]))
        if inner is None:  # the replica would silently miss this scaling
            raise RuntimeError(
                "LowDiff+: megatron clipped gradients of parameters that belong to no known "
                "inner optimizer; the replica cannot follow this optimizer layout"
            )
        self._inputs.clip_coeffs[inner] = coeff

    def _skip_merges(self, base: int | None = None) -> None:
        """No snapshot slot (in the keeper: no hand-over) came within ``max_merge_wait_ms``, or
        the in-rank merger had not merged the iteration of ``base`` within it, with the diff
        log on: the merger skips what it has not merged until the next base (``base`` itself),
        which is staged from the training state; the log goes on. The training thread."""
        if not self._replica:
            return  # nothing is merged: the slots wait for the diff log only
        first = self.merger.skip_merges()
        if self._unmerged_from is None:
            self._unmerged_from = self._submitted + 1 if first is None else first
            bound_ms = 1000.0 * (self.snapshotter.max_wait_s or 0.0)
            if base is not None:
                behind = (
                    f"the merger had not merged iteration {base} {bound_ms:.0f} ms into its base"
                )
            elif self.in_keeper:
                behind = (
                    f"the node's keeper took more than {bound_ms:.0f} ms to take an iteration over"
                )
            else:
                behind = (
                    f"the merger is behind by more than {self.snapshotter.slots} snapshot "
                    f"slot(s) for {bound_ms:.0f} ms"
                )
            logger.warning(
                "LowDiff+: %s: iterations from %d on are not merged until the next base, which "
                "is staged from the training state%s (--diffckpt-option max_merge_wait_ms)",
                behind,
                self._unmerged_from,
                "; the diff log goes on (durability unchanged)"
                if self._logging or self._keeper_logs
                else "",
            )

    def _on_ready_grads(self, inner_index: int, torch_optimizer: Any) -> None:
        self.snapshotter.flush()
        self._inputs.groups.update(step_hyperparameters(inner_index, torch_optimizer))

    # ----------------------------------------------------------------- training loop
    def end_iteration(self, iteration: int, scheduler_steps: int, consumed: int) -> IterationCost:
        """Hand ``iteration`` to the merger; finish a base whose writes are done everywhere.

        The cost is LowDiff+'s time on the training thread for this iteration (snapshot issue,
        slot waits, flushes, hand-off; a base's planning is reported by :meth:`save_base`).
        """
        start = time.perf_counter()
        slot = self.snapshotter.finish_iteration(iteration)
        inputs, self._inputs = self._inputs, StepInputs()
        # the keeper's replica keeps each iteration's RNG states: a restart resumes from it
        rng = capture_rng(self.rng_tracker) if self._logging or self.in_keeper else None
        failpoints.reach("plus-hand-over")
        dropped = self.snapshotter.paused
        if dropped and self._unmerged_from is None:
            self._unmerged_from = iteration
            logger.warning(
                "LowDiff+: the merger is behind by more than %d snapshot slot(s) for %.0f ms: "
                "iterations from %d on are neither merged nor logged until the next base, "
                "which is staged from the training state (durability stays at iteration %d "
                "until it is published; --diffckpt-option max_merge_wait_ms)",
                self.snapshotter.slots,
                1000.0 * (self.snapshotter.max_wait_s or 0.0),
                iteration,
                iteration - 1,
            )
        job = MergeJob(iteration, slot, inputs, scheduler_steps, consumed, rng, dropped=dropped)
        self.merger.submit(job)
        self._submitted = iteration
        self._poll_persist(block=False)
        path = self.snapshotter.iteration_path_seconds + time.perf_counter() - start
        return IterationCost(
            path,
            since_step_s=self._step_seconds,
            merge_wait_s=self.snapshotter.iteration_slot_wait_seconds,
        )

    def bound_merge_wait(self, seconds: float) -> None:
        """From the next iteration on, wait at most ``seconds`` for a snapshot slot, as
        ``max_merge_wait_s`` (the auto-tuner's decision). The training thread."""
        self.snapshotter.max_wait_s = seconds

    @property
    def can_drop_replica(self) -> bool:
        """Whether :meth:`drop_replica` applies: the merger in this process, with the diff log
        (the keeper's replica is not dropped)."""
        return not self.in_keeper and self._logging

    @property
    def has_replica(self) -> bool:
        return self._replica

    def drop_replica(self) -> int:
        """Keep no replica from now on (the auto-tuner's decision, where the merges paused in
        each of the newest base intervals: the replica then buys no base, and costs the bound's
        wait, an anchor copy per base and the merge's CPU): nothing queued or to come is merged,
        the replica's memory is freed, every base is staged from the training state, and the
        diff log goes on (durability unchanged). Returns the bytes freed. The training thread;
        one way."""
        if not self._replica:
            return 0
        if not self.can_drop_replica:
            raise RuntimeError("LowDiff+: only a replica in this process, with the diff log, "
                               "is dropped")  # fmt: skip
        freed = _optimizer_bytes(self.merger.optimizers)
        self._replica, self._dropped_at = False, self._submitted
        self._unmerged_from = None
        self.merger.drop_replica(self._torch_optimizers, self._submitted)
        return freed

    def stop_diff_log(self) -> None:
        """Write no more differentials (the iterations handed over so far still are): from now
        on only bases make iterations recoverable. The training thread; one way."""
        self._logging = False

    def save_base(self, iteration: int, save: SaveBase) -> float:
        """Write the replica at ``iteration`` as a base; returns the seconds training waited.

        Waits for the previous base to be published (one in flight), and for the merger to hold
        ``iteration``; a replica that is not bit-identical is first re-anchored from the
        training state. ``save`` plans the base in the background form (see
        :mod:`megatron_diffckpt.strategies.base`).
        """
        start = time.perf_counter()
        if self._persist is not None:
            logger.warning(
                "LowDiff+: base %d is still being written; base %d waits for it",
                self._persist[0],
                iteration,
            )
            self._poll_persist(block=True)
        bound = self.snapshotter.max_wait_s
        if self._replica and self._unmerged_from is None and bound and self._bounds_base_wait:
            self.merger.wait_merged(iteration, timeout=bound)
            if self.merger.merged_iteration < iteration:  # as a slot not freed within the bound
                self._skip_merges(base=iteration)
        self.paused_bases = self.paused_bases + 1 if self._unmerged_from is not None else 0
        if not self._replica:
            with self.cpu.measure("base training state copy"):
                copies = self._persist_copies = refresh_replicas(
                    self._torch_optimizers, self._persist_copies
                )
        elif self._unmerged_from is not None:
            copies = self._stage_from_training(iteration)
        else:
            self.merger.wait_merged(iteration)  # idle: nothing after it was submitted
            if not self.exact:
                self.merger.anchor(self._torch_optimizers, iteration)  # no drift across bases
            with self.cpu.measure("base replica copy"):
                copies = self._snapshot_replica()
        take_group_options(self._torch_optimizers, copies)  # what training would save
        with self.cpu.measure("base planning"):
            source = BaseSource(replica_view(self.optimizer, copies), self.model_params, True)
            write, finalize = base_checkpoint.split_async_request(save(source), self._handed)

        def write_replica():
            lower_priority()
            failpoints.delay("base-write")
            began = time.perf_counter()
            with self.cpu.measure("base gather"):
                self.model_params.fill(copies)
            with self.cpu.measure("base write"):
                writers = write()  # the file writers' threads: here, or in the keeper
            handed = self._handed is not None and self._handed.last_in_keeper
            self.cpu.add("base write in the keeper" if handed else "base write", writers)
            return time.perf_counter() - began

        future = self._persister.submit(write_replica)
        self._persist = (iteration, future, finalize)
        self._bases += 1
        blocked = time.perf_counter() - start
        self.base_stall_seconds += blocked
        return blocked

    def _time_training_steps(self, on: bool) -> None:
        """Measure the training optimizer's own step (the torch optimizer's ``step`` on this
        rank's shard, the work the merger repeats) into ``"training optimizer step"``, by an
        instance attribute that :meth:`close` removes."""
        for opt in self._torch_optimizers:
            if opt is None:
                continue
            if not on:
                opt.__dict__.pop("step", None)
                continue
            original = opt.step

            def step(*args, _original=original, **kwargs):
                began = time.perf_counter()
                with self.cpu.measure("training optimizer step"):
                    result = _original(*args, **kwargs)
                self._step_seconds = time.perf_counter() - began
                return result

            opt.step = step

    def cpu_report(self) -> dict[str, Any]:
        """What LowDiff+ took from the cores, in CPU seconds: per merged iteration by activity
        (snapshot copy, merge input and step, diff log record and write) with the training
        optimizer's own step to compare the merge step with; per base by step (on the training
        thread: replica copy, planning; on the persister's: gather, write); and training's wall
        time blocked per base."""
        totals = self.cpu.totals()
        if self.writer is not None:
            totals["diff log write"] = self.writer.stats.cpu_seconds
        iterations = max(1, self.merger.merged_iteration - self._first_iteration)
        bases = max(1, self._bases)
        per_base = {k[5:]: totals.pop(k) / bases for k in sorted(totals) if k.startswith("base ")}
        return {
            "iterations": iterations,
            "bases": self._bases,
            "per_iteration_s": {k: v / iterations for k, v in sorted(totals.items())},
            "per_base_s": per_base,
            "base_blocked_s": self.base_stall_seconds / bases,
            "host_bytes": {
                "replica": _optimizer_bytes(self.merger.optimizers),
                "persist_copy": _optimizer_bytes(self._persist_copies or []),
                "snapshot_slots": self.snapshotter.nbytes * self.snapshotter.slots,
                "model_params": self.model_params.nbytes,
            },
        }

    def _stage_from_training(self, iteration: int) -> list[torch.optim.Optimizer | None]:
        """A base during a pause (``max_merge_wait_ms``): the persist buffers take the training
        state (a host copy, as an async save's staging), without waiting for the merger, and
        the merger anchors its replica to them once it reaches this point of its queue; the
        snapshots resume."""
        # The merger may not have reached the previous such anchor yet: its source stays as it is
        # (fresh buffers here), it is overwritten by this one's anyway.
        anchoring = self.merger.merged_iteration < self._anchored_at
        with self.cpu.measure("base training state copy"):
            self._persist_copies = refresh_replicas(
                self._torch_optimizers, None if anchoring else self._persist_copies
            )
        self.merger.anchor_queued(self._persist_copies, iteration)
        self._anchored_at = iteration
        first, last = self._unmerged_from, iteration
        span = f"iteration {last} was" if first == last else f"iterations {first}-{last} were"
        logger.info(
            "LowDiff+: %s not merged; the base of iteration %d is staged from the training "
            "state, and the replica anchored to it merges again",
            span,
            iteration,
        )
        self._unmerged_from = None
        self.snapshotter.resume()
        return self._persist_copies

    def _snapshot_replica(self) -> list[torch.optim.Optimizer | None]:
        """Copy the (idle) replica into the persist buffers, created on first use."""
        self._persist_copies = refresh_replicas(self.merger.optimizers, self._persist_copies)
        return self._persist_copies

    def _poll_persist(self, block: bool) -> None:
        """Finalize the pending base when every rank has written it. All ranks."""
        if self._persist is None:
            return
        iteration, future, finalize = self._persist
        if block:
            future.exception()  # wait
        what = f"LowDiff+: base {iteration} written?"
        if not recovery.all_reduce_min([int(future.done())], what=what)[0]:
            return
        self._persist = None
        error = future.exception()  # the persister thread's, on this rank
        if self.agree_on_base is None:
            written_s = future.result()
        elif self.agree_on_base(iteration, "write", error):
            written_s = future.result()
        else:
            return  # skipped: storage is full (--diffckpt-when-full skip)
        try:
            finalize()  # megatron raises a failed write here, on every rank
        except out_of_space.SAVE_FAILURES as exc:
            if self.agree_on_base is None:
                raise
            self.agree_on_base(iteration, "finalize", exc)
            return
        handed = self._handed is not None and self._handed.last_in_keeper
        logger.info(
            "LowDiff+: base of iteration %d published (written by %s in %.3f s)",
            iteration,
            "the node's keeper" if handed else "the merger",
            written_s,
        )

    def finish_bases(self) -> None:
        self._poll_persist(block=True)

    def metrics(self) -> dict[str, float]:
        """``merge_backlog`` (iterations the replica is behind), ``merge_paused`` (1 while
        nothing is merged until the next base, ``max_merge_wait_ms``), ``replica`` (0 once
        dropped, :meth:`drop_replica`), ``slot_wait_ms`` (training's
        waits for a snapshot slot, cumulative), ``copies_in_bubbles`` (share of recent snapshot
        copy time inside pipeline bubbles)."""
        summary = summarize_traces(list(self.snapshotter.traces))
        if not self._replica:
            backlog = 0
        elif self._unmerged_from is not None:  # the replica stopped before this iteration
            backlog = self._submitted - self._unmerged_from + 1
        else:  # the keeper's replica is one behind by design (it holds the newest input)
            backlog = self._submitted - self.merger.merged_iteration - int(self.in_keeper)
        return {
            "merge_backlog": float(max(0, backlog)),
            "merge_paused": float(self._unmerged_from is not None),
            "replica": float(self._replica),
            "slot_wait_ms": self.snapshotter.slot_wait_seconds * 1000.0,
            "copies_in_bubbles": summary["share_in_bubbles"],
        }

    def durable_elsewhere(self) -> int | None:
        """With the keeper writing this rank's diff log: the newest iteration it made durable
        (as of the keeper's last reply)."""
        return self.merger.durable if self.in_keeper else None

    def replica_view(self) -> Any:
        """The training optimizer seen through the replica (read only); ``None`` without one."""
        if not self._replica:
            return None
        return replica_view(self.optimizer, self.merger.optimizers)

    def write_trace(self, path: str) -> None:
        """The stage's recent iterations (compute, wait and copy intervals) as JSON."""
        traces = list(self.snapshotter.traces)
        data = {
            "summary": summarize_traces(traces),
            "cpu": self.cpu_report(),
            "pipelined": self.pipelined,
            "iterations": [t.as_dict() for t in traces],
        }
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=1)

    def close(self) -> None:
        """Merge what is queued, finish the pending base, unhook. All ranks."""
        self.snapshotter.flush()
        self.merger.wait_idle()
        self._poll_persist(block=True)
        if self._handed is not None:
            self._handed.close()
        optimizer_step.detach(self.optimizer)
        self._time_training_steps(False)
        bucket_snapshot.remove_clip_observer(self._on_clip)
        bucket_snapshot.detach(self.model_chunks)
        pipeline_bubbles.deactivate()
        self.merger.close()
        self.snapshotter.close()
        self._persister.shutdown(wait=True)
        if self.trace_path is not None:
            try:
                self.write_trace(self.trace_path)
            except OSError as exc:  # a diagnostic: a full disk must not fail the job's end
                logger.warning(
                    "LowDiff+: snapshot trace not written to %s: %s", self.trace_path, exc
                )
        summary = summarize_traces(list(self.snapshotter.traces))
        if self._replica:
            merged = f"merged through iteration {self.merger.merged_iteration}"
        elif self._dropped_at is not None:
            merged = f"no replica after iteration {self._dropped_at} (the auto-tuner dropped it)"
        else:
            merged = "no replica (the auto-tuner's decision)"
        logger.info(
            "LowDiff+: %s; merger busy %.2f s; training waited %.2f s for snapshot slots and "
            "%.2f s at bases; %.0f%% of copy time inside pipeline bubbles",
            merged,
            self.merger.merge_seconds,
            self.snapshotter.slot_wait_seconds,
            self.base_stall_seconds,
            100.0 * summary["share_in_bubbles"],
        )
        report = self.cpu_report()
        logger.info(
            "LowDiff+: CPU per iteration (ms): %s; per base (ms, %d bases): %s, training "
            "blocked %.1f; host memory (MB): %s",
            ", ".join(f"{k} {v * 1000:.1f}" for k, v in report["per_iteration_s"].items()),
            report["bases"],
            ", ".join(f"{k} {v * 1000:.1f}" for k, v in report["per_base_s"].items()),
            report["base_blocked_s"] * 1000,
            ", ".join(f"{k} {v / 1e6:.1f}" for k, v in report["host_bytes"].items()),
        )
