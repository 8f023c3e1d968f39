"""A discrete-event simulation of training under Poisson failures, to check the cost model.

It knows nothing of the model's formulas: it plays the job forward iteration by iteration. Each
iteration takes ``a + c0`` (plus the writer's interference); every B-th closes a batch, which the
background writer (one at a time, in order) makes durable ``w(B)`` later; when more than
``max_pending`` batches wait, training waits. Every F-th iteration takes a base (``c_b`` blocked,
published at once). Failures arrive as a Poisson process in wall time (also during recovery).
A failure loses everything not durable: new processes start (``R``), load the newest base
(``l``), replay the durable differentials after it (``r`` each), and go on from there; the diff
log starts a new chain at the recovered iteration, and writes in flight are lost.
"""

from __future__ import annotations

import random
from collections import deque

from megatron_diffckpt.tuning import CostInputs, write_s


def simulate(c: CostInputs, full_interval: int, batch: int, iterations: int, seed: int) -> float:
    """Wall seconds to complete ``iterations`` useful iterations."""
    rng = random.Random(seed)
    lam = c.failure_rate
    w = write_s(c, batch)
    per_iteration = c.iteration_s + c.diff_s + c.write_interference * w / batch

    def next_failure(after: float) -> float:
        return after + rng.expovariate(lam) if lam > 0 else float("inf")

    now, done = 0.0, 0
    chain_start = 0  # the log's chain restarts at the recovered iteration
    written = 0  # newest iteration made durable by a completed write
    last_base = 0
    writer_free = 0.0
    writes: deque[tuple[float, int]] = deque()  # (time durable, last iteration), in order
    failure = next_failure(0.0)
    while done < iterations:
        while writes and writes[0][0] <= now:
            written = writes.popleft()[1]
        end = now + per_iteration
        # Back-pressure: no more than max_pending writes may wait behind the one in progress.
        waiting = [t for t, _ in writes if t > end]
        if len(waiting) > c.max_pending + 1:
            end = waiting[len(waiting) - c.max_pending - 2]
        is_base = (done + 1) % full_interval == 0
        if is_base:
            end += c.base_stall_s
        if failure < end:
            now = failure
            while True:  # recover; a failure during recovery starts it over
                completed = [i for t, i in writes if t <= now]
                durable = max([written, last_base, chain_start, *completed])
                base = (durable // full_interval) * full_interval
                recovered = now + c.restart_s + c.base_load_s + (durable - base) * c.replay_s
                failure = next_failure(now)
                if failure >= recovered:
                    break
                now = failure
            now, done = recovered, durable
            chain_start = written = durable
            last_base = base
            writes.clear()
            writer_free = now
            continue
        now, done = end, done + 1
        if is_base:
            last_base = done
        if (done - chain_start) % batch == 0:
            writer_free = max(now, writer_free) + w
            writes.append((writer_free, done))
    return now


def mean_wall_per_iteration(
    c: CostInputs, full_interval: int, batch: int, iterations: int, seeds: range
) -> float:
    """Average wall seconds per useful iteration over ``seeds`` (common random numbers)."""
    total = sum(simulate(c, full_interval, batch, iterations, s) for s in seeds)
    return total / len(seeds) / iterations
