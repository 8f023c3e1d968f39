"""LowDiff+ incremental merging: a host replica of this rank's optimizer shard, one step behind.

The :class:`ReplicaMerger` holds, in host memory, a copy of what this rank's torch optimizer(s)
hold: the main-parameter shard and the optimizer state (Adam moments, step). Every iteration it
receives the bucket snapshots of the reduced gradients (:mod:`megatron_diffckpt.snapshot`) and the
few scalars the training step used, rebuilds from them the exact input of the training
optimizer's step, and steps its own optimizer with it, on a background thread.

Exactness: the input is the reduced gradient shard, cast to fp32 as megatron casts it
(``.float()``), multiplied by the clipping coefficient when megatron clipped (the same
``grad * coeff`` product), with the learning rate and weight decay of every param group.
Where training runs on the CPU, the replica's optimizer is the training optimizer's class with
the same options (torch ``AdamW`` without transformer-engine or apex), stepped a cache-sized
block at a time (:mod:`~megatron_diffckpt.blocked_adam`: the same kernel and bits with less
memory traffic), so the replica is bit-identical to the training state. Where training runs
on GPUs no host kernel matches the device's bit for bit, so the replica steps with the
fastest one, torch's fused CPU Adam (:func:`replica_kernel`), and is re-anchored from the
device state (:meth:`ReplicaMerger.anchor`) at every persisted base; the drift between
anchors is bounded in the tests.

Optionally each step's optimizer input also goes to the diff log (a dense, exact
differential), so that recovery can replay past the newest persisted base. The log is written
ahead of the merge, on a thread of its own, as soon as an iteration's snapshots have landed: a
merger that falls behind (up to the snapshot slots) delays the replica, not durability.

Threads: the training thread calls :meth:`submit`, :meth:`wait_merged`,
:meth:`close`; the merger thread and the log thread do the rest. Each takes the jobs in
submission order; the merger steps an iteration once the log thread has read its snapshots.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_diffckpt import blocked_adam, failpoints
from megatron_diffckpt.background import BackgroundWorker, CpuMeter
from megatron_diffckpt.capture import GradShardCapture
from megatron_diffckpt.out_of_space import StorageFullError
from megatron_diffckpt.snapshot import BucketSnapshotter, SnapshotSlot
from megatron_diffckpt.storage.writer import DiffLogWriter

logger = logging.getLogger(__name__)

_TORCH_ADAM = (torch.optim.AdamW, torch.optim.Adam)


@dataclass(frozen=True)
class ParamSlice:
    """Where one main parameter's gradient sits in this rank's shard of a bucket."""

    bucket: str
    start: int
    end: int


# layout[inner][group][index]: the slice of the index-th parameter of a param group.
ShardLayout = list[list[list[ParamSlice]]]


@dataclass
class StepInputs:
    """What one training step used besides the gradients, captured on the training thread."""

    groups: dict[str, list[float]] = field(default_factory=dict)
    """``"o<inner>.g<group>"`` -> ``[lr, weight_decay]``."""
    clip_coeffs: dict[int, float] = field(default_factory=dict)
    """Inner optimizer -> the clipping coefficient megatron multiplied its gradients by."""

    @property
    def skipped(self) -> bool:
        """No optimizer step ran (inf/nan gradients)."""
        return not self.groups


@dataclass
class MergeJob:
    """One iteration for the merger."""

    iteration: int
    slot: SnapshotSlot | None
    inputs: StepInputs
    scheduler_steps: int
    consumed_samples: int
    rng: tuple[dict[str, Any], dict[str, torch.Tensor]] | None
    """RNG states at the end of the iteration; ``None`` when this iteration's differential is not
    logged (no diff log, or LowDiff+ stopped it)."""
    dropped: bool = False
    """Not snapshotted (the merger was too far behind, ``max_merge_wait_ms``): the replica is
    not stepped with it, nor with any iteration until it is anchored again, and the diff log
    skips it."""
    logged: threading.Event = field(default_factory=threading.Event)
    """Set when the diff log is done reading the slot (or never will): the merger may change it."""
    clipped_in_slot: bool = False
    """The log thread multiplied the slot's fp32 gradients by the clipping coefficients in place
    (as megatron does): the merger's input is ready there, not to be multiplied again."""
    holders: int = 1
    """Threads still to finish with the slot (the merger, and the log thread when one runs)."""
    merge_claimed: bool = False
    """The merger's hold on the slot was taken: by the merger (to merge or skip it), or let go
    of by another thread because the job is skipped (:meth:`ReplicaMerger.skip_merges`)."""
    anchor_skips: int = 0
    """:meth:`ReplicaMerger.skip_merges` calls made before the newest anchor queued ahead of
    this job: the job is skipped when there were more by the time it is merged."""


def _host_copy(t: torch.Tensor, _name: str = "") -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


# ``alloc(tensor, name) -> copy``: where a replica's tensors are created (default: process
# memory; the keeper's replica creates them in shared memory). ``name`` says which tensor it is:
# ``o<inner>.g<group>.p<index>`` for a parameter, with ``.<state key>`` for its state.
Alloc = Callable[[torch.Tensor, str], torch.Tensor]


KERNELS = ("auto", "exact", "fused")
"""How a host replica steps (:func:`replica_kernel`)."""

# The options a fused host replica's groups take whatever the training optimizer's were.
_FUSED = {"fused": True, "foreach": None, "capturable": False, "differentiable": False}


def replica_kernel(opt: torch.optim.Optimizer, kernel: str = "auto") -> str:
    """The kernel a host replica of ``opt`` steps with: ``"exact"``, the training optimizer's
    own class and options, bit-identical to it where training runs on the CPU (torch
    ``Adam``/``AdamW`` over CPU tensors); ``"fused"``, torch's fused CPU ``AdamW`` (or
    ``Adam``), about 5x the default CPU kernel per thread, where no host kernel can match the
    training step bit for bit anyway (parameters on a GPU, or transformer-engine's or apex's
    fused Adam): the replica then drifts from the device state by rounding, and is re-anchored
    to it at every base. ``kernel``: ``"auto"`` (that choice), or either name to force it
    (``"exact"`` of an optimizer that is not torch's is refused)."""
    if kernel not in KERNELS:
        raise ValueError(f"replica kernel must be one of {KERNELS}, got {kernel!r}")
    torch_adam = type(opt) in _TORCH_ADAM
    if kernel == "exact" and not torch_adam:
        raise ValueError(f"no exact host kernel for {type(opt).__name__}: use 'fused'")
    if kernel != "auto":
        return kernel
    on_cpu = all(p.device.type == "cpu" for g in opt.param_groups for p in g["params"])
    return "exact" if torch_adam and on_cpu else "fused"


def replica_is_exact(sources: list[torch.optim.Optimizer | None], kernel: str = "auto") -> bool:
    """Whether a replica of ``sources`` that steps with ``kernel`` stays bit-identical to them:
    the exact kernel, with training on the CPU. A replica that is not is re-anchored to the
    training state at every base."""
    return all(
        replica_kernel(o, kernel) == "exact"
        and all(p.device.type == "cpu" for g in o.param_groups for p in g["params"])
        for o in sources
        if o is not None
    )


def replica_of(
    opt: torch.optim.Optimizer, alloc: Alloc = _host_copy, prefix: str = "", kernel: str = "auto"
) -> torch.optim.Optimizer:
    """A host optimizer with ``opt``'s parameters, options and state, copied, stepping with
    :func:`replica_kernel` (``kernel``)."""
    groups = []
    for g, group in enumerate(opt.param_groups):
        options = {k: v for k, v in group.items() if k != "params"}
        params = [alloc(p, f"{prefix}g{g}.p{k}") for k, p in enumerate(group["params"])]
        groups.append({"params": params, **options})
    if replica_kernel(opt, kernel) == "exact":
        replica = type(opt)(groups)
    else:
        # Adam's update decoupled from weight decay, as megatron configures transformer-engine's
        # and apex's fused Adam (adam_w_mode); torch's own Adam keeps its class. Every other
        # option of a group stays (megatron's wd_mult, lr_mult, ...: a base written from the
        # replica saves its groups, and megatron's load looks them up), the kernel's are set.
        cls = type(opt) if type(opt) in _TORCH_ADAM else torch.optim.AdamW
        replica = cls([{**g, **_FUSED} for g in groups], fused=True)
    _copy_state(opt, replica, into_existing=False, alloc=alloc, prefix=prefix)
    return replica


def refresh_replicas(
    sources: list[torch.optim.Optimizer | None],
    replicas: list[torch.optim.Optimizer | None] | None,
    alloc: Alloc = _host_copy,
    kernel: str = "auto",
) -> list[torch.optim.Optimizer | None]:
    """``replicas`` made to hold ``sources``' parameters, options and state: copies created
    (by ``alloc``, stepping with ``kernel``) on first use (``replicas`` empty or ``None``),
    afterwards copied into in place (state a replica lacks is created by ``alloc``). ``None``
    entries (stub optimizers) stay ``None``."""
    if not replicas:
        return [
            None if o is None else replica_of(o, alloc, prefix=f"o{i}.", kernel=kernel)
            for i, o in enumerate(sources)
        ]
    for i, (src, dst) in enumerate(zip(sources, replicas, strict=True)):
        if src is not None:
            _copy_state(src, dst, into_existing=True, alloc=alloc, prefix=f"o{i}.")
    return replicas


def take_group_options(
    sources: list[torch.optim.Optimizer | None], copies: list[torch.optim.Optimizer | None]
) -> None:
    """Give ``copies``' param groups ``sources``' options (all but the parameters): a base
    written from the copies then saves the training optimizer's groups, its kernel's flags,
    megatron's ``wd_mult`` and the current learning rate included, whatever the copies step
    with (a fused replica's flags would switch training's kernel when the base is loaded)."""
    for src, dst in zip(sources, copies, strict=True):
        if src is None or dst is None:
            continue
        for g_src, g_dst in zip(src.param_groups, dst.param_groups, strict=True):
            g_dst.update({k: v for k, v in g_src.items() if k != "params"})


def _copy_state(
    src: torch.optim.Optimizer,
    dst: torch.optim.Optimizer,
    into_existing: bool,
    alloc: Alloc = _host_copy,
    prefix: str = "",
):
    for g, (g_src, g_dst) in enumerate(zip(src.param_groups, dst.param_groups, strict=True)):
        for k, (p_src, p_dst) in enumerate(zip(g_src["params"], g_dst["params"], strict=True)):
            if into_existing:
                p_dst.detach().copy_(p_src.detach())
            state = src.state.get(p_src)
            if not state:
                continue
            if "step" not in state and "step" in g_src:  # fused optimizers keep it per group
                state = {**state, "step": torch.tensor(float(g_src["step"]))}
            name = f"{prefix}g{g}.p{k}."
            current = dst.state.get(p_dst) if into_existing else None
            if current:
                for key, v in state.items():
                    if torch.is_tensor(v) and key in current:
                        current[key].copy_(v.detach())
                    else:
                        current[key] = alloc(v, name + key) if torch.is_tensor(v) else v
            else:
                dst.state[p_dst] = {
                    key: alloc(v, name + key) if torch.is_tensor(v) else v
                    for key, v in state.items()
                }


@dataclass
class AnchorJob:
    """A job for the merger: the replica becomes ``sources`` (the training state after
    ``iteration``)."""

    sources: list[torch.optim.Optimizer | None]
    iteration: int


class QueuedMerges:
    """What both mergers share (in-process :class:`ReplicaMerger`, and the keeper's
    :class:`~megatron_diffckpt.keeper.replica_client.KeeperReplicaMerger`): merge jobs queued to one
    background thread in submission order, and the newest merged iteration, to wait on.

    The training thread calls :meth:`submit`, :meth:`wait_idle`, :meth:`close`; the background
    thread runs ``handle`` and reports progress with :meth:`_set_merged`. Its first error is
    re-raised on the training thread with :attr:`failure`.
    """

    failure = "LowDiff+ merger failed"

    def __init__(self, thread_name: str, handle: Any, drop: Any):
        self._merged = -1
        self._cond = threading.Condition()
        self.merge_seconds = 0.0
        """Time spent merging, cumulative."""
        self._worker = BackgroundWorker(thread_name, handle, drop=drop, on_error=self._failed)
        self._workers = [self._worker]  # in the order they are waited for and stopped
        self._skips = 0  # skip_merges calls (the training thread)
        self._anchor_skips = 0  # of them, those before the newest anchor queued

    def submit(self, job: MergeJob) -> None:
        """Queue ``job``; its slot is released once it is merged. The training thread."""
        job.anchor_skips = self._anchor_skips
        self._raise_background_error()
        self._worker.put(job)

    def anchor_queued(self, sources: list[torch.optim.Optimizer | None], iteration: int) -> None:
        """Make the replica equal to ``sources`` (a copy of the training state after
        ``iteration``, left unchanged until this is merged) once the jobs queued before are
        handled, on the merger's thread: the training thread does not wait for them. The
        iterations submitted after it are merged again (an earlier ``skip_merges`` ends
        here). The training thread."""
        self._anchor_skips = self._skips
        self._raise_background_error()
        self._worker.put(AnchorJob(sources, iteration))

    def _skipped(self, job: MergeJob) -> bool:
        """``job`` is not merged: not snapshotted, or ``skip_merges`` was called since the
        anchor before it. Any thread."""
        return job.dropped or self._skips > job.anchor_skips

    @property
    def merged_iteration(self) -> int:
        return self._merged

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every queued job has been handled, at most ``timeout`` seconds
        (``None``: as long as it takes); whether they were."""
        deadline = None if timeout is None else time.monotonic() + timeout
        idle = True
        for worker in self._workers:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            idle = worker.join(left) and idle
        self._raise_background_error()
        return idle

    def close(self) -> None:
        """Handle what is queued, then stop the thread(s)."""
        for worker in self._workers:
            worker.stop()
        self._raise_background_error()

    def _set_merged(self, iteration: int) -> None:
        with self._cond:
            self._merged = iteration
            self._cond.notify_all()

    @property
    def _error(self) -> BaseException | None:
        return next((w.error for w in self._workers if w.error is not None), None)

    def _raise_background_error(self) -> None:
        error = self._error
        if isinstance(error, StorageFullError):  # the diff log: stops training in its own words
            raise error
        if error is not None:
            raise RuntimeError(self.failure) from error

    def _failed(self, exc: BaseException) -> None:
        logger.error(self.failure, exc_info=exc)
        with self._cond:  # wake the waiters, which raise it
            self._cond.notify_all()


class ReplicaMerger(QueuedMerges):
    """Keeps a host replica of this rank's optimizer shard and merges every step into it.

    Args:
        layout: where each main parameter's gradient sits in the bucket shards.
        snapshotter: gives the slots back after merging (:meth:`BucketSnapshotter.release`).
        writer: when given, every merged step is also appended to the diff log (dense, exact).
        cpu: where the merger thread's CPU time goes: ``"merge step"`` (the replica optimizer's
            own step, to compare with the training optimizer's), ``"merge input"`` (the
            gradients laid out for it, clipped as training clipped them), ``"diff log
            record"`` (the record handed to ``writer``).
        kernel: what the replica steps with (:func:`replica_kernel`).
    """

    def __init__(
        self,
        layout: ShardLayout,
        snapshotter: BucketSnapshotter,
        writer: DiffLogWriter | None = None,
        cpu: CpuMeter | None = None,
        kernel: str = "auto",
    ):
        self.layout = layout
        self.cpu = cpu if cpu is not None else CpuMeter()
        self.kernel = kernel
        self.snapshotter = snapshotter
        self.writer = writer
        # a writer that serialises at append takes the record before the slot is given back:
        # the record's gradients need not be copied out of it first
        self.capture = GradShardCapture(copy=writer is None or not writer.serialise_at_append)
        self.optimizers: list[torch.optim.Optimizer | None] = []
        self._shapes: list[torch.optim.Optimizer | None] | None = None  # replica dropped
        self._holders = threading.Lock()  # the jobs' holders and claims, and _queued
        self._queued: dict[int, MergeJob] = {}  # jobs whose merger's hold is not yet taken
        super().__init__("diffckpt-merger", self._merge_job, self._merge_dropped)
        # the diff log, ahead of the merge: durability does not wait for the replica
        self._log = (
            None
            if writer is None
            else BackgroundWorker(
                "diffckpt-log", self._log_job, drop=self._log_dropped, on_error=self._failed
            )
        )
        if self._log is not None:
            self._workers.insert(0, self._log)  # stopped first: the merger waits for it

    def submit(self, job: MergeJob) -> None:
        """Queue ``job`` for the log thread (when the diff log is on) and the merger; its slot
        is released once both are done with it. The training thread."""
        job.anchor_skips = self._anchor_skips  # before either thread sees it
        with self._holders:
            self._queued[id(job)] = job
        if self._log is None:
            job.logged.set()
        else:
            job.holders = 2
            self._raise_background_error()
            self._log.put(job)
        super().submit(job)

    # ----------------------------------------------------------------- training thread
    def anchor(self, torch_optimizers: list[torch.optim.Optimizer | None], iteration: int) -> None:
        """Make the replica equal to ``torch_optimizers`` (the training state after
        ``iteration``). Waits until earlier jobs are merged. The training thread."""
        self.wait_idle()
        self.optimizers = refresh_replicas(torch_optimizers, self.optimizers, kernel=self.kernel)
        self._set_merged(iteration)

    def drop_replica(
        self, training_optimizers: list[torch.optim.Optimizer | None], iteration: int
    ) -> None:
        """Merge nothing more for the rest of the run, the jobs queued included (as
        :meth:`skip_merges`, with no anchor ever queued again: one queued before this call is not
        applied either), and let the replica go: its memory is freed once a step in progress
        ends. The diff log goes on, reading the parameters' shapes from
        ``training_optimizers``. ``iteration``: the newest submitted (the merged iteration, for
        the waiters, when nothing is queued). The training thread."""
        self._shapes = training_optimizers
        self.optimizers = []
        self.skip_merges()
        if self._worker.join(0.0):  # idle: nothing will move the merged iteration on
            self._set_merged(iteration)

    @property
    def has_replica(self) -> bool:
        """Whether the replica is kept (:meth:`drop_replica` was not called)."""
        return self._shapes is None

    def wait_merged(self, iteration: int, timeout: float | None = None) -> float:
        """Block until ``iteration`` is merged, at most ``timeout`` seconds (``None``: as long
        as it takes); returns the seconds waited."""
        start = time.perf_counter()
        deadline = None if timeout is None else start + timeout
        with self._cond:
            while self._merged < iteration and self._error is None:
                left = 0.5 if deadline is None else min(0.5, deadline - time.perf_counter())
                if left <= 0:
                    break
                self._cond.wait(left)
        self._raise_background_error()
        return time.perf_counter() - start

    def skip_merges(self) -> int | None:
        """Step the replica with no more iterations, those queued included, until the next
        anchor queued after this call (:meth:`anchor_queued`): their slots go back as soon as
        the diff log has read them (those it has read already: now), so training goes at the
        log's pace and every iteration is still logged. Returns the first iteration skipped
        (``None``: none was queued; the next one submitted is). The training thread, when no
        slot came within the bound on its wait (``max_merge_wait_ms``)."""
        self._skips += 1
        with self._holders:
            queued = list(self._queued.values())
        for job in queued:
            if job.logged.is_set() and self._claim_merge(job):
                self._finish(job)
        return min((job.iteration for job in queued), default=None)

    def wait_logged(self) -> None:
        """Block until every job submitted so far is in the diff log's writer (appended: the
        writer makes it durable); at once without a diff log. The training thread."""
        if self._log is not None:
            self._log.join()
        self._raise_background_error()

    # ----------------------------------------------------------------- log thread
    @torch.no_grad()
    def _log_job(self, job: MergeJob) -> None:
        try:
            if not self._logs(job):
                return
            if job.dropped:
                self.writer.skip(job.iteration)
                return
            if job.slot is not None:
                job.slot.wait_ready()
            with self.cpu.measure("diff log record"):
                if not job.inputs.skipped:
                    if job.slot is None:
                        raise RuntimeError(f"iteration {job.iteration} stepped without snapshots")
                    # drop_replica sets _shapes before it empties optimizers: read in reverse
                    shapes, dropped = self.optimizers, self._shapes
                    shapes = shapes if dropped is None else dropped
                    for i, grads in step_inputs(
                        shapes, self.layout, job.slot.buffers, job.slot.filled,
                        job.inputs, job.iteration,
                    ):  # fmt: skip
                        self.capture.on_grads(i, job.inputs.groups, grads)
                    job.clipped_in_slot = True
                record = self.capture.build_record(
                    job.iteration, job.scheduler_steps, job.consumed_samples, job.rng
                )
                self.writer.append(record)
        finally:
            self._log_dropped(job)

    def _log_dropped(self, job: MergeJob) -> None:
        job.logged.set()
        self._finish(job)
        if self._skipped(job) and self._claim_merge(job):  # nothing for the merger to do
            self._finish(job)

    def _claim_merge(self, job: MergeJob) -> bool:
        """Take the merger's hold on ``job``; ``False`` when it was taken already. Any thread."""
        with self._holders:
            if job.merge_claimed:
                return False
            job.merge_claimed = True
            del self._queued[id(job)]
            return True

    def _finish(self, job: MergeJob) -> None:
        """A thread is done with ``job``'s slot: the last one gives it back. Any thread."""
        with self._holders:
            job.holders -= 1
            last = job.holders == 0
        if last and job.slot is not None:
            self.snapshotter.release(job.slot)

    def _merge_dropped(self, item: MergeJob | AnchorJob) -> None:
        if isinstance(item, MergeJob) and self._claim_merge(item):
            self._finish(item)

    # ----------------------------------------------------------------- merger thread
    def _merge_job(self, job: MergeJob | AnchorJob) -> None:
        start = time.perf_counter()
        if isinstance(job, AnchorJob):
            replicas = self.optimizers
            if replicas:  # in place; else dropped after this anchor was queued
                refresh_replicas(job.sources, replicas)
        else:
            self._merge(job)
        self.merge_seconds += time.perf_counter() - start
        self._set_merged(job.iteration)

    @torch.no_grad()
    def _merge(self, job: MergeJob) -> None:
        if not self._claim_merge(job):
            return  # skipped, and let go of by another thread
        try:
            if self._skipped(job):
                return  # the replica is anchored again at the next base
            failpoints.delay("merge")
            job.logged.wait()  # the log reads the slot first (and may clip it in place)
            if job.slot is not None:
                job.slot.wait_ready()
            if not job.inputs.skipped:
                if job.slot is None:
                    raise RuntimeError(f"iteration {job.iteration} stepped without snapshots")
                step_replica(
                    self.optimizers, self.layout, job.slot.buffers, job.slot.filled, job.inputs,
                    job.iteration, self.cpu, clipped=job.clipped_in_slot,
                )  # fmt: skip
        finally:
            self._finish(job)

    def _logs(self, job: MergeJob) -> bool:
        """Whether ``job`` goes to the diff log (a job without RNG states does not)."""
        return self.writer is not None and job.rng is not None


def step_inputs(
    optimizers: list[torch.optim.Optimizer | None],
    layout: ShardLayout,
    buffers: dict[str, torch.Tensor],
    filled: set[str],
    inputs: StepInputs,
    iteration: int,
    clipped: bool = False,
) -> Iterator[tuple[int, dict[tuple[int, int], torch.Tensor]]]:
    """Each inner optimizer's exact step input, rebuilt from one iteration's snapshots
    (``buffers``, of which the buckets ``filled`` were copied) and step inputs: ``(inner,
    {(group, index): gradient})``, the gradient shaped as the parameter of ``optimizers`` it is
    for, cast to fp32 as megatron casts it and multiplied by the clipping coefficient. Where
    the snapshot is fp32 the product is written in place, into it, as megatron writes it
    (``clipped``: that was done already, by an earlier reader). Any thread; the optimizers'
    parameters are only read for their shapes."""
    for i, opt in enumerate(optimizers):
        if opt is None:
            continue
        coeff = inputs.clip_coeffs.get(i)
        grads = {}
        for g, group in enumerate(opt.param_groups):
            for k, p in enumerate(group["params"]):
                where = layout[i][g][k]
                if where.bucket not in filled:
                    raise RuntimeError(
                        f"iteration {iteration}: bucket {where.bucket} was not "
                        "snapshotted (its reduction never started)"
                    )
                raw = buffers[where.bucket][where.start : where.end].view(p.shape)
                grad = raw.float()
                if coeff is not None and not (clipped and grad is raw):
                    # megatron: grads.copy_(grads * clip_coeff); the same products, in place
                    grad.mul_(coeff)
                grads[(g, k)] = grad
        yield i, grads


@torch.no_grad()
def step_replica(
    optimizers: list[torch.optim.Optimizer | None],
    layout: ShardLayout,
    buffers: dict[str, torch.Tensor],
    filled: set[str],
    inputs: StepInputs,
    iteration: int,
    cpu: CpuMeter,
    clipped: bool = False,
) -> None:
    """Step the replica ``optimizers`` with one iteration's snapshots (``buffers``, of which the
    buckets ``filled`` were copied) and step inputs: the exact input of the training step
    (:func:`step_inputs`; ``clipped``: the fp32 gradients were multiplied by the clipping
    coefficients in place already). CPU time goes to ``cpu`` as ``"merge input"`` and
    ``"merge step"``."""
    inputs_of = step_inputs(optimizers, layout, buffers, filled, inputs, iteration, clipped)
    while True:
        with cpu.measure("merge input"):
            got = next(inputs_of, None)
        if got is None:
            return
        i, grads = got
        opt = optimizers[i]
        for g, group in enumerate(opt.param_groups):
            group["lr"], group["weight_decay"] = inputs.groups[f"o{i}.g{g}"]
            for k, p in enumerate(group["params"]):
                p.grad = grads[(g, k)]
        with cpu.measure("merge step"):
            blocked_adam.step(opt)
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = None


def host_group_like(group: Any, made: dict[tuple[int, ...], Any] | None = None) -> Any:
    """A gloo group with the ranks of ``group``, for the host-side collectives of a background
    thread (its own communicator, so it never interleaves with the training thread's).
    ``made``: the groups earlier calls made, by ranks, reused (the same on every rank).
    All ranks of the world, collectively."""
    made = {} if made is None else made
    world = torch.distributed.get_world_size()
    mine = tuple(torch.distributed.get_process_group_ranks(group))
    everyone: list[Any] = [None] * world
    torch.distributed.all_gather_object(everyone, mine)
    for ranks in sorted(set(everyone)):
        if ranks not in made:
            made[ranks] = torch.distributed.new_group(list(ranks), backend="gloo")
    return made[mine]
