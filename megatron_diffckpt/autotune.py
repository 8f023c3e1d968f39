"""Online tuning of the base interval F and the write batch B (``--diffckpt-auto-tune``).

:class:`OnlineTuner` collects what the cost model (:mod:`megatron_diffckpt.tuning`) needs while
training runs; every ``--diffckpt-option retune_interval`` iterations it re-derives (F, B) from the
medians of the recent measurements:

==========================  ======================================================================
iteration time ``a``        the training step, checkpointing excluded (the training loop reports)
diff cost ``c0``            capturing a differential and handing it to the writer
merge wait ``h``            LowDiff+: training waiting for its merger (the mean: it comes in bursts)
diff size ``s``             bytes the writer wrote per record
write bandwidth, latency    per segment: the time spent writing its bytes, and the rest (fsync,
                            rename, folder fsync) as the fixed cost ``L``
base stall ``c_b``          training blocked by a base save (the training loop reports)
paused intervals            LowDiff+: how many base intervals in a row its merges paused in
                            (``max_merge_wait_ms``), to drop a replica that buys nothing
base persist ``p``          from a base's save to its publication
base load ``l``, replay     measured at recovery when this run recovered; otherwise estimated as
``r``                       ``p`` (reading a base costs about what writing it did) and the
                            optimizer step's time (a replay is one optimizer step)
restart ``R``               process start to the first iteration, minus load and replay (in a
                            fresh run: process start to the first iteration)
failure rate                ``--diffckpt-mtbf-hours`` (of the whole job)
==========================  ======================================================================

No decision is made before a base has been measured (its cost is never assumed). Decisions
take effect only at safe points: a new B when the writer's current batch is empty
(segments may have any length, so no written data is affected), a new F from the newest base on
(the next base is due F iterations after it). Every decision is logged with the numbers behind it.

Collective rule: :meth:`OnlineTuner.propose` is local; the manager calls it on every rank at the
same iterations and agrees on the result with one all-reduce (MIN of F and of B), so all ranks
take bases together and no rank batches more than another.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from megatron_diffckpt.durable_io import publish_file
from megatron_diffckpt.scale_plan import (
    LOWDIFF_PLUS_BASES,
    LOWDIFF_PLUS_LOG,
    lowdiff_plus_choice,
    lowdiff_plus_plans,
)
from megatron_diffckpt.tuning import CostInputs, Plan, full_checkpointing, optimize

logger = logging.getLogger(__name__)


@dataclass
class TunerSettings:
    """What the user fixed; the rest is measured."""

    mtbf_s: float
    host_memory_budget: float
    max_pending: int
    window: int = 50
    max_interval: int = 100_000
    plus: bool = False
    """LowDiff+: also choose between the dense diff log and bases only
    (:func:`~megatron_diffckpt.scale_plan.lowdiff_plus_choice`): the log goes only when storage
    cannot take it every iteration and bases only is then cheaper. One way: once off, it stays
    off for the run."""
    bound_merge_wait: bool = False
    """LowDiff+ without ``max_merge_wait_ms`` from the user: the tuner may bound training's
    wait for the merger (:meth:`OnlineTuner.propose`), where
    waiting for it every iteration costs more than pausing it until the next base. One way:
    once bounded, bounded for the run."""
    drop_replica: bool = False
    """LowDiff+ with its replica in the rank and the diff log: the tuner may drop the replica
    where the merges paused in each of the newest :data:`PAUSED_BASES_TO_DROP` base intervals
    (:meth:`OnlineTuner.propose`). One way: once dropped, dropped for the run."""


PAUSED_BASES_TO_DROP = 2
"""LowDiff+ drops its replica once its merges paused (``max_merge_wait_ms``) in this many base
intervals in a row: every base of theirs was staged from the training state, so the replica made
none of them, and it cost the bound's wait once per interval, an anchor copy per base and the
merge's CPU. Two, not one: a single pause may be a passing slowdown (a base's persist, another
job on the host)."""


DECISION_FILE = "autotune.json"
"""In the diff log's folder: the newest decision every rank agreed on (rank 0 writes it), so that a
restarted job resumes with it instead of relearning it."""


@dataclass(frozen=True)
class Decision:
    """An (F, B, diff log on, bound on the merge wait) the ranks agreed on, and when."""

    full_interval: int
    batch_size: int
    diff_log: bool
    iteration: int
    merge_wait_ms: int = 0
    """LowDiff+'s bound on training's wait for its merger (0: none), as
    ``--diffckpt-option max_merge_wait_ms``."""
    replica: bool = True
    """LowDiff+ keeps its replica (``False``: dropped, bases staged from the training state)."""


def read_decision(diff_dir: str) -> Decision | None:
    """The decision a previous incarnation of the job saved in ``diff_dir``; ``None`` when there
    is none, or (with a warning: the tuner then learns again) when it cannot be read. Any
    process."""
    path = os.path.join(diff_dir, DECISION_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            state = json.load(f)
        return Decision(
            int(state["full_interval"]),
            int(state["batch_size"]),
            bool(state.get("diff_log", True)),
            int(state["iteration"]),
            int(state.get("merge_wait_ms", 0)),
            bool(state.get("replica", True)),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("auto-tune: %s is unreadable (%s): the tuner starts afresh", path, exc)
        return None


def describe_decision(decision: Decision) -> str:
    """``decision`` in the words of the log: ``F 6, B 1, merge wait bounded at 163 ms, LowDiff+
    without a replica (decided at iteration 16)``."""
    d = decision
    return (
        f"F {d.full_interval}, B {d.batch_size}"
        + ("" if d.diff_log else ", LowDiff+ bases only")
        + (f", merge wait bounded at {d.merge_wait_ms} ms" if d.merge_wait_ms else "")
        + ("" if d.replica else ", LowDiff+ without a replica")
        + f" (decided at iteration {d.iteration})"
    )


def load_decision(diff_dir: str) -> Decision | None:
    """:func:`read_decision`, logged. Any rank."""
    decision = read_decision(diff_dir)
    if decision is not None:
        logger.info("auto-tune: resuming with %s", describe_decision(decision))
    return decision


def save_decision(diff_dir: str, decision: Decision) -> None:
    """Publish ``decision`` for a restart (atomically). Rank 0."""
    data = json.dumps(
        {
            "full_interval": decision.full_interval,
            "batch_size": decision.batch_size,
            "diff_log": decision.diff_log,
            "iteration": decision.iteration,
            "merge_wait_ms": decision.merge_wait_ms,
            "replica": decision.replica,
        }
    ).encode()
    publish_file(os.path.join(diff_dir, DECISION_FILE), lambda f: f.write(data))


class OnlineTuner:
    """Measures the cost model's inputs and re-derives (F, B). Any rank; not collective."""

    def __init__(
        self,
        settings: TunerSettings,
        full_interval: int,
        batch_size: int,
        diff_log: bool = True,
        merge_wait_ms: int = 0,
        replica: bool = True,
    ):
        self.settings = settings
        self.full_interval = full_interval
        self.batch_size = batch_size
        n = settings.window
        self._iteration_s: deque[float] = deque(maxlen=n)
        self._diff_s: deque[float] = deque(maxlen=n)
        self._merge_wait_s: deque[float] = deque(maxlen=n)
        self._diff_bytes: deque[float] = deque(maxlen=n)
        self._write_bytes_s: deque[tuple[float, float]] = deque(maxlen=n)  # (bytes, seconds)
        self._write_latency_s: deque[float] = deque(maxlen=n)
        self._base_stall_s: deque[float] = deque(maxlen=8)
        self._base_persist_s: deque[float] = deque(maxlen=8)
        self._step_s: deque[float] = deque(maxlen=n)
        self.base_load_s: float | None = None
        self.replay_s: float | None = None
        self.restart_s: float = 0.0
        self.last_plan: Plan | None = None
        self.diff_log = diff_log
        """Whether differentials are written (LowDiff+ may turn the log off)."""
        self.merge_wait_ms = merge_wait_ms
        """LowDiff+'s bound on training's wait for its merger, 0 while unbounded."""
        self.replica = replica
        """Whether LowDiff+ keeps its replica (the tuner may drop it)."""
        self.paused_bases = 0
        """LowDiff+: the newest base intervals in a row in which the merges paused."""

    # -- measurements ------------------------------------------------------------------------

    def observe_iteration(
        self, iteration_s: float, diff_s: float, optimizer_step_s: float, merge_wait_s: float = 0.0
    ) -> None:
        """One iteration: ``diff_s`` on the training path for the differential, ``merge_wait_s``
        waiting for LowDiff+'s merger (kept with bases only: the replica merges either way)."""
        self._iteration_s.append(iteration_s)
        self._diff_s.append(diff_s)
        self._merge_wait_s.append(merge_wait_s)
        self._step_s.append(optimizer_step_s)

    def observe_write(self, records: int, nbytes: int, write_s: float, sync_s: float) -> None:
        """One published segment: ``write_s`` writing its bytes, ``sync_s`` fsync and rename."""
        self._diff_bytes.append(nbytes / max(records, 1))
        self._write_bytes_s.append((float(nbytes), write_s))
        self._write_latency_s.append(sync_s)

    def observe_base(self, stall_s: float, persist_s: float) -> None:
        self._base_stall_s.append(stall_s)
        self._base_persist_s.append(persist_s)

    def observe_paused_bases(self, intervals: int) -> None:
        """LowDiff+: the merges paused (``max_merge_wait_ms``) in each of the newest
        ``intervals`` base intervals, and not in the one before."""
        self.paused_bases = intervals

    def observe_recovery(
        self, base_load_s: float, replay_s_per_diff: float | None, restart_s: float
    ) -> None:
        """This run recovered: what loading, replaying and starting took."""
        self.base_load_s = base_load_s
        if replay_s_per_diff is not None:
            self.replay_s = replay_s_per_diff
        self.restart_s = restart_s

    def observe_start(self, startup_s: float) -> None:
        """This run started fresh: its start-up (process start to training) stands for the
        restart time until a recovery is measured."""
        self.restart_s = startup_s

    # -- decisions ---------------------------------------------------------------------------

    def inputs(self) -> CostInputs | None:
        """The cost model's inputs from the recent measurements; ``None`` until enough exist."""
        if len(self._iteration_s) < 3 or not self._write_bytes_s or not self._base_stall_s:
            return None  # a base's cost is never assumed: wait for one to be measured
        med = statistics.median
        bandwidth = self._write_bandwidth()
        persist = med(self._base_persist_s) if self._base_persist_s else 0.0
        return CostInputs(
            iteration_s=med(self._iteration_s),
            diff_s=med(self._diff_s),
            merge_wait_s=self.mean_merge_wait_s(),
            diff_bytes=med(self._diff_bytes),
            write_bandwidth=bandwidth,
            write_latency_s=med(self._write_latency_s),
            base_stall_s=med(self._base_stall_s) if self._base_stall_s else 0.0,
            base_persist_s=persist,
            base_load_s=self.base_load_s if self.base_load_s is not None else persist,
            replay_s=self.replay_s
            if self.replay_s is not None
            else self._replay_estimate(bandwidth),
            restart_s=self.restart_s,
            mtbf_s=self.settings.mtbf_s,
            host_memory_budget=self.settings.host_memory_budget,
            max_pending=self.settings.max_pending,
        )

    def mean_merge_wait_s(self) -> float:
        """LowDiff+: training's mean wait for its merger per iteration, recently."""
        return statistics.fmean(self._merge_wait_s) if self._merge_wait_s else 0.0

    def _write_bandwidth(self) -> float:
        """Bytes per second the writer wrote, over the recent segments."""
        nbytes = sum(b for b, _ in self._write_bytes_s)
        seconds = sum(s for _, s in self._write_bytes_s)
        return nbytes / seconds if seconds > 0 else 1e12

    def _replay_estimate(self, bandwidth: float) -> float:
        """One replayed differential before a recovery measured it: an optimizer step, and for
        LowDiff+ also reading the dense differential back (at the measured write bandwidth)."""
        step = statistics.median(self._step_s)
        if not self.settings.plus:
            return step
        return step + statistics.median(self._diff_bytes) / bandwidth

    def propose(self, iteration: int) -> tuple[int, int, int, int, int]:
        """The (F, B, diff log on, merge wait bound in ms, replica kept) the recent measurements
        call for (the current ones until enough exist). Logs the decision and the numbers
        behind it."""
        current = (
            self.full_interval,
            self.batch_size,
            int(self.diff_log),
            self.merge_wait_ms,
            int(self.replica),
        )
        inputs = self.inputs()
        if inputs is None:
            return current
        keep, choice, bound_ms, replica = True, "", self.merge_wait_ms, self.replica
        if self.settings.plus:
            plans = lowdiff_plus_plans(inputs, max_interval=self.settings.max_interval)
            keep = self.diff_log and lowdiff_plus_choice(inputs, plans) == LOWDIFF_PLUS_LOG
            plan = plans[LOWDIFF_PLUS_LOG if keep else LOWDIFF_PLUS_BASES]
            choice = (
                f"; LowDiff+ {'with the diff log' if keep else 'bases only'} (predicted overhead "
                f"with the log {100 * plans[LOWDIFF_PLUS_LOG].overhead:.2f}%, bases only "
                f"{100 * plans[LOWDIFF_PLUS_BASES].overhead:.2f}%)"
            )
            bounded = self._bounded_plan(inputs, plan, full_checkpointing if not keep else None)
            if bounded is not None:
                plan, bound_ms = bounded
                choice += (
                    f"; training's wait for the merger bounded at {bound_ms} ms (waiting costs "
                    f"{1000 * inputs.merge_wait_s:.1f} ms per iteration)"
                )
            if replica and keep and self._drops_replica():
                replica = False
                choice += (
                    f"; LowDiff+ drops its replica (the merges paused in each of the last "
                    f"{self.paused_bases} base intervals)"
                )
        else:
            plan = optimize(inputs, max_interval=self.settings.max_interval)
        self.last_plan = plan
        logger.info(
            "auto-tune at iteration %d: proposes F %d -> %d, B %d -> %d (predicted overhead "
            "%.2f%%, %.3f s per useful iteration%s) from: iteration %.3f s, diff %.4f s and "
            "%.0f bytes, merge wait %.4f s, write %.3g B/s + %.4f s, base stall %.3f s, "
            "persist %.2f s, load %.2f s, replay %.4f s, restart %.1f s, MTBF %.2f h",
            iteration,
            self.full_interval,
            plan.full_interval,
            self.batch_size,
            plan.batch_size,
            100 * plan.overhead,
            plan.wall_per_iteration_s,
            choice,
            inputs.iteration_s,
            inputs.diff_s,
            inputs.diff_bytes,
            inputs.merge_wait_s,
            inputs.write_bandwidth,
            inputs.write_latency_s,
            inputs.base_stall_s,
            inputs.base_persist_s,
            inputs.base_load_s,
            inputs.replay_s,
            inputs.restart_s,
            inputs.mtbf_s / 3600,
        )
        return plan.full_interval, plan.batch_size, int(keep), bound_ms, int(replica)

    def _drops_replica(self) -> bool:
        """Whether to drop LowDiff+'s replica: allowed (:attr:`TunerSettings.drop_replica`),
        and the merges paused in each of the newest :data:`PAUSED_BASES_TO_DROP` base
        intervals, so its bases were all staged from the training state."""
        return self.settings.drop_replica and self.paused_bases >= PAUSED_BASES_TO_DROP

    def _bounded_plan(
        self, inputs: CostInputs, plan: Plan, planner: Callable[..., Plan] | None
    ) -> tuple[Plan, int] | None:
        """LowDiff+ with a bound on training's wait for its merger, when it beats ``plan``
        (``planner``'s, default :func:`~megatron_diffckpt.tuning.optimize`, from ``inputs``).

        A merger slower than training fills the snapshot slots, and from then on each iteration
        waits about the merge's excess over the iteration. The bound is half the median of the
        waits measured: the first such wait ends the merge wait, the merger skips to the next
        base, and that base is staged from the training state (a host copy of the same bytes as
        a base from the replica, without waiting for the merger first: counted as the measured
        base stall), while the diff log goes on. So the bounded plan costs the bound and a base
        stall per base interval instead of the wait every iteration. ``None``: not offered
        (bounded already, by the user or by a decision), no wait measured, or not at least
        1% cheaper."""
        if self.merge_wait_ms or not self.settings.bound_merge_wait:
            return None
        waits = [w for w in self._merge_wait_s if w > 0.0]
        if not waits:
            return None
        bound_ms = max(1, round(500.0 * statistics.median(waits)))
        bounded_inputs = replace(
            inputs, merge_wait_s=0.0, base_stall_s=inputs.base_stall_s + bound_ms / 1000.0
        )
        bounded = (planner or optimize)(bounded_inputs, max_interval=self.settings.max_interval)
        if bounded.wall_per_iteration_s >= 0.99 * plan.wall_per_iteration_s:
            return None
        return bounded, bound_ms

    def apply(
        self,
        full_interval: int,
        batch_size: int,
        diff_log: bool = True,
        merge_wait_ms: int = 0,
        replica: bool = True,
    ) -> None:
        """Adopt the (F, B, diff log on, merge wait bound, replica kept) every rank agreed on.
        The log's stop, the bound and the replica's drop are one way."""
        self.full_interval, self.batch_size = full_interval, batch_size
        self.diff_log = self.diff_log and diff_log
        self.merge_wait_ms = self.merge_wait_ms or merge_wait_ms
        self.replica = self.replica and replica
