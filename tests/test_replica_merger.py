"""ReplicaMerger: the host replica steps exactly like the training optimizer fed the same input."""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_diffckpt import failpoints
from megatron_diffckpt.replica_merger import (
    MergeJob,
    ParamSlice,
    ReplicaMerger,
    StepInputs,
    refresh_replicas,
)
from megatron_diffckpt.snapshot import BucketSnapshotter
from megatron_diffckpt.storage.format import SegmentIdentity
from megatron_diffckpt.storage.reader import scan_rank_log
from megatron_diffckpt.storage.writer import DiffLogWriter

SHARDS = {"b0": (10, torch.float32), "b1": (6, torch.float32)}
# layout[inner][group][index]: three main parameters, two in bucket b0 (with a gap), one in b1.
LAYOUT = [[[ParamSlice("b0", 0, 4), ParamSlice("b0", 5, 10)], [ParamSlice("b1", 0, 6)]]]
SHAPES = [[(4,), (5,)], [(2, 3)]]


def _training_optimizer(seed: int = 0) -> torch.optim.AdamW:
    g = torch.Generator().manual_seed(seed)
    groups = [
        {"params": [torch.randn(s, generator=g) for s in SHAPES[0]], "weight_decay": 0.1},
        {"params": [torch.randn(s, generator=g) for s in SHAPES[1]], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


@pytest.fixture
def merger_of():
    """``merger_of(slots)``: (training optimizer, snapshotter, merger anchored at 0); closed."""
    made = []

    def make(slots: int):
        training = _training_optimizer()
        snap = BucketSnapshotter(SHARDS, slots=slots)
        merger = ReplicaMerger(LAYOUT, snap)
        merger.anchor([training], iteration=0)
        made.append((snap, merger))
        return training, snap, merger

    yield make
    for snap, merger in made:
        try:
            merger.close()
        except RuntimeError:
            pass  # a test that made the merger fail checks that itself
        snap.close()


def _fill_and_submit(snap, merger, iteration, buckets, inputs):
    for key, value in buckets.items():
        snap.on_bucket_ready(key, value, None)
    merger.submit(MergeJob(iteration, snap.finish_iteration(iteration), inputs, iteration, 0, None))


def _train_step(opt, buckets, inputs):
    """What megatron does: main grads are views of the reduced shard (cast to fp32 when it is
    not), scaled in place by the clipping coefficient (``grads.copy_(grads * coeff)``), then
    the torch step."""
    coeff = inputs.clip_coeffs.get(0)
    for g, group in enumerate(opt.param_groups):
        group["lr"], group["weight_decay"] = inputs.groups[f"o0.g{g}"]
        for k, p in enumerate(group["params"]):
            where = LAYOUT[0][g][k]
            grad = buckets[where.bucket][where.start : where.end].view(p.shape).float()
            if coeff is not None:
                grad.copy_(grad * coeff)
            p.grad = grad
    opt.step()


def _assert_replica_is(training: torch.optim.Optimizer, replica: torch.optim.Optimizer) -> None:
    """Parameters and Adam state equal bit for bit."""
    for g_t, g_r in zip(training.param_groups, replica.param_groups, strict=True):
        for p_t, p_r in zip(g_t["params"], g_r["params"], strict=True):
            assert torch.equal(p_t, p_r)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(training.state[p_t][key], replica.state[p_r][key]), key


def _logging_merger(tmp_path):
    """(identity, training optimizer, snapshotter with 2 slots, diff log writer with B = 1,
    merger writing it, anchored at 0)."""
    identity = SegmentIdentity("run", 0, 0, 0, "l")
    training = _training_optimizer()
    snap = BucketSnapshotter(SHARDS, slots=2)
    writer = DiffLogWriter(str(tmp_path), identity, "none", 1, serialise_at_append=True)
    merger = ReplicaMerger(LAYOUT, snap, writer)
    merger.anchor([training], iteration=0)
    return identity, training, snap, writer, merger


@pytest.fixture
def held(monkeypatch):
    """An event the merger waits for before each step (its delay point): set, it merges."""
    event = threading.Event()
    delay = failpoints.delay
    monkeypatch.setattr(failpoints, "delay", lambda n: event.wait() if n == "merge" else delay(n))
    yield event
    event.set()


def test_replica_is_bit_identical_to_the_training_optimizer_over_steps(merger_of):
    training, snap, merger = merger_of(2)
    gen = torch.Generator().manual_seed(1)
    for it in range(1, 9):
        buckets = {k: torch.randn(n, generator=gen) for k, (n, _) in SHARDS.items()}
        inputs = StepInputs(
            groups={"o0.g0": [1e-2 / it, 0.1], "o0.g1": [1e-2 / it, 0.0]},
            clip_coeffs={0: 0.37} if it % 2 else {},
        )
        _fill_and_submit(snap, merger, it, buckets, inputs)  # snapshot before the in-place clip
        _train_step(training, buckets, inputs)
    merger.wait_merged(8)
    _assert_replica_is(training, merger.optimizers[0])


def test_a_skipped_step_leaves_the_replica_unchanged_and_frees_its_slot(merger_of):
    training, snap, merger = merger_of(1)
    before = [p.clone() for g in merger.optimizers[0].param_groups for p in g["params"]]
    buckets = {k: torch.full((n,), float("inf")) for k, (n, _) in SHARDS.items()}
    for it in (1, 2):  # one slot: the second iteration needs the first one's slot back
        _fill_and_submit(snap, merger, it, buckets, StepInputs())
    merger.wait_merged(2)
    after = [p for g in merger.optimizers[0].param_groups for p in g["params"]]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert not merger.optimizers[0].state  # no step ran


def test_anchor_copies_into_the_existing_replica_tensors(merger_of):
    training, snap, merger = merger_of(1)
    replica_param = merger.optimizers[0].param_groups[0]["params"][0]
    with torch.no_grad():
        training.param_groups[0]["params"][0].add_(1.0)
    merger.anchor([training], iteration=5)
    assert merger.merged_iteration == 5
    assert merger.optimizers[0].param_groups[0]["params"][0] is replica_param  # same tensor
    assert torch.equal(replica_param, training.param_groups[0]["params"][0])


def test_a_missing_bucket_fails_loudly_on_the_training_thread(merger_of):
    training, snap, merger = merger_of(2)
    snap.on_bucket_ready("b0", torch.zeros(10), None)  # b1 never reduced
    inputs = StepInputs(groups={"o0.g0": [1e-3, 0.0], "o0.g1": [1e-3, 0.0]})
    merger.submit(MergeJob(1, snap.finish_iteration(1), inputs, 1, 0, None))
    with pytest.raises(RuntimeError, match="merger failed") as info:
        merger.wait_merged(1)
    assert "bucket b1 was not snapshotted" in str(info.value.__cause__)
    with pytest.raises(RuntimeError, match="merger failed"):
        merger.submit(MergeJob(2, None, StepInputs(), 2, 0, None))


def test_jobs_without_rng_states_are_merged_but_not_logged(tmp_path):
    """LowDiff+ turns its diff log off by handing jobs over without RNG states: the replica
    goes on merging, the log keeps what came before."""
    training = _training_optimizer()
    snap = BucketSnapshotter(SHARDS, slots=2)
    writer = DiffLogWriter(str(tmp_path), SegmentIdentity("run", 0, 0, 0, "l"), "none", 1)
    merger = ReplicaMerger(LAYOUT, snap, writer)
    merger.anchor([training], iteration=0)
    gen = torch.Generator().manual_seed(3)
    try:
        for it in range(1, 7):
            buckets = {k: torch.randn(n, generator=gen) for k, (n, _) in SHARDS.items()}
            inputs = StepInputs(groups={"o0.g0": [1e-2, 0.1], "o0.g1": [1e-2, 0.0]})
            for key, value in buckets.items():
                snap.on_bucket_ready(key, value, None)
            rng = ({}, {}) if it <= 3 else None  # the log stops after iteration 3
            merger.submit(MergeJob(it, snap.finish_iteration(it), inputs, it, 0, rng))
            _train_step(training, buckets, inputs)
        merger.wait_merged(6)
        assert writer.flush() == 3 and writer.stats.records == 3
        replica = merger.optimizers[0].param_groups[0]["params"]
        for p_t, p_r in zip(training.param_groups[0]["params"], replica, strict=True):
            assert torch.equal(p_t, p_r)
    finally:
        merger.close()
        snap.close()
        writer.close()


@pytest.mark.parametrize("serialise_at_append", [True, False], ids=["serialised", "copied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_diff_log_runs_ahead_of_a_merger_that_is_behind(
    tmp_path, held, dtype, serialise_at_append
):
    """The merger is held before its first step: the log thread still writes every iteration
    handed over, each record the exact clipped optimizer input; let go, the merger steps the
    replica bit for bit as training stepped (the log clipped fp32 snapshots in place first,
    which the merger does not repeat; bf16 ones it casts and clips again)."""
    identity = SegmentIdentity("run", 0, 0, 0, "l")
    shards = {k: (n, dtype) for k, (n, _) in SHARDS.items()}
    training = _training_optimizer()
    snap = BucketSnapshotter(shards, slots=5)  # room for every iteration: the merger holds them
    writer = DiffLogWriter(
        str(tmp_path), identity, "none", 2, serialise_at_append=serialise_at_append
    )
    merger = ReplicaMerger(LAYOUT, snap, writer)
    merger.anchor([training], iteration=0)
    gen = torch.Generator().manual_seed(5)
    expected = {}
    try:
        for it in range(1, 6):
            buckets = {k: torch.randn(n, generator=gen).to(dtype) for k, (n, _) in shards.items()}
            coeff = 0.37 if it % 2 else None
            inputs = StepInputs(
                groups={"o0.g0": [1e-2 / it, 0.1], "o0.g1": [1e-2 / it, 0.0]},
                clip_coeffs={0: coeff} if coeff is not None else {},
            )
            for key, value in buckets.items():
                snap.on_bucket_ready(key, value, None)
            merger.submit(MergeJob(it, snap.finish_iteration(it), inputs, it, 0, ({}, {})))
            expected[it] = {
                f"o0.g{g}.p{k}:dense": buckets[w.bucket][w.start : w.end].float()
                * (coeff if coeff is not None else 1.0)
                for g, group in enumerate(LAYOUT[0])
                for k, w in enumerate(group)
            }
            _train_step(training, buckets, inputs)
        merger.wait_logged()
        assert writer.flush() == 5  # every iteration durable...
        assert merger.merged_iteration == 0  # ...while the merger has stepped none
        scan = scan_rank_log(writer.dir, identity, 0)
        assert [r.iteration for r in scan.records] == [1, 2, 3, 4, 5]
        for record in scan.records:
            assert record.scalars["groups"]["o0.g0"] == [1e-2 / record.iteration, 0.1]
            for name, want in expected[record.iteration].items():
                assert torch.equal(record.tensors[name], want), (record.iteration, name)
        held.set()
        merger.wait_merged(5)
        _assert_replica_is(training, merger.optimizers[0])
    finally:
        held.set()  # before close: the merger finishes what is queued
        merger.close()
        snap.close()
        writer.close()


def test_past_the_bound_on_a_slot_wait_the_merger_skips_to_the_next_anchor_and_the_log_goes_on(
    tmp_path, held
):
    """``max_merge_wait_ms`` with the diff log on: the merger is held in its first step and
    holds one of 2 slots. Iteration 3 finds no slot within the bound: the snapshotter asks the
    merger to let go (``on_full``), the queued iteration 2 gives its slot back at once, and from
    then on every slot comes back as soon as the log has read it: training goes on to 5 with
    the merger still held, and every iteration is logged. Anchored to the training state after
    5 (as a base in a pause is staged), the replica then merges 6 and equals training bit for
    bit."""
    identity, training, snap, writer, merger = _logging_merger(tmp_path)
    full = []
    snap.max_wait_s = 0.05
    snap.on_full = lambda: (full.append(snap_iteration[0]), merger.skip_merges())
    snap_iteration = [0]
    gen = torch.Generator().manual_seed(7)
    try:
        for it in range(1, 7):
            if it == 6:  # a base in the pause: the replica anchored to the training state
                merger.anchor_queued(refresh_replicas([training], None), 5)
            snap_iteration[0] = it
            buckets = {k: torch.randn(n, generator=gen) for k, (n, _) in SHARDS.items()}
            inputs = StepInputs(
                groups={"o0.g0": [1e-2, 0.1], "o0.g1": [1e-2, 0.0]}, clip_coeffs={0: 0.5}
            )
            for key, value in buckets.items():
                snap.on_bucket_ready(key, value, None)
            merger.submit(MergeJob(it, snap.finish_iteration(it), inputs, it, 0, ({}, {})))
            _train_step(training, buckets, inputs)
        merger.wait_logged()
        assert full and full[0] == 3  # the first iteration that found no slot in time
        assert writer.flush() == 6 and merger.merged_iteration == 0  # logged, still held
        held.set()
        merger.wait_merged(6)
        _assert_replica_is(training, merger.optimizers[0])
    finally:
        held.set()  # before close: the merger finishes what is queued
        merger.close()
        snap.close()
        writer.close()


def test_a_dropped_replica_merges_nothing_more_and_the_log_goes_on(tmp_path, held):
    """The auto-tuner's drop of the replica (:meth:`ReplicaMerger.drop_replica`): the merger is
    held in its first step, holding one of 2 slots, with an anchor (a base staged in a pause)
    queued behind iteration 2. Dropped then, the replica is let go at once, nothing queued or
    submitted later is merged (the anchor included), every slot comes back as soon as the log
    has read it (training goes on to 6 without waiting for the held merger), and every record
    is the exact optimizer input, its parameters' shapes read from the training optimizer."""
    identity, training, snap, writer, merger = _logging_merger(tmp_path)
    full = []
    snap.max_wait_s = 5.0  # a slot that does not come back fails the test, not hangs it
    snap.on_full = lambda: full.append(True)
    gen = torch.Generator().manual_seed(11)
    expected = {}
    try:
        for it in range(1, 7):
            if it == 3:
                merger.anchor_queued(refresh_replicas([training], None), 2)
                assert merger.has_replica
                merger.drop_replica([training], 2)
                assert not merger.has_replica and merger.optimizers == []
            buckets = {k: torch.randn(n, generator=gen) for k, (n, _) in SHARDS.items()}
            inputs = StepInputs(groups={"o0.g0": [1e-2, 0.1], "o0.g1": [1e-2, 0.0]})
            for key, value in buckets.items():
                snap.on_bucket_ready(key, value, None)
            merger.submit(MergeJob(it, snap.finish_iteration(it), inputs, it, 0, ({}, {})))
            expected[it] = {
                f"o0.g{g}.p{k}:dense": buckets[w.bucket][w.start : w.end]
                for g, group in enumerate(LAYOUT[0])
                for k, w in enumerate(group)
            }
            _train_step(training, buckets, inputs)
        merger.wait_logged()
        assert not full  # no slot wait ran out: the held merger held none past the log
        assert writer.flush() == 6
        scan = scan_rank_log(writer.dir, identity, 0)
        assert [r.iteration for r in scan.records] == [1, 2, 3, 4, 5, 6]
        for record in scan.records:
            for name, want in expected[record.iteration].items():
                assert torch.equal(record.tensors[name], want), (record.iteration, name)
        held.set()
        merger.wait_merged(6)
        assert merger.optimizers == []  # the anchor queued before the drop made no new replica
    finally:
        held.set()
        merger.close()
        snap.close()
        writer.close()
