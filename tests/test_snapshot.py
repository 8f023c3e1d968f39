"""BucketSnapshotter: copies land after the reduction, slots bound the backlog, bubbles traced."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_diffckpt.snapshot import BucketSnapshotter, summarize_traces


class _Reduction:
    """A reduction handle that completes when the test says so (``wait`` blocks until then)."""

    def __init__(self, tensor: torch.Tensor, value: float):
        self.tensor, self.value = tensor, value
        self.done = threading.Event()

    def complete(self) -> None:
        self.tensor.fill_(self.value)
        self.done.set()

    def wait(self) -> bool:
        assert self.done.wait(10)
        return True


SHARDS = {"b0": (6, torch.float32), "b1": (4, torch.float32)}


def test_copy_waits_for_the_reduction_and_holds_its_result():
    snap = BucketSnapshotter(SHARDS, slots=2)
    grads = {"b0": torch.zeros(6), "b1": torch.zeros(4)}
    handle = _Reduction(grads["b0"], 3.0)
    snap.on_bucket_ready("b0", grads["b0"], handle)
    grads["b1"].fill_(7.0)
    snap.on_bucket_ready("b1", grads["b1"], None)  # already reduced (synchronous)
    threading.Timer(0.05, handle.complete).start()
    slot = snap.finish_iteration(1)  # flushes: waits for both copies
    slot.wait_ready()
    assert slot.iteration == 1 and slot.filled == {"b0", "b1"}
    assert torch.equal(slot.buffers["b0"], torch.full((6,), 3.0))
    assert torch.equal(slot.buffers["b1"], torch.full((4,), 7.0))
    grads["b0"].zero_()  # the source may change after the flush; the snapshot does not
    assert torch.equal(slot.buffers["b0"], torch.full((6,), 3.0))
    snap.close()


def test_ranges_changed_after_reduction_are_copied_again_once_at_flush():
    snap = BucketSnapshotter(SHARDS, slots=1)
    grad = torch.ones(6)
    snap.refresh_at_flush = [("b0", 2, 4, grad[2:4])]
    snap.on_bucket_ready("b0", grad, None)
    grad[2:4] = 5.0  # e.g. the shared embedding's second all-reduce
    snap.flush()
    grad.mul_(0.5)  # clipping, after the flush: must not reach the snapshot
    slot = snap.finish_iteration(1)
    assert slot.buffers["b0"].tolist() == [1, 1, 5, 5, 1, 1]
    snap.close()


def test_training_waits_for_a_free_slot_until_the_consumer_releases_one():
    snap = BucketSnapshotter(SHARDS, slots=2)
    held = []
    for it in (1, 2):
        snap.on_bucket_ready("b1", torch.full((4,), float(it)), None)
        held.append(snap.finish_iteration(it))
    released_at = []

    def consumer():
        time.sleep(0.2)
        released_at.append(time.perf_counter())
        snap.release(held[0])

    threading.Thread(target=consumer).start()
    snap.on_bucket_ready("b1", torch.full((4,), 3.0), None)  # blocks: both slots are held
    resumed_at = time.perf_counter()
    assert released_at and resumed_at >= released_at[0]
    assert snap.slot_wait_seconds > 0
    slot = snap.finish_iteration(3)
    assert slot.index == held[0].index and slot.buffers["b1"].tolist() == [3.0] * 4
    assert held[1].buffers["b1"].tolist() == [2.0] * 4  # the held slot was not overwritten
    snap.close()


def test_deferred_copies_are_issued_in_bubbles_and_traced():
    snap = BucketSnapshotter(SHARDS, slots=2, defer_to_bubbles=True)
    snap.on_bucket_ready("b0", torch.full((6,), 2.0), None)
    assert not snap._in_flight  # queued while the stage computes
    with snap.bubble():
        snap._in_flight[0].result()  # the stage waits on a peer; the worker copies meanwhile
    snap.on_bucket_ready("b1", torch.full((4,), 4.0), None)  # after the bubble: flushed later
    slot = snap.finish_iteration(1)
    assert slot.buffers["b0"].tolist() == [2.0] * 6 and slot.buffers["b1"].tolist() == [4.0] * 4
    trace = snap.traces[-1]
    assert trace.iteration == 1 and len(trace.waits) == 1
    flags = sorted(b for *_, b in trace.copies)
    assert flags == [False, True]
    summary = summarize_traces([trace])
    assert 0 < summary["copy_seconds_in_bubbles"] <= summary["copy_seconds"]
    assert trace.as_dict()["copies_issued_in_bubbles"] == 1
    snap.close()


def test_unknown_bucket_and_wrong_size_are_refused():
    snap = BucketSnapshotter(SHARDS, slots=1)
    with pytest.raises(KeyError, match="unknown bucket"):
        snap.on_bucket_ready("b9", torch.zeros(6), None)
    with pytest.raises(ValueError, match="shard has 5 elements"):
        snap.on_bucket_ready("b0", torch.zeros(5), None)
    snap.close()


def test_a_reduction_is_not_waited_on_after_megatron_finished_it():
    """With gloo every ``wait()`` copies the reduction's result into the bucket again: a wait after
    megatron's ``finish_grad_sync`` would undo what megatron did to the bucket since (the shared
    embedding's all-reduce, clipping). The snapshot's handle waits only before."""
    from megatron_diffckpt.patches.bucket_snapshot import _GuardedReduction

    bucket = torch.zeros(4)
    handle = _Reduction(bucket, 3.0)
    handle.complete()
    reduction = _GuardedReduction(handle, threading.Lock())
    reduction.wait()  # during the backward pass: the result lands
    assert bucket.tolist() == [3.0] * 4
    reduction.finished = True  # megatron's finish_grad_sync returned
    bucket.mul_(0.5)  # e.g. clipping
    handle.tensor = bucket
    handle.complete = None
    calls = []
    handle.wait = lambda: calls.append(1)
    reduction.wait()
    assert calls == [] and bucket.tolist() == [1.5] * 4
