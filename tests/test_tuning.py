"""The cost model and the (F, B) it chooses, checked against a failure simulation.

The simulator (tests/failure_sim.py) plays training forward under Poisson failures without using
the model's formulas; the model must predict its wall time per useful iteration within a few
percent, and the tuner's (F, B) must, in the simulation, come within a few percent of the best
setting of a brute-force grid, across failure rates and cost profiles.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
from failure_sim import mean_wall_per_iteration

from megatron_diffckpt.scale_plan import (
    LOWDIFF_KEEPER_REPLICAS,
    LOWDIFF_PLUS_BASES,
    LOWDIFF_PLUS_BOUNDED,
    LOWDIFF_PLUS_DEVICE,
    LOWDIFF_PLUS_KEEPERS,
    LOWDIFF_PLUS_LOG,
    JobSpec,
    compare,
    host_merge_s,
    lowdiff_plus_bounded_inputs,
    lowdiff_plus_choice,
    lowdiff_plus_device_inputs,
    lowdiff_plus_inputs,
    lowdiff_plus_plans,
    merge_wait_s,
)
from megatron_diffckpt.tuning import (
    CostInputs,
    failure_cost_s,
    full_checkpointing,
    max_batch,
    optimal_full_interval,
    optimize,
    plan,
    step_s,
    wall_per_iteration,
    write_s,
)

SEEDS = range(10)
ITERATIONS = 8000

# Cost profiles (seconds, bytes). "fast writer": every iteration durable is cheap. "slow writer":
# one write costs more than an iteration, so B must grow. "interference": the writer shares the
# training cores, so batching saves training time.
BASE = dict(
    iteration_s=1.0,
    diff_s=0.02,
    diff_bytes=1e6,
    write_bandwidth=1e8,
    write_latency_s=0.05,
    base_stall_s=5.0,
    base_load_s=10.0,
    replay_s=0.05,
    restart_s=60.0,
)
SCENARIOS = {
    "fast-writer-mtbf-2h": CostInputs(**BASE, mtbf_s=7200),
    "fast-writer-mtbf-30min": CostInputs(**BASE, mtbf_s=1800),
    "fast-writer-mtbf-10min": CostInputs(**BASE, mtbf_s=600),
    "slow-writer-mtbf-30min": CostInputs(**{**BASE, "write_latency_s": 3.0}, mtbf_s=1800),
    "slow-persist-mtbf-1h": CostInputs(**{**BASE, "base_persist_s": 40.0}, mtbf_s=3600),
    "interference-mtbf-1h": CostInputs(
        **{**BASE, "write_latency_s": 0.4, "write_interference": 0.5}, mtbf_s=3600
    ),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_closed_form_interval_is_the_models_integer_optimum(name):
    c = SCENARIOS[name]
    for batch in (1, 4, 16):
        f = optimal_full_interval(c, batch)
        brute = min(range(1, int(4 * f) + 2), key=lambda n: wall_per_iteration(c, n, batch))
        assert brute in (math.floor(f), math.ceil(f)), (batch, f, brute)


def test_full_checkpointing_follows_youngs_interval_when_failures_are_rare():
    c = CostInputs(**BASE, mtbf_s=30 * 24 * 3600)
    young = math.sqrt(2 * c.base_stall_s * c.mtbf_s) / c.iteration_s  # in iterations
    got = full_checkpointing(c).full_interval
    assert abs(got - young) / young < 0.02, (got, young)
    # Replay (r) is much cheaper than recomputing an iteration (a): the base interval grows by
    # about sqrt(a / r).
    ratio = optimize(c).full_interval / got
    assert ratio == pytest.approx(math.sqrt(c.iteration_s / c.replay_s), rel=0.1)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_model_predicts_the_simulated_wall_time(name):
    c = SCENARIOS[name]
    best = optimize(c)
    for f in (best.full_interval // 3, best.full_interval, 3 * best.full_interval):
        for batch in sorted({1, best.batch_size, 8}):
            predicted = plan(c, max(f, 1), batch).wall_per_iteration_s
            simulated = mean_wall_per_iteration(c, max(f, 1), batch, ITERATIONS, SEEDS)
            assert predicted == pytest.approx(simulated, rel=0.03), (f, batch)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_tuned_setting_is_within_two_percent_of_the_simulated_grid_optimum(name):
    c = SCENARIOS[name]
    best = optimize(c)
    tuned = mean_wall_per_iteration(c, best.full_interval, best.batch_size, ITERATIONS, SEEDS)
    grid = {
        (max(1, round(best.full_interval * k)), b)
        for k in (0.25, 0.5, 1.0, 2.0, 4.0)
        for b in (1, 2, 4, 8, 16)
    }
    results = {fb: mean_wall_per_iteration(c, *fb, ITERATIONS, SEEDS) for fb in grid}
    optimum = min(results.values())
    assert tuned <= optimum * 1.02, (best, min(results, key=results.get), tuned, optimum)


def test_slow_writer_forces_a_batch_that_keeps_up():
    c = SCENARIOS["slow-writer-mtbf-30min"]
    best = optimize(c)
    produce = c.iteration_s + c.diff_s
    assert write_s(c, best.batch_size) / best.batch_size <= produce
    assert best.batch_size > 1
    # Interference makes batching pay even when the writer keeps up.
    assert optimize(SCENARIOS["interference-mtbf-1h"]).batch_size > 1
    assert optimize(SCENARIOS["fast-writer-mtbf-30min"]).batch_size == 1


def test_bases_are_not_taken_faster_than_they_persist():
    c = SCENARIOS["slow-persist-mtbf-1h"]
    # Costly replay, cheap staging: a short interval, unless persists cannot keep up with it.
    fast = {**BASE, "replay_s": 5.0, "base_stall_s": 1.0}
    short = optimize(CostInputs(**fast, mtbf_s=3600))
    slow_inputs = CostInputs(**{**fast, "base_persist_s": 60.0}, mtbf_s=3600)
    slow = optimize(slow_inputs)
    assert short.full_interval < 40
    assert slow.full_interval * step_s(slow_inputs, slow.batch_size) >= 60.0  # F t(B) >= p
    assert plan(c, 10, 1).step_s > plan(c, 40, 1).step_s  # waiting on the persist


def test_host_memory_budget_bounds_the_batch():
    c = CostInputs(
        **{**BASE, "write_latency_s": 3.0}, mtbf_s=1800, host_memory_budget=15e6, max_pending=2
    )
    assert max_batch(c) == 3  # (2 + 3) x B x 1 MB <= 15 MB
    assert optimize(c).batch_size <= 3


def test_more_failures_mean_shorter_intervals_and_more_overhead():
    plans = [optimize(CostInputs(**BASE, mtbf_s=m)) for m in (86400, 7200, 1800, 600)]
    intervals = [p.full_interval for p in plans]
    overheads = [p.overhead for p in plans]
    assert intervals == sorted(intervals, reverse=True)
    assert overheads == sorted(overheads)
    # LowDiff pays c0 every iteration, full checkpointing pays for failures: with one failure a
    # day full checkpointing at its best interval is cheaper here; from one every 2 h, LowDiff.
    full = [full_checkpointing(CostInputs(**BASE, mtbf_s=m)) for m in (86400, 7200, 1800, 600)]
    assert plans[0].overhead > full[0].overhead
    for p, f in zip(plans[1:], full[1:], strict=True):
        assert p.overhead < f.overhead


@pytest.mark.parametrize(
    ("field", "value"),
    [("iteration_s", 0.0), ("replay_s", -1.0), ("mtbf_s", 0.0), ("write_bandwidth", 0.0)],
)
def test_bad_inputs_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        CostInputs(**{**BASE, field: value})


def test_lowdiff_plus_keeps_the_diff_log_only_where_storage_takes_it():
    # 7B parameters at DP=8 (TP=PP=1): a dense differential is 3.5 GB per rank and iteration;
    # a host that steps the node's replicas within an iteration (0.56 s at 400 GB/s).
    job = dict(params=7e9, gpus=8, tensor_parallel=1, pipeline_parallel=1, iteration_s=2.0,
               host_merge_bandwidth=400e9)  # fmt: skip
    slow = compare(JobSpec(**job, storage_bandwidth=10e9))  # 1.25 GB/s per rank: 2.8 s a diff
    fast = compare(JobSpec(**job, storage_bandwidth=500e9))  # 62.5 GB/s per rank: 56 ms a diff
    log, bases = slow[LOWDIFF_PLUS_LOG], slow[LOWDIFF_PLUS_BASES]
    assert log.step_s > 2.0 * 1.3  # training waits for the writer
    assert bases.overhead < 0.01 < log.overhead
    slow_inputs = lowdiff_plus_inputs(JobSpec(**job, storage_bandwidth=10e9))
    fast_inputs = lowdiff_plus_inputs(JobSpec(**job, storage_bandwidth=500e9))
    assert lowdiff_plus_choice(slow_inputs, slow) == LOWDIFF_PLUS_BASES
    assert lowdiff_plus_choice(fast_inputs, fast) == LOWDIFF_PLUS_LOG
    # A log that keeps up stays even where the model finds bases only a hair cheaper (rare
    # failures: recomputing F/2 iterations once in a long while costs less than any log).
    rare = replace(fast_inputs, mtbf_s=1e12, diff_s=0.01)
    plans = lowdiff_plus_plans(rare)
    assert plans[LOWDIFF_PLUS_BASES].wall_per_iteration_s < (
        plans[LOWDIFF_PLUS_LOG].wall_per_iteration_s
    )
    assert lowdiff_plus_choice(rare, plans) == LOWDIFF_PLUS_LOG
    # Bases only: as often as storage writes them (14 bytes per parameter at 10 GB/s: 9.8 s).
    assert bases.full_interval == math.ceil(7e9 * 14 / 10e9 / 2.0)


# Half the failures leave the hosts up: the keepers serve them, from LowDiff's differentials
# (base + replay) or from LowDiff+'s replicas (a copy, no replay).
_DIFFERENTIALS = dict(kept_share=0.5, kept_restart_s=10.0)
_REPLICAS = dict(_DIFFERENTIALS, kept_recovery_s=0.5)
# A further 30% lose a node whole: a replacement node fetches the node's copy from its peer.
_PEERS = dict(peer_share=0.3, peer_restart_s=40.0, peer_fetch_s=2.0)
# LowDiff's newest base in the keepers too: the failures they serve read no base from storage.
_KEPT_BASE = dict(_DIFFERENTIALS, kept_base_load_s=0.5)
KEPT = {
    "differentials": _DIFFERENTIALS,
    "differentials+base": _KEPT_BASE,
    "differentials+base+peers": {**_KEPT_BASE, **_PEERS},
    "replicas": _REPLICAS,
    "differentials+peers": {**_DIFFERENTIALS, **_PEERS},
    "replicas+peers": {**_REPLICAS, **_PEERS},
}


@pytest.mark.parametrize("kept", sorted(KEPT))
def test_the_keepers_tier_is_predicted_as_simulated_and_optimised_in_f(kept):
    c = replace(SCENARIOS["fast-writer-mtbf-10min"], **KEPT[kept])
    if kept.startswith("replicas"):  # LowDiff+ in the keepers: bases only to storage, no log
        c = replace(c, diff_s=0.0, diff_bytes=0.0, write_latency_s=0.0, replay_s=c.iteration_s)
    best = optimize(c)
    f = optimal_full_interval(c, best.batch_size)
    brute = min(range(1, int(4 * f) + 2), key=lambda n: wall_per_iteration(c, n, best.batch_size))
    assert brute in (math.floor(f), math.ceil(f)), (f, brute)
    for interval in (max(1, best.full_interval // 3), best.full_interval):
        predicted = plan(c, interval, best.batch_size).wall_per_iteration_s
        simulated = mean_wall_per_iteration(c, interval, best.batch_size, ITERATIONS, SEEDS)
        assert predicted == pytest.approx(simulated, rel=0.03), interval


def test_failures_the_keepers_serve_cost_less_and_lengthen_the_base_interval():
    storage = SCENARIOS["fast-writer-mtbf-10min"]
    kept = replace(storage, **KEPT["differentials"])
    assert optimize(kept).overhead < optimize(storage).overhead
    # No write batch is lost to a failure the keepers survive; the base and replay remain.
    t = step_s(storage, 4)
    assert failure_cost_s(kept, 20, 4) == pytest.approx(
        0.5 * failure_cost_s(storage, 20, 4) + 0.5 * (10.0 + 10.0 + 10 * 0.05 + t / 2)
    )
    # From the replicas a kept failure costs the same whatever F: bases get rarer.
    bases = replace(storage, diff_s=0.0, diff_bytes=0.0, write_latency_s=0.0, replay_s=1.0)
    with_replicas = replace(bases, **KEPT["replicas"])
    assert full_checkpointing(with_replicas).full_interval > full_checkpointing(bases).full_interval
    assert full_checkpointing(with_replicas).overhead < full_checkpointing(bases).overhead


def test_failures_the_peers_serve_cost_what_their_tier_says_and_less_than_storage():
    storage = SCENARIOS["fast-writer-mtbf-10min"]
    kept = replace(storage, **KEPT["differentials"])
    peers = replace(storage, **KEPT["differentials+peers"])
    t = step_s(storage, 4)
    kept_tier = 10.0 + 10.0 + 10 * 0.05 + t / 2  # restart, base, replay of F/2, in flight
    peer_tier = 40.0 + 2.0 + 10.0 + 10 * 0.05 + t / 2  # replacement node, fetch, the same
    assert failure_cost_s(peers, 20, 4) == pytest.approx(
        0.2 * failure_cost_s(storage, 20, 4) + 0.5 * kept_tier + 0.3 * peer_tier
    )
    assert optimize(peers).overhead < optimize(kept).overhead < optimize(storage).overhead
    # From the replicas, no failure the keepers or their peers serve replays: bases get rarer.
    bases = replace(storage, diff_s=0.0, diff_bytes=0.0, write_latency_s=0.0, replay_s=1.0)
    local = full_checkpointing(replace(bases, **KEPT["replicas"]))
    ring = full_checkpointing(replace(bases, **KEPT["replicas+peers"]))
    assert ring.full_interval > local.full_interval and ring.overhead < local.overhead


def test_a_base_in_the_keepers_serves_their_failures_not_a_lost_nodes():
    storage = SCENARIOS["fast-writer-mtbf-10min"]
    differentials = replace(storage, **KEPT["differentials+peers"])
    with_base = replace(storage, **KEPT["differentials+base+peers"])
    t = step_s(storage, 4)
    kept_tier = 10.0 + 0.5 + 10 * 0.05 + t / 2  # restart, the keepers' base, replay, in flight
    peer_tier = 40.0 + 2.0 + 10.0 + 10 * 0.05 + t / 2  # the base from storage: not in the ring
    assert failure_cost_s(with_base, 20, 4) == pytest.approx(
        0.2 * failure_cost_s(storage, 20, 4) + 0.5 * kept_tier + 0.3 * peer_tier
    )
    assert optimize(with_base).overhead < optimize(differentials).overhead


def test_a_keepers_share_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match="kept_share"):
        CostInputs(**BASE, kept_share=1.5)
    with pytest.raises(ValueError, match="peer_share"):
        CostInputs(**BASE, kept_share=0.8, peer_share=0.3)
    with pytest.raises(ValueError, match="peer_fetch_s"):
        CostInputs(**BASE, peer_share=0.1, peer_fetch_s=-1.0)


def test_the_host_that_steps_the_replicas_is_counted_and_without_a_replica_lowdiff_plus_is_not():
    # 7B parameters on one node of 8 GPUs, 2 s per iteration: the node's host steps 7B
    # parameters per iteration, 32 bytes each (224 GB).
    job = dict(params=7e9, gpus=8, tensor_parallel=1, pipeline_parallel=1, iteration_s=2.0)
    slow_host = JobSpec(**job, host_merge_bandwidth=100e9)
    fast_host = JobSpec(**job, host_merge_bandwidth=400e9)
    assert host_merge_s(slow_host) == pytest.approx(2.24) and host_merge_s(fast_host) == 0.56
    assert merge_wait_s(slow_host) == pytest.approx(0.24) and merge_wait_s(fast_host) == 0.0
    slow, fast = compare(slow_host), compare(fast_host)
    replicas = (LOWDIFF_PLUS_LOG, LOWDIFF_PLUS_BASES, LOWDIFF_PLUS_KEEPERS, LOWDIFF_KEEPER_REPLICAS)
    for name in replicas:  # training runs at the host's pace: 2.24 s per 2 s iteration
        assert slow[name].overhead >= 0.12 - 1e-9, name
        assert fast[name].overhead < 0.01, name
    # Without a replica nothing waits for the host: the plan to run on that host.
    assert slow[LOWDIFF_PLUS_DEVICE].overhead < 0.01
    # With a bound on the wait, LowDiff+ waits it once per base and stages its bases from the
    # device where the host falls behind, and is LowDiff+ with the log where it keeps up.
    assert slow[LOWDIFF_PLUS_BOUNDED].overhead < 0.01
    assert slow[LOWDIFF_PLUS_BOUNDED].overhead > slow[LOWDIFF_PLUS_DEVICE].overhead
    assert fast[LOWDIFF_PLUS_BOUNDED] == fast[LOWDIFF_PLUS_LOG]
    assert lowdiff_plus_bounded_inputs(slow_host).base_stall_s == pytest.approx(
        lowdiff_plus_device_inputs(slow_host).base_stall_s + slow_host.max_merge_wait_s
    )
    assert min(slow, key=lambda k: slow[k].overhead) not in replicas
    # Less traffic per node (more GPUs, each node's shards smaller) and the wait is gone.
    spread = JobSpec(**{**job, "gpus": 64}, host_merge_bandwidth=100e9)
    assert host_merge_s(spread) == pytest.approx(0.28) and merge_wait_s(spread) == 0.0


def test_tune_names_the_host_bandwidth_it_assumes(capsys):
    from megatron_diffckpt.cli import main

    argv = ["tune", "--params", "7e9", "--gpus", "8", "--tensor-parallel", "1",
            "--pipeline-parallel", "1", "--iteration-s", "2",
            "--host-merge-bandwidth", "1e11"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "32 bytes per shard parameter at 100 GB/s (--host-merge-bandwidth" in out
    assert re.search(r" 2\.24  LowDiff, dense +\d+ +\d+ +0\.0\d%", out), out
    assert re.search(r" 2\.24  LowDiff\+ \(bounded wait\) +\d+ +\d+ +0\.0\d%", out), out
    assert "with LowDiff+ (bounded wait) 1 s once per base (--max-merge-wait-s)" in out
    assert re.search(r" 2\.24  LowDiff\+ in keepers +\d+ +\d+ +12\.0\d%", out), out
