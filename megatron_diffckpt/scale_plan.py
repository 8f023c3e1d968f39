"""At-scale planning: the cost model's inputs for a GPT job of a given size, and its choices.

``megatron-diffckpt tune`` fills :class:`~megatron_diffckpt.tuning.CostInputs` from a job
description (model size, GPUs, layout, iteration time, storage) and compares three strategies,
each at its own best setting:

- **LowDiff**: top-k compressed gradients (ratio rho) written per iteration by each rank. A rank's
  differential is its shard's entries of the aggregated sparse gradient: at most
  ``min(1, DP * rho)`` of the shard's ``P / N`` parameters, 8 bytes each (fp32 value, int32 index).
  Bases are async stock checkpoints (the stall is the staging copy of the shard).
- **LowDiff+**: no compression; reduced gradient buckets are copied to host memory during the
  backward pass (overlapped: no stall) and merged into a host replica, which is persisted as the
  base with no device stall. Two ways, each at its own best setting: **with the diff log**, dense
  differentials (4 bytes per shard parameter, every iteration) are written between bases; **bases
  only** (``--diffckpt-option diff_log=false``), nothing between bases, and after a failure the
  iterations since the newest base are recomputed, with bases as frequent as storage writes
  them. The log's bytes grow with the shard (7B parameters at DP=8: 3.5 GB per rank and
  iteration), so where storage cannot take them every iteration, bases only wins.
  :func:`lowdiff_plus_choice` says which. **The host counts**: a node's host steps every
  rank's replica with every iteration's gradients, :data:`MERGE_BYTES` of memory traffic per
  parameter of the node's shards (7B parameters on one node of 8 GPUs: 224 GB per iteration)
  at ``host_merge_bandwidth``; the snapshot slots let the merge lag by an iteration or two,
  but where the host needs longer than an iteration, training runs at the host's pace
  (:func:`merge_wait_s`, on the training path of both ways, of LowDiff+ in keepers and of
  LowDiff's keeper replicas). **With a bound on that wait** (``LowDiff+ (bounded wait)``,
  ``--diffckpt-option max_merge_wait_ms``): where the host cannot keep up, training waits the
  bound once per base interval and the merger skips to the next base, staged from the
  training state (a stall), while the dense log goes on. **Without a replica** (``LowDiff,
  dense``): no merge;
  bases are staged from the device (a stall, as LowDiff's), the dense log between them: what
  ``--diffckpt-mode lowdiff`` runs with megatron's dense reduction (``--diffckpt-compressor
  none``, its default).
- **full checkpointing**: stock async saves only; after a failure the iterations since the newest
  checkpoint are recomputed.
- **with the node keepers** (:mod:`~megatron_diffckpt.keeper`): a share ``kept_share`` of the
  failures leaves the hosts up; the ranks restart in the allocation (``kept_restart_s``) and
  recover every iteration they handed over. ``LowDiff + keepers``: the differentials and the
  newest base from the keeper (none lost; replay as from storage). ``LowDiff + keeper
  replicas`` (``--diffckpt-option keeper_replica``): the keeper's replica of the shard, stepped with
  every differential (a host-to-device copy, no replay; around the ring too); its one
  optimizer step per iteration runs on the host, off the training path, counted as
  LowDiff+'s merge where the host needs longer than an iteration.
  ``LowDiff+ in keepers`` (``--diffckpt-option keeper_replica``): the replica from the keeper
  (a host-to-device copy of the shard's fp32 parameters and moments, no base, no replay) and
  bases only to storage (no dense log), which serve the other failures. With the keepers' ring
  (``--keeper-peers``), a further share ``peer_share`` loses a node whole: the job
  restarts with a replacement node (``restart_s``, a requeue, as without the ring), whose
  ranks fetch the node's copy from the next node's keeper (its ``gpus_per_node`` replicas over
  ``peer_bandwidth``; LowDiff's differentials are read from the peer in place of storage,
  counted in the replay) before the same recovery: what the ring saves is the base read, the
  replay and the lost write batch, not the requeue. ``--peer-share 0`` models keepers without
  the ring.

Storage is shared: each rank gets ``storage_bandwidth / N`` for writes and reads, so a base
takes ``P * bytes_per_param / storage_bandwidth`` to persist, whatever N. A full
checkpoint holds ``bytes_per_param`` per parameter (bf16 weights plus fp32 main weights and two
Adam moments: 14). Replaying a differential reads it and runs one optimizer step on the shard
(memory-bound: ``32`` bytes of traffic per shard parameter at ``device_memory_bandwidth``).

Failure rate. The default comes from the Llama 3 405B pre-training report ("The Llama 3 Herd of
Models", Meta, 2024, section 3.3.4): 419 unexpected interruptions in a 54-day period on 16,384
H100 GPUs, i.e. one interruption per ``54 * 24 * 16384 / 419`` = 50,676 GPU-hours. A job of N GPUs
fails every ``50,676 / N`` hours on average (failures of independent components add up).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_diffckpt.tuning import CostInputs, Plan, full_checkpointing, optimize, step_s

# Llama 3 405B: 419 unexpected interruptions in 54 days on 16,384 GPUs.
GPU_HOURS_PER_FAILURE = 54 * 24 * 16384 / 419


@dataclass(frozen=True)
class JobSpec:
    """A GPT pretraining job, as far as checkpointing costs go."""

    params: float = 70e9
    """Model parameters."""
    gpus: int = 1024
    """GPUs (ranks) of the job."""
    tensor_parallel: int = 8
    """TP size."""
    pipeline_parallel: int = 4
    """PP size."""
    iteration_s: float = 10.0
    """Time of one training iteration."""
    storage_bandwidth: float = 500e9
    """Aggregate write/read bandwidth of the checkpoint storage, bytes/s, shared by all ranks."""
    staging_bandwidth: float = 25e9
    """Device-to-host copy bandwidth per GPU (async-save staging), bytes/s."""
    device_memory_bandwidth: float = 2e12
    """Device memory bandwidth, bytes/s (replay is a memory-bound optimizer step)."""
    topk_ratio: float = 0.01
    """LowDiff's top-k ratio."""
    bytes_per_param: float = 14.0
    """Bytes per parameter of a full checkpoint."""
    restart_s: float = 600.0
    """Requeue, start and initialisation after a failure."""
    gpu_hours_per_failure: float = GPU_HOURS_PER_FAILURE
    """GPU-hours between unexpected interruptions (Llama 3 405B report by default)."""
    write_latency_s: float = 0.05
    """Fixed cost of one diff write (fsync, rename) on the shared file system."""
    diff_s: float = 0.0
    """Training-path cost of capturing one differential (copy of the sparse shard)."""
    host_memory_budget: float = 16e9
    """Host memory one rank's diff writer may use, bytes."""
    kept_share: float = 0.5
    """Share of failures that leave the hosts up (only ranks die), so that the node keepers'
    memory serves the restart: an assumption to set from a cluster's own failure records."""
    kept_restart_s: float = 120.0
    """torchrun restarting the ranks inside the allocation after such a failure."""
    peer_share: float = 0.3
    """Share of failures that lose one node whole (a GPU, NIC or host fault that takes it out)
    while the rest of the job is up, so that the next node's keeper serves its copy: an
    assumption, as kept_share; kept_share + peer_share <= 1, the rest goes to storage."""
    gpus_per_node: int = 8
    """GPUs (ranks) per node: one keeper's share of the job."""
    peer_bandwidth: float = 12.5e9
    """Bytes/s between two nodes' keepers (the host network, 100 Gb/s)."""
    host_merge_bandwidth: float = 100e9
    """Host memory bandwidth one node's replica steps get, bytes/s: a share of what the host
    streams (a dual-socket server, about 300 GB/s; benchmarks/host_merge.py measures a
    host's)."""
    max_merge_wait_s: float = 1.0
    """LowDiff+'s bound on training's wait for its merger, seconds (--diffckpt-option
    max_merge_wait_ms): the bounded-wait plan's."""

    def __post_init__(self) -> None:
        if self.gpus % (self.tensor_parallel * self.pipeline_parallel):
            raise ValueError(
                f"{self.gpus} GPUs are not a multiple of TP x PP = "
                f"{self.tensor_parallel * self.pipeline_parallel}"
            )
        for name in ("params", "iteration_s", "storage_bandwidth", "gpu_hours_per_failure"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if not 0.0 <= self.kept_share <= 1.0 or self.kept_restart_s < 0:
            raise ValueError(
                f"kept_share must be in [0, 1] and kept_restart_s >= 0, got {self.kept_share} "
                f"and {self.kept_restart_s}"
            )
        if not 0.0 <= self.peer_share <= 1.0 - self.kept_share:
            raise ValueError(
                f"peer_share must be in [0, 1 - kept_share], got {self.peer_share} with "
                f"kept_share {self.kept_share}"
            )
        if self.gpus_per_node < 1 or self.peer_bandwidth <= 0:
            raise ValueError("gpus_per_node must be >= 1 and peer_bandwidth > 0")
        if self.host_merge_bandwidth <= 0:
            raise ValueError("host_merge_bandwidth must be > 0")
        if self.max_merge_wait_s < 0:
            raise ValueError("max_merge_wait_s must be >= 0")

    @property
    def data_parallel(self) -> int:
        return self.gpus // (self.tensor_parallel * self.pipeline_parallel)

    @property
    def shard_params(self) -> float:
        """Parameters of one rank's distributed-optimizer shard."""
        return self.params / self.gpus

    @property
    def mtbf_s(self) -> float:
        return self.gpu_hours_per_failure / self.gpus * 3600.0


def _per_rank_bandwidth(job: JobSpec) -> float:
    return job.storage_bandwidth / job.gpus


def lowdiff_inputs(job: JobSpec) -> CostInputs:
    kept = min(1.0, job.data_parallel * job.topk_ratio)
    return _inputs(job, diff_bytes=job.shard_params * kept * 8.0, base_stall=True)


MERGE_BYTES = 32.0
"""Host memory traffic per shard parameter and iteration of a replica's step: the gradient
written to host memory (LowDiff+'s snapshot, LowDiff's differential expanded; 4 bytes), and
Adam's step (parameter, gradient and both moments read, 16; three written, 12), all fp32."""


def host_merge_s(job: JobSpec) -> float:
    """Seconds a node's host needs, per iteration, to step every rank's replica
    (:data:`MERGE_BYTES` per parameter of the node's shards at ``host_merge_bandwidth``):
    memory-bound, whatever the thread count once it saturates."""
    return job.gpus_per_node * job.shard_params * MERGE_BYTES / job.host_merge_bandwidth


def snapshot_s(job: JobSpec) -> float:
    """Seconds one GPU's device-to-host copy of its reduced gradient shard takes per
    iteration (4 bytes per shard parameter at ``staging_bandwidth``), overlapped with the
    backward pass."""
    return job.shard_params * 4.0 / job.staging_bandwidth


def merge_wait_s(job: JobSpec, replica: bool = True) -> float:
    """What LowDiff+ adds to each iteration on the training path: the snapshot copy or, with a
    replica, the host's merge, beyond the iteration they overlap (the snapshot slots bound how
    far the host may lag; in the steady state training runs at the slower of the two)."""
    host = max(snapshot_s(job), host_merge_s(job)) if replica else snapshot_s(job)
    return max(0.0, host - job.iteration_s)


def lowdiff_plus_inputs(job: JobSpec) -> CostInputs:
    """LowDiff+ with a host replica: bases from it (no device stall), the merge counted."""
    c = _inputs(job, diff_bytes=job.shard_params * 4.0, base_stall=False)
    return replace(c, merge_wait_s=merge_wait_s(job))


def lowdiff_plus_device_inputs(job: JobSpec) -> CostInputs:
    """LowDiff+ without a replica, i.e. LowDiff with dense differentials: no host merge; bases
    staged from the device state (a stall, as LowDiff's and full checkpointing's), the dense
    log between them."""
    c = _inputs(job, diff_bytes=job.shard_params * 4.0, base_stall=True)
    return replace(c, merge_wait_s=merge_wait_s(job, replica=False))


def lowdiff_plus_bounded_inputs(job: JobSpec) -> CostInputs:
    """LowDiff+ with a bound on training's wait for its merger (``max_merge_wait_s``): where
    the host steps the node's replicas within an iteration, LowDiff+ with the diff log; where
    it does not, the snapshot slots fill, training waits the bound once, and the merger skips
    to the next base, which is staged from the training state (a stall, as LowDiff's), while
    the dense log goes on: LowDiff+ without a replica, plus the bound once per base."""
    if host_merge_s(job) <= job.iteration_s:
        return lowdiff_plus_inputs(job)
    c = lowdiff_plus_device_inputs(job)
    return replace(c, base_stall_s=c.base_stall_s + job.max_merge_wait_s)


def _inputs(job: JobSpec, diff_bytes: float, base_stall: bool) -> CostInputs:
    bw = _per_rank_bandwidth(job)
    shard_bytes = job.shard_params * job.bytes_per_param
    replay = diff_bytes / bw + job.shard_params * 32.0 / job.device_memory_bandwidth
    return CostInputs(
        iteration_s=job.iteration_s,
        diff_s=job.diff_s,
        diff_bytes=diff_bytes,
        write_bandwidth=bw,
        write_latency_s=job.write_latency_s,
        base_stall_s=shard_bytes / job.staging_bandwidth if base_stall else 0.0,
        base_persist_s=shard_bytes / bw,
        base_load_s=shard_bytes / bw,
        replay_s=replay,
        restart_s=job.restart_s,
        mtbf_s=job.mtbf_s,
        host_memory_budget=job.host_memory_budget,
    )


def full_inputs(job: JobSpec) -> CostInputs:
    return _inputs(job, diff_bytes=0.0, base_stall=True)


def with_keepers(
    job: JobSpec, c: CostInputs, replica: bool, lowdiff_replica: bool = False
) -> CostInputs:
    """``c`` with the node keepers and their ring: a share of the failures recovered from host
    memory, from LowDiff+'s replicas (``replica``: main parameters and two Adam moments, fp32,
    copied to the device), from LowDiff's (``lowdiff_replica``: the same copy) or from LowDiff's
    newest base and differentials (the base copied to the device, then replay; staging each
    base in the keeper copies it once more, off the training path: the next iteration's passes
    run meanwhile); a share that loses a node whole, from the next node's keeper (a
    replacement node fetches the node's replicas first; without replicas, LowDiff's base then
    comes from storage, and its differentials from the peer are replayed)."""
    replica_bytes = job.shard_params * 12.0
    to_device_s = replica_bytes / job.staging_bandwidth  # a replica, or LowDiff's kept base
    # what a replacement node fetches: LowDiff+'s replicas, or LowDiff's with their
    # error-feedback residuals (4 bytes per shard parameter more)
    fetched = replica_bytes if replica else job.shard_params * 16.0 if lowdiff_replica else 0.0
    return replace(
        c,
        kept_base_load_s=None if replica else to_device_s,
        kept_share=job.kept_share,
        kept_restart_s=job.kept_restart_s,
        kept_recovery_s=to_device_s if replica or lowdiff_replica else None,
        peer_share=job.peer_share,
        peer_restart_s=job.restart_s,  # a node lost whole: a requeue, with or without the ring
        peer_fetch_s=job.gpus_per_node * fetched / job.peer_bandwidth,
    )


LOWDIFF_PLUS_LOG = "LowDiff+ (diff log)"
LOWDIFF_PLUS_BASES = "LowDiff+ (bases only)"
LOWDIFF_KEEPERS = "LowDiff + keepers"
LOWDIFF_KEEPER_REPLICAS = "LowDiff + keeper replicas"
LOWDIFF_PLUS_KEEPERS = "LowDiff+ in keepers"
LOWDIFF_PLUS_DEVICE = "LowDiff, dense"
"""LowDiff+ without its replica: ``--diffckpt-mode lowdiff`` with megatron's dense reduction, or
``--diffckpt-mode lowdiff-plus --diffckpt-auto-tune`` once the tuner drops the replica
(:data:`~megatron_diffckpt.autotune.PAUSED_BASES_TO_DROP`)."""
LOWDIFF_PLUS_BOUNDED = "LowDiff+ (bounded wait)"
"""LowDiff+ with the diff log and ``--diffckpt-option max_merge_wait_ms``."""


def lowdiff_plus_plans(c: CostInputs, max_interval: int = 1_000_000) -> dict[str, Plan]:
    """LowDiff+ with the diff log and with bases only, each at its own best setting, from the
    same measured (or modelled) costs ``c``: its ``diff_bytes`` are the log's bytes per rank and
    iteration, its bases cost ``base_stall_s`` and ``base_persist_s`` either way."""
    return {
        LOWDIFF_PLUS_LOG: optimize(c, max_interval=max_interval),
        LOWDIFF_PLUS_BASES: full_checkpointing(c, max_interval=max_interval),
    }


def lowdiff_plus_choice(c: CostInputs, plans: dict[str, Plan]) -> str:
    """Which of :func:`lowdiff_plus_plans` (from ``c``) to run: the diff log (every iteration
    durable, what LowDiff+ is for) unless storage cannot take it, i.e. training would wait for
    the writer at the log's best B, and bases only is then the cheaper plan."""
    log, bases = plans[LOWDIFF_PLUS_LOG], plans[LOWDIFF_PLUS_BASES]
    # the writer's back-pressure, beyond the merger's wait (which both plans pay)
    behind = step_s(c, log.batch_size) > (c.iteration_s + c.diff_s + c.merge_wait_s) * (1 + 1e-9)
    if behind and bases.wall_per_iteration_s < log.wall_per_iteration_s:
        return LOWDIFF_PLUS_BASES
    return LOWDIFF_PLUS_LOG


def compare(job: JobSpec) -> dict[str, Plan]:
    """Each strategy at its own best (F, B): storage only, and with the node keepers
    (LowDiff's differentials and newest base in them, or also its replica; LowDiff+'s replica
    in them, with bases only to storage); the host's replica steps counted, and LowDiff+
    without a replica."""
    plus = lowdiff_plus_inputs(job)
    lowdiff = lowdiff_inputs(job)
    # LowDiff's replica in the keeper: one Adam step of the whole shard per iteration, the
    # host's as LowDiff+'s merge
    stepped = replace(lowdiff, merge_wait_s=max(0.0, host_merge_s(job) - job.iteration_s))
    return {
        "LowDiff": optimize(lowdiff),
        LOWDIFF_KEEPERS: optimize(with_keepers(job, lowdiff, replica=False)),
        LOWDIFF_KEEPER_REPLICAS: optimize(
            with_keepers(job, stepped, replica=False, lowdiff_replica=True)
        ),
        **lowdiff_plus_plans(plus),
        LOWDIFF_PLUS_BOUNDED: optimize(lowdiff_plus_bounded_inputs(job)),
        LOWDIFF_PLUS_DEVICE: optimize(lowdiff_plus_device_inputs(job)),
        LOWDIFF_PLUS_KEEPERS: full_checkpointing(with_keepers(job, plus, replica=True)),
        "full checkpointing": full_checkpointing(full_inputs(job)),
    }


def expected_loss_hours(plan: Plan, train_hours: float) -> float:
    """Wall-clock hours a ``train_hours`` job (of failure-free training) loses to checkpointing
    and failures under ``plan``."""
    return train_hours * plan.overhead
