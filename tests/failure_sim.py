"""A discrete-event simulation of training under Poisson failures, to check the cost model.

It knows nothing of the model's formulas: it plays the job forward iteration by iteration. Each
iteration takes ``a + c0`` (plus the writer's interference); every B-th closes a batch, which the
background writer (one at a time, in order) makes durable ``w(B)`` later; when more than
``max_pending`` batches wait, training waits. Every F-th iteration takes a base: it waits for the
previous base's persist, blocks ``c_b``, and is published ``p`` later. Failures arrive as a
Poisson process in wall time (also during recovery). A failure loses everything not durable: new
processes start (``R``), load the newest published base (``l``), replay the durable differentials
after it (``r`` each), and go on from there; the diff log starts a new chain at the recovered
iteration, and writes in flight are lost. A share ``kept_share`` of the failures (drawn at each)
leaves the node keepers holding every iteration done: the ranks restart in the allocation
(``R_k``) and recover it from the keepers' replicas (``x``), or from the base and the keepers'
differentials (``l`` + ``r`` each); a share ``peer_share`` loses a node whole, and its
replacement (``R_p``) fetches the node's copy from the next node's keeper (``y``) before the
same recovery.
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
    bases: deque[tuple[float, int]] = deque()  # (time published, iteration)
    last_base, persist_done = 0, 0.0
    writer_free = 0.0
    writes: deque[tuple[float, int]] = deque()  # (time durable, last iteration), in order
    failure = next_failure(0.0)
    while done < iterations:
        while writes and writes[0][0] <= now:
            written = writes.popleft()[1]
        while bases and bases[0][0] <= now:
            last_base = bases.popleft()[1]
        end = now + per_iteration
        # Back-pressure: no more than max_pending writes may wait behind the one in progress.
        waiting = [t for t, _ in writes if t > end]
        if len(waiting) > c.max_pending + 1:
            end = waiting[len(waiting) - c.max_pending - 2]
        is_base = (done + 1) % full_interval == 0
        if is_base:  # staging waits for the previous base's persist, then blocks c_b
            end = max(end, persist_done) + c.base_stall_s
        if failure < end:
            now = failure
            while True:  # recover; a failure during recovery starts it over
                completed = [i for t, i in writes if t <= now]
                base = max([last_base] + [i for t, i in bases if t <= now])
                tier = rng.random()
                if tier < c.kept_share + c.peer_share:  # keepers hold all that was handed over
                    durable = done
                    recovery = c.kept_recovery_s
                    if recovery is None:  # their differentials: the base, then replay
                        load = c.base_load_s  # storage's (a node lost whole: no kept base)
                        if tier < c.kept_share and c.kept_base_load_s is not None:
                            load = c.kept_base_load_s  # the keepers' own copy
                        recovery = load + (durable - base) * c.replay_s
                    if tier < c.kept_share:  # the hosts are up: a restart in the allocation
                        recovered = now + c.kept_restart_s + recovery
                    else:  # a node lost whole: a replacement fetches its copy from the peer
                        recovered = now + c.peer_restart_s + c.peer_fetch_s + recovery
                else:
                    durable = max([written, base, chain_start, *completed])
                    recovered = now + c.restart_s + c.base_load_s + (durable - base) * c.replay_s
                failure = next_failure(now)
                if failure >= recovered:
                    break
                now = failure
            now, done = recovered, durable
            chain_start = written = durable
            last_base = base
            writes.clear()
            bases.clear()
            writer_free = persist_done = now
            continue
        now, done = end, done + 1
        if is_base:
            persist_done = now + c.base_persist_s
            bases.append((persist_done, done))
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
