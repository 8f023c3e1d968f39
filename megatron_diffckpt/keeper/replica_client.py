"""The rank's side of LowDiff+'s replica in the node's keeper: hand-over and recovery.

:class:`KeeperReplicaMerger` stands in for the in-process
:class:`~megatron_diffckpt.replica_merger.ReplicaMerger` when the replica and its merger live in
the node's keeper (:mod:`~megatron_diffckpt.keeper.replicas`, where the whole protocol is
described); :func:`recover_from_keepers` recovers every rank from its keeper's replica, when
every rank can.

Which threads: :class:`KeeperReplicaMerger`'s methods are the training thread's, as
``ReplicaMerger``'s; its hand-over thread does the rest. :func:`recover_from_keepers`: all ranks,
collectively.
"""

from __future__ import annotations

import io
import logging
import time
from typing import Any

import torch

from megatron_diffckpt.background import CpuMeter
from megatron_diffckpt.capture import restore_rng
from megatron_diffckpt.errors import DiffCkptUsageError
from megatron_diffckpt.keeper.protocol import Op
from megatron_diffckpt.out_of_space import StorageFullError
from megatron_diffckpt.replica_merger import (
    AnchorJob,
    MergeJob,
    QueuedMerges,
    ShardLayout,
    replica_of,
)
from megatron_diffckpt.shared_replica import (
    SharedArena,
    build,
    damaged_file,
    describe,
    initial_adam_state,
    map_tensor,
    specs_of,
)
from megatron_diffckpt.snapshot import BucketSnapshotter, SnapshotSlot
from megatron_diffckpt.storage.format import DiffRecord, encode_record, iter_records

logger = logging.getLogger(__name__)

KEEPER_FLAG_HINT = "raise the launcher's --keeper-memory"


class KeeperReplicaMerger(QueuedMerges):
    """:class:`~megatron_diffckpt.replica_merger.ReplicaMerger`'s interface, with the replica
    and its merger in the node's keeper (``client``: this rank's
    :class:`~megatron_diffckpt.keeper.client.KeeperClient`).

    Build the :class:`BucketSnapshotter` with ``buffer=merger.slot_buffer`` (its slots in
    shared memory) and one slot more than in-process (the keeper holds one), then
    :meth:`attach` it.
    """

    failure = "LowDiff+: the hand-over to the keeper failed"

    def __init__(
        self,
        client: Any,
        layout: ShardLayout,
        cpu: CpuMeter | None = None,
        log: dict[str, Any] | None = None,
        kernel: str = "auto",
    ):
        self.client = client
        self.kernel = kernel  # what the replica steps with; its description carries the options
        self._link = client.sibling()
        """The replica's own connection to the keeper: a hand-over waits for the keeper's
        merge of the iteration before, and the training thread's other calls to the keeper
        (the log line's ``stats``) must not wait behind it."""
        self.layout = layout
        self.log = log
        """What the keeper's writer of this rank's diff log takes
        (:class:`~megatron_diffckpt.keeper.hosted_replica.ReplicaLog`'s ``spec``; ``None``: the
        keeper writes no diff log, only bases make iterations durable on storage)."""
        self.durable: int | None = None
        """The newest iteration the keeper's writer made durable, as of its last reply."""
        self.cpu = cpu if cpu is not None else CpuMeter()
        self.arena = SharedArena(client.shm_folder())
        self.optimizers: list[torch.optim.Optimizer | None] = []
        self.snapshotter: BucketSnapshotter | None = None
        self.resumed: tuple[int, list[Any]] | None = None
        """Set by :func:`recover_from_keepers`: the iteration and description of the keeper's
        replica the training state was copied from (the next :meth:`anchor` keeps it)."""
        self._slot_specs: list[dict[str, Any]] = []
        self._held: dict[int, SnapshotSlot] = {}
        self._cpu_seen: dict[str, float] = {}
        self._handing: int | None = None  # the iteration whose hand-over is under way
        self._anchors = self._anchored = 0  # anchors queued (training thread) and done
        super().__init__("diffckpt-keeper-hand-over", self._hand_over, self._drop)

    def slot_buffer(self, slot: int, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A snapshot slot's buffer in shared memory (``BucketSnapshotter(buffer=...)``)."""
        tensor = self.arena.empty((numel,), dtype)
        while len(self._slot_specs) <= slot:
            self._slot_specs.append({})
        self._slot_specs[slot][key] = self.arena.spec(tensor)
        return tensor

    def attach(self, snapshotter: BucketSnapshotter) -> None:
        """Take ``snapshotter``'s slots back as the keeper releases them; and make each
        iteration's first gradient reduction wait, before it is issued, until the previous
        iteration is handed over. No rank can then finish an iteration, nor hand it over,
        before every rank handed over the one before it: ranks killed at any moment are at
        most one iteration apart in their keepers, which each offer two (the replica and the
        input it holds), so all of them recover from the keepers. The hand-over has the next
        iteration's forward pass to finish in; a wait counts in the snapshotter's
        ``slot_wait_seconds``.

        With a bound on that wait (the snapshotter's ``max_wait_s``,
        ``--diffckpt-option max_merge_wait_ms``), a hand-over still running past it skips the
        keeper's merges until the next base re-anchors its replica (:meth:`anchor_queued`):
        where the keeper writes the diff log, the snapshotter's ``on_full`` is called (which
        calls :meth:`skip_merges`) and every iteration is still handed over, to be logged
        only; without the log, the snapshotter pauses: nothing is handed over. Ranks may then
        be further apart in their keepers than one iteration; a recovery finds no iteration
        every keeper reaches and goes to storage, as when a keeper is lost."""
        self.snapshotter = snapshotter
        snapshotter.before_iteration = self._before_iteration

    def _before_iteration(self) -> None:
        if self.snapshotter.max_wait_s is not None:
            # a base staged in a pause re-anchors the replica on the hand-over thread: that is
            # the base's staging, waited for in full; the bound is on hand-overs (counted from
            # its end, or every iteration after a base would find the bound spent and skip)
            with self._cond:
                self._cond.wait_for(lambda: self._anchored >= self._anchors or self._error)
        if self.wait_idle(self.snapshotter.max_wait_s):
            return
        if self.log is not None and self.snapshotter.on_full is not None:
            self.snapshotter.on_full()  # the merges skipped, the log goes on
        else:
            self.snapshotter.paused = True

    def skip_merges(self) -> int | None:
        """Have the keeper merge none of the iterations not yet handed over, those queued
        included, until the next anchor queued after this call: each is handed over to be
        written to the diff log only (``replica_log``: the keeper gives its slot back at once
        and drops the input it held), so training goes at the log's pace and every iteration
        is logged. Returns the first iteration not merged, the one whose hand-over is under
        way (the keeper merges the one before it first; ``None``: none is). The training
        thread, with the diff log in the keeper."""
        self._skips += 1
        return self._handing

    # ----------------------------------------------------------------- training thread
    def anchor(self, torch_optimizers: list[torch.optim.Optimizer | None], iteration: int) -> None:
        """Make the keeper's replica equal to ``torch_optimizers`` after ``iteration`` (a new
        copy in shared memory, or, after a recovery from the keeper, the replica it came from)."""
        self.wait_idle()
        self._open(torch_optimizers, iteration)

    def _open(self, torch_optimizers: list[torch.optim.Optimizer | None], iteration: int) -> None:
        """``replica_open``: the training thread with the hand-over thread idle, or the
        hand-over thread (:meth:`anchor_queued`)."""
        request: dict[str, Any] = {"op": Op.REPLICA_OPEN, "iteration": iteration}
        if self.resumed is not None and self.resumed[0] == iteration:
            description = self.resumed[1]
            optimizers, request["reuse"] = build(description), True
        else:
            optimizers = [
                None
                if o is None
                else replica_of(o, self.arena.copy, prefix=f"o{i}.", kernel=self.kernel)
                for i, o in enumerate(torch_optimizers)
            ]
            for opt in optimizers:
                if opt is not None:
                    initial_adam_state(opt, self.arena.copy)
            description = describe(optimizers, self.arena.spec)
        self.resumed = None
        request["optimizers"] = description
        request["layout"] = [
            [[[w.bucket, w.start, w.end] for w in group] for group in inner]
            for inner in self.layout
        ]
        request["slots"] = self._slot_specs
        if self.log is not None:
            request["log"] = self.log
        self._call(request)
        self.optimizers = optimizers
        self.arena.specs.clear()  # the keeper owns the files now
        for index in list(self._held):  # the new replica holds no input
            self.snapshotter.release(self._held.pop(index))
        self._set_merged(iteration)

    def anchor_queued(self, sources: list[torch.optim.Optimizer | None], iteration: int) -> None:
        """As :meth:`QueuedMerges.anchor_queued` (a base staged in a pause); the next
        iteration's first reduction waits for it in full."""
        self._anchors += 1
        super().anchor_queued(sources, iteration)

    def wait_merged(self, iteration: int) -> float:
        """Block until the keeper's replica holds ``iteration``; the seconds waited."""
        start = time.perf_counter()
        self.wait_idle()
        if self._merged < iteration:
            self._released(self._call({"op": Op.REPLICA_FLUSH, "through": iteration}))
        return time.perf_counter() - start

    def close(self) -> None:
        """Hand over what is queued, then drop the replica (the job ended: its final base is
        the training loop's)."""
        super().close()
        self._link.call({"op": Op.REPLICA_CLOSE})
        self._link.close()

    # ----------------------------------------------------------------- hand-over thread
    def _hand_over(self, job: MergeJob | AnchorJob) -> None:
        if isinstance(job, AnchorJob):  # a base during a pause: the replica starts again there
            if self._held:  # the input it holds merged first: the keeper gives its slot back
                self._released(self._call({"op": Op.REPLICA_FLUSH, "through": job.iteration}))
            self._open(job.sources, job.iteration)
            with self._cond:
                self._anchored += 1
                self._cond.notify_all()
            return
        if job.dropped:  # paused: not snapshotted, nothing to hand over
            return
        if job.slot is not None:
            job.slot.wait_ready()
            self._held[job.slot.index] = job.slot
        rng = job.rng if job.rng is not None else ({}, {})
        scalars = {"scheduler_steps": job.scheduler_steps, "consumed_samples": job.consumed_samples}
        record = encode_record(DiffRecord(job.iteration, {**scalars, **rng[0]}, dict(rng[1])))
        request = {
            "op": Op.REPLICA_LOG if self._skipped(job) else Op.REPLICA_MERGE,
            "iteration": job.iteration,
            "slot": None if job.slot is None else job.slot.index,
            "filled": sorted(job.slot.filled) if job.slot is not None else [],
            "groups": job.inputs.groups,
            "clip": {str(k): v for k, v in job.inputs.clip_coeffs.items()},
        }
        self._handing = job.iteration
        try:
            self._released(self._call(request, record))
        finally:
            self._handing = None
        self.client.held_iteration = job.iteration

    def _released(self, reply: dict[str, Any]) -> None:
        for index in reply["released"]:
            self.snapshotter.release(self._held.pop(index))
        self.merge_seconds += reply["merge_s"]
        for activity, total in reply["cpu"].items():  # the keeper's merge CPU, as in-process
            self.cpu.add(activity, total - self._cpu_seen.get(activity, 0.0))
        self._cpu_seen = dict(reply["cpu"])
        if reply.get("durable") is not None:
            self.durable = int(reply["durable"])
        self._set_merged(max(self._merged, int(reply["merged"])))

    def _call(self, request: dict[str, Any], payload: bytes = b"") -> dict[str, Any]:
        reply = self._link.call(request, payload)
        if reply is None:
            raise RuntimeError(
                f"LowDiff+: the node's keeper, which holds this rank's replica, is gone "
                f"({self._link.lost}); a restart recovers from storage's newest base"
            )
        if "error" in reply[0]:
            if reply[0].get("kind") == "StorageFullError":  # the diff log the keeper writes
                raise StorageFullError(f"the node's keeper, writing this rank's diff log: "
                                       f"{reply[0]['error']}")  # fmt: skip
            message = f"the node's keeper refused LowDiff+'s replica: {reply[0]['error']}"
            if "cap" in reply[0]["error"]:
                raise DiffCkptUsageError(f"{message}; {KEEPER_FLAG_HINT}")
            raise RuntimeError(message)
        return reply[0]

    def _drop(self, job: MergeJob | AnchorJob) -> None:
        if isinstance(job, MergeJob) and job.slot is not None and job.slot.index not in self._held:
            self.snapshotter.release(job.slot)


def load_replica(
    torch_optimizers: list[torch.optim.Optimizer | None],
    replicas: list[torch.optim.Optimizer | None],
) -> None:
    """Copy ``replicas`` (parameters and state) into the training ``torch_optimizers``, state
    created where a fresh optimizer has none, on its parameter's device."""
    for opt, replica in zip(torch_optimizers, replicas, strict=True):
        if opt is None or replica is None:
            continue
        for g_dst, g_src in zip(opt.param_groups, replica.param_groups, strict=True):
            on_device = bool(g_dst.get("capturable") or g_dst.get("fused"))
            for p_dst, p_src in zip(g_dst["params"], g_src["params"], strict=True):
                p_dst.detach().copy_(p_src)
                state = opt.state[p_dst]
                for k, v in replica.state.get(p_src, {}).items():
                    if not torch.is_tensor(v):
                        state[k] = v
                    elif torch.is_tensor(state.get(k)):
                        state[k].copy_(v)
                    else:
                        device = p_dst.device if (k != "step" or on_device) else "cpu"
                        state[k] = v.to(device, copy=True)


def _sealed(held: dict[str, Any], sums: list[int]) -> list[dict[str, Any]]:
    """The specs of the replica ``held`` describes, each with the checksum its keeper's last
    step left (:meth:`~megatron_diffckpt.keeper.hosted_replica.HostedReplica.sealed_specs`
    order)."""
    residuals = [held["residuals"]] if held.get("residuals") else []
    specs = list(specs_of(held["optimizers"], residuals))
    return [{**spec, "sum": s} for spec, s in zip(specs, sums, strict=True)]


def recover_from_keepers(
    client: Any,
    torch_optimizers: list[torch.optim.Optimizer | None],
    publish: Any,
    rng_tracker: Any,
    all_reduce_min: Any,
    floor: int = 0,
    ceiling: int | None = None,
    residuals: Any = None,
    fallback: str = "storage",
) -> tuple[int, DiffRecord, float, list[Any], str] | None:
    """Recover this rank from its keeper's replica, when every rank can. All ranks, together.

    ``client`` is this rank's keeper client (``None``: none runs); ``publish()`` makes the
    model's parameters follow the copied main parameters (collective); ``all_reduce_min`` is
    :func:`~megatron_diffckpt.recovery.all_reduce_min`. The iteration must be at least
    ``floor`` (storage's newest base). LowDiff's replicas (``--diffckpt-option
    keeper_replica``): at most ``ceiling`` (this rank's chain end, so that storage's log can be
    made to reach it), and the replica's error-feedback ``residuals`` are loaded too. Returns
    ``(iteration, its record, the seconds it took, the replica's description, the tier that
    held it)``, or ``None`` when some rank's keeper cannot reach the iteration every rank
    reaches (then every rank recovers from ``fallback``, as the log line says).
    """
    start = time.perf_counter()
    reply = client.call({"op": Op.REPLICA_STATE}) if client is not None else None
    held = reply[0].get("replica") if reply is not None else None
    low, high = (held["low"], held["high"]) if held else (-1, -1)
    if ceiling is not None:
        high = min(high, ceiling)
    # every rank reaches T = MIN(high) when every rank holds one and MAX(low) <= T: one MIN
    unpaused = int(held is None or held.get("logged_only") is None)
    target, minus_low, everyone, merging = all_reduce_min(
        [high, -low, int(held is not None), unpaused]
    )
    if not (everyone and target >= max(floor, 0) and -minus_low <= target):
        if target < 0 and everyone and not merging:
            logger.info(
                "recovery: the node keepers' replicas merge nothing until the next base (a "
                "hand-over took longer than max_merge_wait_ms; the diff log went on): "
                "recovering from %s",
                fallback,
            )
        elif target < 0:
            logger.info("recovery: the node keepers hold no replica: recovering from %s", fallback)
        else:
            logger.info(
                "recovery: not every rank's keeper reaches iteration %d (this rank's: %s; "
                "at least %d): recovering from %s",
                target,
                f"{low}-{high}" if held else "none",
                floor,
                fallback,
            )
        return None
    records = {r.iteration: r for r in iter_records(io.BytesIO(reply[1]))}
    settled = client.call({"op": Op.REPLICA_SETTLE, "iteration": target})
    if settled is None or "error" in settled[0]:
        raise RuntimeError(f"the node's keeper could not settle at {target}: {settled}")
    damaged = settled[0].get("damaged") or damaged_file(_sealed(held, settled[0]["sums"]))
    if not all_reduce_min([0 if damaged else 1], what="recovery: every replica intact?")[0]:
        if damaged:  # a replica damaged in memory is never loaded: the next tier serves
            logger.warning(
                "recovery: the replica of iteration %d in %s is damaged (%s does not have the "
                "checksum the keeper's last step left): not used; recovering from %s",
                target,
                held["tier"],
                damaged,
                fallback,
            )
        else:
            logger.info(
                "recovery: another rank's keeper replica is damaged: recovering from %s", fallback
            )
        return None
    replicas = build(held["optimizers"])
    load_replica(torch_optimizers, replicas)
    if residuals is not None and held.get("residuals"):
        residuals.load_state_dict({k: map_tensor(s) for k, s in held["residuals"].items()})
    publish()
    restore_rng([records[target]], rng_tracker)
    seconds = time.perf_counter() - start
    return target, records[target], seconds, held["optimizers"], held["tier"]
