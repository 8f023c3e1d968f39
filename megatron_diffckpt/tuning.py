r"""Cost model for the base interval F and the write batch B, and the optimum it implies.

What a job pays for checkpointing is (a) time on the training path, every iteration, and (b) work
lost at each failure. Both depend on F (iterations between bases) and B (iterations per diff-log
write), and on measured costs:

=====================  ==========================================================================
``iteration_s``        :math:`a`, one iteration without checkpointing
``diff_s``             :math:`c_0`, capturing and handing off one differential (training path)
``merge_wait_s``       :math:`h`, training waiting per iteration for the host's replica steps
                       (LowDiff+'s merge where the host needs longer than an iteration)
``diff_bytes``         :math:`s`, one differential of one rank
``write_bandwidth``    :math:`\beta`, bytes/s of the background writer
``write_latency_s``    :math:`L`, fixed cost of one write (open, fsync, rename, directory fsync)
``write_interference`` :math:`\kappa`, share of the writer's busy time that slows training (0 when
                       the host has idle cores, as on GPU nodes)
``base_stall_s``       :math:`c_b`, training blocked per base (async staging)
``base_persist_s``     :math:`p`, writing a base in the background after its staging
``base_load_s``        :math:`\ell`, loading a base at restart
``replay_s``           :math:`r`, replaying one differential
``restart_s``          :math:`R`, scheduler requeue, process start, initialisation
``mtbf_s``             mean time between failures of the whole job (:math:`\lambda = 1/` MTBF)
=====================  ==========================================================================

**Training path.** One write of B differentials takes :math:`w(B) = L + Bs/\beta`. Training
produces B differentials every :math:`B(a + c_0)` seconds; if the writer needs longer, training
waits (``--diffckpt-when-full block``) for the difference. So one iteration costs

.. math:: t(B) = a + c_0 + h + \kappa\,\frac{w(B)}{B}
                + \max\Big(0, \frac{w(B)}{B} - (a + c_0 + h)\Big)

and a base adds :math:`c_b(F)/F` per iteration, where
:math:`c_b(F) = c_b + \max(0, p - F\,t(B))`: one base is persisted at a time, so a base whose
predecessor is still being written waits for it.

**Failures.** A failure at a uniformly random point costs the restart, the base load, the replay
of the differentials since the newest base (on average about F/2 of them), and the iterations that
were not yet durable: the partly filled batch (on average (B-1)/2), the iteration in progress (1/2)
and the batch being written (:math:`w(B)/t(B)` iterations). With
:math:`K(B) = R + \ell + \big(\tfrac{B}{2} + \tfrac{w(B)}{t(B)}\big)t(B)`, the cost of one
failure is :math:`C(F, B) = K(B) + \tfrac{F}{2}\,r`.

**Tiers.** With the node keepers (:mod:`~megatron_diffckpt.keeper`), a share :math:`q`
(``kept_share``) of the failures leaves every iteration the ranks handed over in host memory
that outlived them: those cost the restart inside the allocation :math:`R_k`, the recovery, and
the iteration in flight, :math:`C_k(F) = R_k + x + t/2` from replicas in the keepers
(``kept_recovery_s``, no base, no replay: LowDiff+'s, or LowDiff's with
``--diffckpt-option keeper_replica``) or :math:`R_k + \ell_k + \tfrac{F}{2} r + t/2` from
their differentials, with the base from their memory (``kept_base_load_s``, :math:`\ell_k`) or
from storage (:math:`\ell_k = \ell`). With the keepers' ring
(:mod:`~megatron_diffckpt.keeper.peers`), a further share :math:`q_p` (``peer_share``) loses a
node whole, its ranks and its keeper, while the next node's keeper holds its copy:
:math:`C_p(F) = R_p + y + x + t/2` (or with :math:`\ell + \tfrac{F}{2} r` in place of
:math:`x` without replicas: LowDiff's kept bases do not travel around the ring), the restart
with a replacement node :math:`R_p` and the lost node's fetch of its copy from the peer
:math:`y`. Then
:math:`C = (1 - q - q_p)\,C + q\,C_k + q_p\,C_p`, again linear in F: the optimum below holds
with :math:`K = C(0, B)` and :math:`r` the slope's replay (``replay_slope_s``).

**Expected wall time per useful iteration.** Failures arrive at rate :math:`\lambda` per second of
wall time, each wasting :math:`C` seconds, so a share :math:`\lambda C` of the time makes no
progress (first order in :math:`\lambda C`, the renewal approximation; the simulator in the tests
checks it):

.. math:: W(F, B) = \frac{t(B) + c_b/F}{1 - \lambda\,C(F, B)}, \qquad \lambda C < 1.

**Optimum in F** (exact for the model where :math:`F t \ge p`). With :math:`t = t(B)`,
:math:`K = K(B)`, setting :math:`\partial W / \partial F = 0` gives
:math:`\tfrac{\lambda r t}{2} F^2 + \lambda r c_b F - c_b (1 - \lambda K) = 0`, so

.. math:: F^*(B) = \frac{-\lambda r c_b
                       + \sqrt{(\lambda r c_b)^2 + 2\lambda r t\,c_b(1 - \lambda K)}}
                      {\lambda r t},

which for small :math:`\lambda` is Young's formula with replay in place of recomputation,
:math:`F^* \approx \sqrt{2 c_b / (\lambda r t)}`. Full checkpointing without differentials is the
same model with recomputation instead of replay (:math:`r = t`, B = 1 and no write:
:math:`F^* \approx \sqrt{2 c_b / (\lambda t^2)}`, Young's interval in iterations): replay being far
cheaper than recomputation is why the base interval of LowDiff can be much longer. Below
:math:`F = p/t` the persist wait dominates, so the tuner also evaluates :math:`\lceil p/t \rceil`.

**Optimum in B.** No useful closed form once the max() bites; B is small and integral, so the
tuner evaluates every B from 1 up to the largest the host memory budget allows
(``(max_pending + 3) * B * s <= budget``, the writer's bound on records in memory and its
staging buffer), each with its :math:`F^*(B)` rounded both ways, and keeps the smallest W.
Without interference and with a writer that keeps up, B = 1 wins (every iteration durable); a
slow writer (large L) pushes B up until :math:`w(B)/B \le a + c_0`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class CostInputs:
    """Measured costs of one job (seconds, bytes); see the module docstring for the symbols."""

    iteration_s: float
    """a: one training iteration without checkpointing."""
    diff_s: float = 0.0
    """c0: capturing and handing off one differential, on the training path."""
    merge_wait_s: float = 0.0
    """h: training waiting, per iteration, for the host's replica steps (kept with bases
    only: the replica is stepped either way)."""
    diff_bytes: float = 0.0
    """s: bytes of one iteration's differential of one rank."""
    write_bandwidth: float = 1e9
    """beta: bytes per second of the background writer."""
    write_latency_s: float = 0.0
    """L: fixed cost of one write (open, fsync, rename, folder fsync)."""
    write_interference: float = 0.0
    """kappa: share of the writer's busy time that slows training."""
    base_stall_s: float = 0.0
    """c_b: training blocked per base."""
    base_persist_s: float = 0.0
    """p: writing one base in the background, after its staging."""
    base_load_s: float = 0.0
    """l: loading a base at restart."""
    replay_s: float = 0.0
    """r: replaying one differential."""
    restart_s: float = 0.0
    """R: requeue, process start and initialisation after a failure."""
    mtbf_s: float = math.inf
    """Mean time between failures of the whole job."""
    host_memory_budget: float = math.inf
    """Bytes of host memory the diff writer may hold."""
    max_pending: int = 2
    """Writes that may wait for the writer (--diffckpt-option max_pending)."""
    kept_share: float = 0.0
    """q: share of the failures after which the node keepers still hold every iteration the
    ranks handed over (only ranks died; their hosts are up)."""
    kept_restart_s: float = 0.0
    """R_k: restarting the ranks inside the allocation after such a failure (no requeue)."""
    kept_recovery_s: float | None = None
    """x: recovering from the keepers' replicas (a host-to-device copy); ``None``: the
    keepers hold differentials, and recovery loads the base and replays as from storage."""
    kept_base_load_s: float | None = None
    """l_k: LowDiff's newest base from the keepers' memory (a host-to-device copy) for the
    failures they serve; ``None``: from storage (``base_load_s``)."""
    peer_share: float = 0.0
    """q_p: share of the failures that lose a node whole (its ranks and its keeper) while the
    next node's keeper holds its copy (the keepers' ring); ``kept_share + peer_share <= 1``."""
    peer_restart_s: float = 0.0
    """R_p: restarting after such a failure, with a replacement node."""
    peer_fetch_s: float = 0.0
    """y: the lost node's ranks fetching their copy from the peer's keeper."""

    def __post_init__(self) -> None:
        if self.iteration_s <= 0:
            raise ValueError(f"iteration_s must be > 0, got {self.iteration_s}")
        for name in ("diff_s", "merge_wait_s", "diff_bytes", "write_latency_s",
                     "write_interference"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("base_stall_s", "base_persist_s", "base_load_s", "replay_s", "restart_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.write_bandwidth <= 0 or self.mtbf_s <= 0 or self.host_memory_budget <= 0:
            raise ValueError("write_bandwidth, mtbf_s and host_memory_budget must be > 0")
        if not 0.0 <= self.kept_share <= 1.0:
            raise ValueError(f"kept_share must be in [0, 1], got {self.kept_share}")
        if not 0.0 <= self.peer_share <= 1.0 - self.kept_share:
            raise ValueError(
                f"peer_share must be in [0, 1 - kept_share], got {self.peer_share} with "
                f"kept_share {self.kept_share}"
            )
        for name in (
            "kept_restart_s", "kept_recovery_s", "kept_base_load_s", "peer_restart_s",
            "peer_fetch_s",
        ):  # fmt: skip
            if (getattr(self, name) or 0.0) < 0:
                raise ValueError(f"{name} must be >= 0")

    @property
    def failure_rate(self) -> float:
        return 0.0 if math.isinf(self.mtbf_s) else 1.0 / self.mtbf_s


@dataclass(frozen=True)
class Plan:
    """A setting of (F, B) and what the model predicts for it."""

    full_interval: int
    batch_size: int
    wall_per_iteration_s: float
    """W(F, B): expected wall time per useful iteration, failures included."""
    overhead: float
    """W / a - 1: the expected cost of checkpointing and failures, as a share of training."""
    step_s: float
    """t(B) + c_b / F: time per iteration on the training path, without failures."""
    failure_cost_s: float
    """C(F, B): expected seconds lost per failure."""


def write_s(c: CostInputs, batch: int) -> float:
    """w(B): seconds one write of ``batch`` differentials takes."""
    return c.write_latency_s + batch * c.diff_bytes / c.write_bandwidth


def step_s(c: CostInputs, batch: int) -> float:
    """t(B): one iteration on the training path, differential and writer back-pressure included."""
    produce = c.iteration_s + c.diff_s + c.merge_wait_s
    per_diff = write_s(c, batch) / batch
    return produce + c.write_interference * per_diff + max(0.0, per_diff - produce)


def base_stall_s(c: CostInputs, full_interval: float, batch: int) -> float:
    """c_b(F): training blocked per base, waiting for the previous base's persist included."""
    return c.base_stall_s + max(0.0, c.base_persist_s - full_interval * step_s(c, batch))


def failure_cost_s(c: CostInputs, full_interval: float, batch: int) -> float:
    """C(F, B): expected seconds lost per failure (a share ``kept_share`` of them recovered
    from the node keepers, a share ``peer_share`` from the next node's keeper)."""
    t = step_s(c, batch)
    lost_iterations = batch / 2.0 + write_s(c, batch) / t
    storage = c.restart_s + c.base_load_s + lost_iterations * t + full_interval / 2.0 * c.replay_s
    if c.kept_share == 0.0 and c.peer_share == 0.0:
        return storage
    in_flight = t / 2.0
    kept = c.kept_restart_s + held_recovery_s(c, full_interval) + in_flight  # C_k: in place
    peer = (  # C_p: a replacement node fetches the copy
        c.peer_restart_s + c.peer_fetch_s + held_recovery_s(c, full_interval, local=False)
    ) + in_flight
    return (1.0 - c.kept_share - c.peer_share) * storage + c.kept_share * kept + c.peer_share * peer


def held_recovery_s(c: CostInputs, full_interval: float, local: bool = True) -> float:
    """x, or l_k + F/2 r: recovering what the keepers hold (their replicas, or base + replay of
    their differentials), after a failure they (``local``) or their peers survived (then the
    base comes from storage: l)."""
    if c.kept_recovery_s is not None:
        return c.kept_recovery_s
    base = c.kept_base_load_s if local and c.kept_base_load_s is not None else c.base_load_s
    return base + full_interval / 2.0 * c.replay_s


def replay_slope_s(c: CostInputs) -> float:
    """r_eff = 2 dC/dF: replay per differential, over the failures that replay (all, but those
    the keepers' replicas serve, locally or from the peer)."""
    replicas = c.kept_share + c.peer_share if c.kept_recovery_s is not None else 0.0
    return c.replay_s * (1.0 - replicas)


def wall_per_iteration(c: CostInputs, full_interval: float, batch: int) -> float:
    """W(F, B); ``inf`` where failures come faster than the job can recover from them."""
    useful = 1.0 - c.failure_rate * failure_cost_s(c, full_interval, batch)
    if useful <= 0:
        return math.inf
    return (step_s(c, batch) + base_stall_s(c, full_interval, batch) / full_interval) / useful


def optimal_full_interval(c: CostInputs, batch: int, max_interval: int = 1_000_000) -> float:
    """F*(B), the continuous minimiser of W over F (closed form), capped at ``max_interval``."""
    lam, r, cb = c.failure_rate, replay_slope_s(c), c.base_stall_s
    if cb == 0:
        return 1.0  # bases are free: take one every iteration
    if lam == 0 or r == 0:
        return float(max_interval)  # failures or replay are free: bases only cost
    t = step_s(c, batch)
    k = failure_cost_s(c, 0.0, batch)
    if lam * k >= 1:
        return 1.0
    disc = (lam * r * cb) ** 2 + 2 * lam * r * t * cb * (1 - lam * k)
    return min(float(max_interval), (-lam * r * cb + math.sqrt(disc)) / (lam * r * t))


def max_batch(c: CostInputs, limit: int = 1024) -> int:
    """The largest B whose records fit the host memory budget (at least 1)."""
    if c.diff_bytes == 0 or math.isinf(c.host_memory_budget):
        return limit
    held = (c.max_pending + 3) * c.diff_bytes  # per unit of B: see DiffLogWriter
    return max(1, min(limit, int(c.host_memory_budget // held)))


def plan(c: CostInputs, full_interval: int, batch: int) -> Plan:
    """What the model predicts for a given (F, B)."""
    w = wall_per_iteration(c, full_interval, batch)
    return Plan(
        full_interval,
        batch,
        w,
        w / c.iteration_s - 1.0,
        step_s(c, batch) + base_stall_s(c, full_interval, batch) / full_interval,
        failure_cost_s(c, full_interval, batch),
    )


def _interval_candidates(c: CostInputs, batch: int, max_interval: int) -> set[int]:
    """F*(B) rounded both ways, and the shortest interval at which persists keep up."""
    f = optimal_full_interval(c, batch, max_interval)
    keep_up = math.ceil(c.base_persist_s / step_s(c, batch))
    found = {math.floor(f), math.ceil(f), keep_up}
    return {min(max(1, n), max_interval) for n in found}


def optimize(c: CostInputs, max_interval: int = 1_000_000, batch_limit: int = 1024) -> Plan:
    """The (F, B) of smallest W: every admissible B, each with its candidate intervals."""
    best: Plan | None = None
    for batch in range(1, max_batch(c, batch_limit) + 1):
        for candidate in _interval_candidates(c, batch, max_interval):
            p = plan(c, candidate, batch)
            if best is None or p.wall_per_iteration_s < best.wall_per_iteration_s:
                best = p
    assert best is not None
    return best


def full_checkpointing(c: CostInputs, max_interval: int = 1_000_000) -> Plan:
    """Stock checkpointing at its own best interval: no differentials, lost work recomputed.

    ``c.base_stall_s`` is then the stall of one full checkpoint; each failure recomputes the
    iterations since it (replay cost = one iteration) and nothing is written in between.
    """
    full = replace(
        c, diff_s=0.0, diff_bytes=0.0, write_latency_s=0.0, replay_s=c.iteration_s, max_pending=0
    )
    options = [plan(full, n, 1) for n in _interval_candidates(full, 1, max_interval)]
    return min(options, key=lambda p: p.wall_per_iteration_s)
