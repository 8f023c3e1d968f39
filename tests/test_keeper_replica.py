"""LowDiff+'s replica in the node's keeper: the keeper's merge equals training's step bit for bit,
one iteration behind, settled either way at recovery; a replica over the cap is refused in one
line; real training jobs whose ranks die (one before its hand-over, or all of them) recover from
the keepers without reading a base, and a job that lost its keeper too recovers from storage,
each ending equal to an uninterrupted run (``torch.equal``)."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from launch import (
    RUN_TIMEOUT_S,
    TINY_GPT,
    finish_node,
    kill_tree,
    last_logged,
    launch_node,
    load_dumps,
    rank_process,
    run_cli,
    run_gpt,
    wait_logged,
)
from test_keeper import (
    TwoNodes,
    _assert_ends_as_straight,
    _ranks_of,
    keeper_socket_in,
    replicas_acknowledged,
    start_keeper,
    stopped_then_read,
)

from megatron_diffckpt.capture import record_grads, set_step_inputs
from megatron_diffckpt.errors import DiffCkptUsageError
from megatron_diffckpt.keeper.client import KeeperClient, query, stop
from megatron_diffckpt.keeper.replica_client import KeeperReplicaMerger, recover_from_keepers
from megatron_diffckpt.keeper.replicas import HostedReplica, HostedReplicas, ReplicaLog
from megatron_diffckpt.keeper.server import KeeperState
from megatron_diffckpt.keeper.shm import shared_memory_root
from megatron_diffckpt.out_of_space import StorageFullError
from megatron_diffckpt.replica_merger import MergeJob, ParamSlice, StepInputs, replica_of
from megatron_diffckpt.shared_replica import SharedArena, describe, initial_adam_state
from megatron_diffckpt.snapshot import BucketSnapshotter
from megatron_diffckpt.storage.format import DiffRecord, SegmentIdentity, encode_record
from megatron_diffckpt.storage.reader import list_segments, scan_rank_log

SHAPES = [(3, 4), (5,)]
NUMEL = sum(torch.Size(s).numel() for s in SHAPES)


def _training_optimizer() -> torch.optim.AdamW:
    torch.manual_seed(0)
    params = [torch.randn(s) for s in SHAPES]
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _layout() -> list:
    slices, start = [], 0
    for s in SHAPES:
        n = torch.Size(s).numel()
        slices.append(ParamSlice("b0", start, start + n))
        start += n
    return [[slices]]


def _hosted(tmp_path: Path, train: torch.optim.AdamW, slots: int = 2):
    """The replica of ``train`` as a keeper holds it, and the rank's slot buffers."""
    arena = SharedArena(str(tmp_path))
    replica = replica_of(train, arena.copy, prefix="o0.")
    initial_adam_state(replica, arena.copy)
    buffers = [arena.empty((NUMEL,), torch.float32) for _ in range(slots)]
    request = {
        "iteration": 0,
        "optimizers": describe([replica], arena.spec),
        "layout": [[[[w.bucket, w.start, w.end] for w in g] for g in i] for i in _layout()],
        "slots": [{"b0": arena.spec(b)} for b in buffers],
    }
    return HostedReplica(request, b"", None), buffers


def _step(
    train: torch.optim.AdamW, buffer: torch.Tensor, iteration: int, clip: float | None = None
) -> dict:
    """One training step with random gradients, laid into ``buffer`` as reduced (before
    megatron's clip by ``clip``, when given, in place); its hand-over request."""
    torch.manual_seed(100 + iteration)
    flat = torch.randn(NUMEL)
    buffer.copy_(flat)
    if clip is not None:
        flat.mul_(clip)
    start = 0
    for p in train.param_groups[0]["params"]:
        p.grad = flat[start : start + p.numel()].view(p.shape).clone()
        start += p.numel()
    lr = 1e-2 / iteration
    train.param_groups[0]["lr"] = lr
    train.step()
    group = train.param_groups[0]
    return {
        "iteration": iteration,
        "slot": iteration % 2,
        "filled": ["b0"],
        "groups": {"o0.g0": [lr, group["weight_decay"]]},
        "clip": {} if clip is None else {"0": clip},
    }


def _record(iteration: int) -> bytes:
    return encode_record(DiffRecord(iteration, {"scheduler_steps": iteration}))


def _assert_replica_equals(hosted: HostedReplica, train: torch.optim.AdamW) -> None:
    (replica,) = hosted.optimizers
    pairs = zip(train.param_groups[0]["params"], replica.param_groups[0]["params"], strict=True)
    for p_train, p_rep in pairs:
        assert torch.equal(p_train, p_rep)
        for key, value in train.state[p_train].items():
            assert torch.equal(value, replica.state[p_rep][key]), key


def test_the_keepers_merge_is_the_training_step_one_iteration_behind(tmp_path):
    train = _training_optimizer()
    hosted, buffers = _hosted(tmp_path, train)
    assert hosted.offer() == (-1, -1)  # anchored from a base: storage serves iteration 0
    for it in (1, 2, 3):
        request = _step(train, buffers[it % 2], it)
        released = hosted.take(request, _record(it))
        assert hosted.merged == it - 1 and released == ([] if it == 1 else [(it - 1) % 2])
    assert hosted.offer() == (2, 3)
    with pytest.raises(ValueError, match="expected 4"):
        hosted.take({**request, "iteration": 5}, _record(5))
    assert hosted.flush(3) == [1] and hosted.merged == 3
    _assert_replica_equals(hosted, train)  # exact: the same optimizer, the same inputs


def test_recovery_settles_at_either_iteration_the_keeper_offers(tmp_path):
    for target in (2, 3):
        train, other = _training_optimizer(), _training_optimizer()
        (tmp_path / str(target)).mkdir()
        hosted, buffers = _hosted(tmp_path / str(target), train)
        for it in (1, 2, 3):
            request = _step(train, buffers[it % 2], it)
            if it <= target:
                _step(other, torch.empty(NUMEL), it)
            hosted.take(request, _record(it))
        with pytest.raises(ValueError, match="cannot settle at 1"):
            hosted.settle(1)
        assert hosted.settle(target) == [1]  # the held iteration's slot, merged or dropped
        assert hosted.merged == target and hosted.offer() == (target, target)
        _assert_replica_equals(hosted, other)


@contextlib.contextmanager
def _rank_against_a_keeper(tmp_path: Path, log: dict | None = None) -> Iterator[tuple[Any, ...]]:
    """A keeper process and one rank's side of LowDiff+ against it, anchored at 0 (``log``:
    the spec of the diff log the keeper writes): ``(keeper process, socket, merger,
    snapshotter with 3 shared slots, training optimizer)``."""
    sock = str(tmp_path / "keeper.sock")
    proc = start_keeper(sock)
    try:
        client = KeeperClient(sock, IDENTITY)
        merger = KeeperReplicaMerger(client, _layout(), log=log)
        snapshotter = BucketSnapshotter(
            {"b0": (NUMEL, torch.float32)}, slots=3, buffer=merger.slot_buffer
        )
        merger.attach(snapshotter)
        train = _training_optimizer()
        merger.anchor([train], 0)
        yield proc, sock, merger, snapshotter, train
        client.close()
        snapshotter.close()
    finally:
        proc.send_signal(signal.SIGCONT)  # a test may have stopped it
        stop(sock)
        proc.wait(30)


def test_a_rank_hands_iterations_to_a_keeper_process_and_reads_its_replica(tmp_path):
    """The rank's side against a real keeper process: snapshots into shared slots, hand-over,
    the keeper's merge one behind (slots come back), a base's flush, ``inspect --keeper``."""
    with _rank_against_a_keeper(tmp_path) as (_, sock, merger, snapshotter, train):
        for it in (1, 2, 3):
            grads = torch.empty(NUMEL)
            request = _step(train, grads, it)
            snapshotter.on_bucket_ready("b0", grads)
            slot = snapshotter.finish_iteration(it)
            inputs = StepInputs(request["groups"], {})
            merger.submit(MergeJob(it, slot, inputs, it, 8 * it, ({}, {})))
        merger.wait_idle()
        assert merger.merged_iteration == 2  # the keeper holds the input of 3
        shown = run_cli("inspect", str(tmp_path), "--keeper", sock).stdout
        assert "rank_0_0_1: LowDiff+ replica at iteration 2, holds the input of 3" in shown
        merger.wait_merged(3)  # what a base does
        assert merger.merged_iteration == 3
        (replica,) = merger.optimizers  # the rank's own mapping of the keeper's pages
        for p_train, p_rep in zip(
            train.param_groups[0]["params"], replica.param_groups[0]["params"], strict=True
        ):
            assert torch.equal(p_train, p_rep)
            for key, value in train.state[p_train].items():
                assert torch.equal(value, replica.state[p_rep][key]), key
        assert merger.cpu.totals()["merge step"] > 0  # the keeper's CPU, reported to the rank
        merger.close()
        shown = run_cli("inspect", str(tmp_path), "--keeper", sock).stdout
        assert "0 replica(s)" in shown and "replica at iteration" not in shown


def test_an_iterations_first_reduction_waits_for_the_previous_hand_over(tmp_path):
    """The bound on how far apart ranks' keepers can be: with the keeper stopped, iteration 1
    is handed over but not acknowledged, and iteration 2's first gradient reduction does not
    start; once the keeper runs again, it does, with 1 held by the keeper."""
    with _rank_against_a_keeper(tmp_path) as (proc, sock, merger, snapshotter, train):
        grads = torch.empty(NUMEL)
        request = _step(train, grads, 1)
        snapshotter.before_reduction()  # iteration 1's: nothing was handed over before it
        snapshotter.on_bucket_ready("b0", grads)
        proc.send_signal(signal.SIGSTOP)
        merger.submit(
            MergeJob(1, snapshotter.finish_iteration(1), StepInputs(request["groups"], {}), 1, 8,
                     ({}, {}))
        )  # fmt: skip
        second = threading.Thread(target=snapshotter.before_reduction)
        second.start()
        second.join(1.0)
        stopped_keeper_held_it_back = second.is_alive()
        proc.send_signal(signal.SIGCONT)
        second.join(30)
        assert stopped_keeper_held_it_back and not second.is_alive()
        (row,) = query(sock)["replicas"]
        assert (row["merged"], row["held"]) == (0, 1)
        assert snapshotter.slot_wait_seconds > 0
        snapshotter.on_bucket_ready("b0", grads)
        snapshotter.finish_iteration(2)
        merger.close()


def _snapshot_and_submit(
    snapshotter: BucketSnapshotter, merger: KeeperReplicaMerger, train: torch.optim.AdamW, it: int
) -> None:
    """Training's iteration ``it`` through the rank's side: its first reduction (which may
    wait for the keeper), its snapshot, its hand-over queued."""
    grads = torch.empty(NUMEL)
    request = _step(train, grads, it)
    snapshotter.before_reduction()
    snapshotter.on_bucket_ready("b0", grads)
    slot = snapshotter.finish_iteration(it)
    merger.submit(MergeJob(it, slot, StepInputs(request["groups"], {}), it, 8 * it, ({}, {})))


def _staged(train: torch.optim.AdamW) -> torch.optim.AdamW:
    """A copy of ``train``'s parameters and state, as a base staged from the training state
    holds them (training steps on meanwhile)."""
    staged = _training_optimizer()
    staged.load_state_dict(copy.deepcopy(train.state_dict()))
    for p_staged, p_train in zip(
        staged.param_groups[0]["params"], train.param_groups[0]["params"], strict=True
    ):
        p_staged.copy_(p_train)
    return staged


def test_past_the_bound_a_hand_over_pauses_the_snapshots_until_a_base_re_anchors_the_keeper(
    tmp_path,
):
    """``max_merge_wait_ms`` with the replica in the keeper: with the keeper stopped,
    iteration 2's first reduction waits 0.2 s for the hand-over of 1, then pauses instead (no
    slot, nothing copied, nothing handed over), as does 3 without waiting. Once the keeper runs
    again, a base at 3 re-anchors its replica to the training state (the input it held merged
    first, every slot given back), the snapshots resume, and the replica follows training
    exactly from there."""
    with _rank_against_a_keeper(tmp_path) as (proc, sock, merger, snapshotter, train):
        snapshotter.max_wait_s = 0.2
        grads = torch.empty(NUMEL)
        request = _step(train, grads, 1)
        snapshotter.before_reduction()
        snapshotter.on_bucket_ready("b0", grads)
        proc.send_signal(signal.SIGSTOP)
        merger.submit(
            MergeJob(1, snapshotter.finish_iteration(1), StepInputs(request["groups"], {}), 1, 8,
                     ({}, {}))
        )  # fmt: skip
        for it in (2, 3):  # paused: not snapshotted, dropped
            request = _step(train, grads, it)
            snapshotter.before_reduction()
            snapshotter.on_bucket_ready("b0", grads)
            assert snapshotter.paused and snapshotter.finish_iteration(it) is None
            inputs = StepInputs(request["groups"], {})
            merger.submit(MergeJob(it, None, inputs, it, 8 * it, ({}, {}), dropped=True))
        assert 0.2 <= snapshotter.slot_wait_seconds < 30  # one bounded wait, at iteration 2
        proc.send_signal(signal.SIGCONT)
        staged = _staged(train)  # the base's copy of the training state at 3
        merger.anchor_queued([staged], 3)
        snapshotter.resume()
        assert merger.wait_idle(30)
        assert merger.merged_iteration == 3
        (row,) = query(sock)["replicas"]
        assert (row["merged"], row["held"]) == (3, None)
        assert snapshotter._free.qsize() == 3  # iteration 1's slot came back
        _snapshot_and_submit(snapshotter, merger, train, 4)
        merger.wait_merged(4)
        _assert_replica_equals(merger, train)
        merger.close()


def test_past_the_bound_with_the_keepers_log_every_iteration_is_still_logged(tmp_path, caplog):
    """``max_merge_wait_ms`` with the replica and the diff log in the keeper: with the keeper
    stopped, iteration 2's first reduction waits 0.2 s for the hand-over of 1, then skips the
    keeper's merges (``on_full``) instead of pausing: 2 and 3 are snapshotted and handed over
    to be logged only. Once the keeper runs again, every slot comes back, the log holds 1-3
    (replaying to training bit for bit) while the replica stays at 0 and offers nothing (a
    recovery says why it goes to storage), and a base at 3 re-anchors it: 4 is merged again
    and the replica follows training exactly."""
    spec = {**_log_spec(tmp_path / "diffckpt"), "identity": asdict(IDENTITY)}
    with _rank_against_a_keeper(tmp_path, log=spec) as (proc, sock, merger, snapshotter, train):
        snapshotter.max_wait_s = 0.2
        skipped = []
        snapshotter.on_full = lambda: skipped.append(merger.skip_merges())
        proc.send_signal(signal.SIGSTOP)
        for it in (1, 2, 3):
            _snapshot_and_submit(snapshotter, merger, train, it)
            assert not snapshotter.paused  # snapshotted and handed over
        assert skipped == [1, 1]  # the hand-over of 1 still under way, at 2 and at 3
        proc.send_signal(signal.SIGCONT)
        assert merger.wait_idle(30)
        assert merger.merged_iteration == 0 and snapshotter._free.qsize() == 3
        (row,) = query(sock)["replicas"]
        assert (row["merged"], row["held"], row["logged_only"]) == (0, None, 3)
        shown = run_cli("inspect", str(tmp_path), "--keeper", sock).stdout
        assert "replica at iteration 0, merges paused until the next base (logged to 3)" in shown
        caplog.set_level(logging.INFO)
        with contextlib.closing(KeeperClient(sock, IDENTITY)) as client:
            args = (client, [train], lambda: None, None, lambda values, **_: values)
            assert recover_from_keepers(*args) is None
        paused = "the node keepers' replicas merge nothing until the next base"
        assert f"recovery: {paused}" in caplog.text and "hold no replica" not in caplog.text
        assert merger._call({"op": "replica_log_flush"})["durable"] == 3
        records = scan_rank_log(str(tmp_path / "diffckpt" / IDENTITY.dirname()), IDENTITY, 0)
        assert [r.iteration for r in records.records] == [1, 2, 3]
        _assert_replays_to(records.records, train)
        proc.send_signal(signal.SIGSTOP)  # the anchor takes 0.5 s, past the bound
        threading.Timer(0.5, proc.send_signal, (signal.SIGCONT,)).start()
        merger.anchor_queued([_staged(train)], 3)  # the base's copy of the training state
        waited = snapshotter.slot_wait_seconds
        _snapshot_and_submit(snapshotter, merger, train, 4)
        assert snapshotter.slot_wait_seconds - waited >= 0.4  # the anchor waited for in full
        merger.wait_merged(4)
        assert skipped == [1, 1]  # merged again from the anchor on
        _assert_replica_equals(merger, train)
        merger.close()


def _log_spec(root: Path, batch_size: int = 1, durable: int | None = None) -> dict:
    return {
        "root": str(root), "compressor": "none", "batch_size": batch_size, "max_pending": 2,
        "when_full": "block", "direct_io": True, "slow_hint": "", "durable": durable,
    }  # fmt: skip


def _counters(iteration: int) -> bytes:
    """A rank's hand-over record: its counters and (some) RNG states."""
    rng = {"rng.torch": torch.get_rng_state()}
    scalars = {"scheduler_steps": iteration, "consumed_samples": 4 * iteration, "rng.tracker": []}
    return encode_record(DiffRecord(iteration, scalars, rng))


IDENTITY = SegmentIdentity("run", 0, 0, 1, "layout")


def test_the_keeper_writes_the_diff_log_as_iterations_come_which_replays_to_training(tmp_path):
    """Every iteration handed over is a record of the rank's diff log on storage as the keeper
    receives it, ahead of its merge (the held input is in the log before it is merged), and
    replaying those records onto the state they follow gives training's state bit for bit, as
    does the replica: the log clips each step's gradients in the slot, as megatron does, and
    the merge steps with them as they are (not clipped twice)."""
    train = _training_optimizer()
    (tmp_path / "shm").mkdir()
    hosted, buffers = _hosted(tmp_path / "shm", train)
    hosted.log = ReplicaLog(_log_spec(tmp_path / "diffckpt", batch_size=2), 0, asdict(IDENTITY))
    for it in (1, 2, 3, 4, 5):
        hosted.take(_step(train, buffers[it % 2], it, clip=0.5 if it % 2 else None), _counters(it))
    rank_dir = str(tmp_path / "diffckpt" / IDENTITY.dirname())
    assert hosted.log.flush() == 5 and hosted.merged == 4  # 5 written, held, not merged
    hosted.flush(5)
    _assert_replica_equals(hosted, train)
    records = scan_rank_log(rank_dir, IDENTITY, 0).records
    assert [r.iteration for r in records] == [1, 2, 3, 4, 5]
    assert records[2].scalars["consumed_samples"] == 12 and "rng.torch" in records[0].tensors
    _assert_replays_to(records, train)
    hosted.log.close()


def _assert_replays_to(records: list[DiffRecord], train: torch.optim.AdamW) -> None:
    """Replaying ``records`` onto the state training started from gives ``train``'s, bit for
    bit."""
    replayed = _training_optimizer()
    for record in records:
        set_step_inputs(0, replayed, record, record_grads(record))
        replayed.step()
    for p_train, p_rep in zip(
        train.param_groups[0]["params"], replayed.param_groups[0]["params"], strict=True
    ):
        assert torch.equal(p_train, p_rep)
        for key, value in train.state[p_train].items():
            assert torch.equal(value, replayed.state[p_rep][key]), key


def test_iterations_logged_only_skip_the_merges_until_the_replica_is_opened_again(tmp_path):
    """``replica_log``: the keeper writes an iteration to the diff log and gives its slot back
    at once, unmerged, dropping the input it held (logged already); the replica then offers no
    iteration to a recovery and refuses to merge until it is opened again, and the log holds
    every iteration handed over, which replays to training bit for bit."""
    train = _training_optimizer()
    (tmp_path / "shm").mkdir()
    hosted, buffers = _hosted(tmp_path / "shm", train)
    with pytest.raises(ValueError, match="no diff log is open"):
        hosted.log_only(_step(_training_optimizer(), buffers[1], 1), _counters(1))
    hosted.log = ReplicaLog(_log_spec(tmp_path / "diffckpt"), 0, asdict(IDENTITY))
    for it in (1, 2, 3):
        hosted.take(_step(train, buffers[it % 2], it), _counters(it))
    assert hosted.log_only(_step(train, buffers[0], 4), _counters(4)) == [1, 0]  # 3's, then 4's
    fifth = _step(train, buffers[1], 5)
    assert hosted.log_only(fifth, _counters(5)) == [1]
    assert (hosted.merged, hosted.held, hosted.offer()) == (2, None, (-1, -1))
    with pytest.raises(ValueError, match="after logging 5 only"):
        hosted.take({**fifth, "iteration": 6, "slot": 0}, _counters(6))
    assert hosted.flush(6) == [] and hosted.log.flush() == 5
    records = scan_rank_log(str(tmp_path / "diffckpt" / IDENTITY.dirname()), IDENTITY, 0).records
    assert [r.iteration for r in records] == [1, 2, 3, 4, 5]
    _assert_replays_to(records, train)
    assert hosted.log.continues(5)  # the next base's replica continues the log
    hosted.log.close()


def test_a_new_chain_in_the_keepers_log_cuts_what_an_older_attempt_wrote_after_it(tmp_path):
    """A log opened at iteration 3 on a folder holding 1-6 (an attempt whose records after 3
    are not this chain's) keeps 1-3, removes the rest (a segment straddling 3 rewritten), and
    until a base after the gap is published counts only what storage is known to hold."""
    root = tmp_path / "diffckpt"
    train = _training_optimizer()
    (tmp_path / "shm").mkdir()
    hosted, buffers = _hosted(tmp_path / "shm", train)
    hosted.log = ReplicaLog(_log_spec(root, batch_size=2), 0, asdict(IDENTITY))
    for it in range(1, 7):
        hosted.take(_step(train, buffers[it % 2], it), _counters(it))
    assert hosted.log.flush() == 6
    hosted.log.close()
    rank_dir = str(root / IDENTITY.dirname())
    assert [(f, last) for f, last, _ in list_segments(rank_dir)] == [(1, 2), (3, 4), (5, 6)]
    log = ReplicaLog(_log_spec(root, durable=2), 3, asdict(IDENTITY))
    assert [(f, last) for f, last, _ in list_segments(rank_dir)] == [(1, 2), (3, 3)]
    assert [r.iteration for r in scan_rank_log(rank_dir, IDENTITY, 0).records] == [1, 2, 3]
    assert log.writer.durable_iteration == 2 and log.continues(3) and not log.continues(4)
    log.writer.rebase(3)
    assert log.writer.durable_iteration == 3
    log.close()


def test_a_full_filesystem_under_the_keepers_log_stops_the_rank_in_its_own_words(tmp_path):
    """The keeper's writer of a rank's diff log meets a full filesystem (``--diffckpt-when-full
    block``): the hand-over's reply names it, and the rank raises
    :class:`~megatron_diffckpt.out_of_space.StorageFullError` (as its own writer would), not
    "the keeper is gone"."""
    train = _training_optimizer()
    (tmp_path / "shm").mkdir()
    hosted, buffers = _hosted(tmp_path / "shm", train)
    hosted.log = ReplicaLog(_log_spec(tmp_path / "diffckpt"), 0, asdict(IDENTITY))

    def full(record):
        raise StorageFullError("the diff log cannot be written, /ckpt: No space left on device")

    hosted.log.writer.append = full
    replicas = HostedReplicas(KeeperState(2**30), str(tmp_path / "shm"))
    key = tuple(sorted(asdict(IDENTITY).items()))
    replicas._replicas[key] = hosted
    reply = replicas.handle("replica_merge", key, _step(train, buffers[1], 1), _counters(1))
    assert reply[0]["kind"] == "StorageFullError"
    assert hosted.held is None and hosted.merged == 0  # the hand-over was not taken

    class Client:  # the rank's side of that reply
        def call(self, request, payload=b""):
            return reply

    rank = KeeperReplicaMerger.__new__(KeeperReplicaMerger)
    rank.client = rank._link = Client()
    with pytest.raises(StorageFullError, match="No space left on device"):
        rank._call({"op": "replica_merge"})
    hosted.log.writer.close()


def test_a_replica_over_the_keepers_cap_is_refused_naming_the_flag(tmp_path):
    sock = str(tmp_path / "keeper.sock")
    proc = start_keeper(sock, "--memory-mib", "0.0001")
    try:
        client = KeeperClient(sock, SegmentIdentity("run", 0, 0, 0, "layout"))
        merger = KeeperReplicaMerger(client, _layout())
        merger.slot_buffer(0, "b0", NUMEL, torch.float32)
        with pytest.raises(DiffCkptUsageError, match="--keeper-memory"):
            merger.anchor([_training_optimizer()], 0)
        folder = client.shm_folder()
        assert os.listdir(folder) == []  # the refused replica's files removed
        client.close()
    finally:
        stop(sock)
        proc.wait(30)
    assert not os.path.exists(folder)  # the keeper removes its folder at its end


def _keeper_job(
    tmp_path: Path, total: int, full_interval: int, model: tuple[str, ...] = ()
) -> tuple[list[str], list[str]]:
    """The uninterrupted reference (``tmp_path/straight``); ``(model flags, LowDiff+ flags)``
    of the job under test, whose end goes to ``tmp_path/resumed``. ``model``: more model flags."""
    ckpt = tmp_path / "ckpt"
    common = [*TINY_GPT, "--use-distributed-optimizer", "--lr-decay-iters", "100", *model]
    common += ["--train-iters", str(total)]
    run_gpt(2, *common, "--dump-state", str(tmp_path / "straight"))
    plus = ["--diffckpt-mode", "lowdiff-plus"]  # --diffckpt-keeper auto: the replica in the keeper
    plus += ["--save", str(ckpt), "--load", str(ckpt)]
    plus += ["--diffckpt-full-interval", str(full_interval)]
    return common, [*plus, "--dump-state", str(tmp_path / "resumed")]


MOE_EP2 = tuple(
    "--num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall "
    "--disable-bias-linear --expert-model-parallel-size 2".split()
)


@pytest.mark.distributed
@pytest.mark.parametrize("model", ["dense", "moe-ep2"])
def test_a_rank_killed_before_its_hand_over_recovers_from_the_keepers_exactly(tmp_path, model):
    """Rank 1 dies before handing iteration 11 over, rank 0 has handed it: the ranks agree on
    10, rank 0's keeper drops what it held of 11, rank 1's merges 10, and no base is read. Also
    for a mixture of experts with two experts on each rank (the expert shards' replica in the
    keeper too)."""
    more = MOE_EP2 if model == "moe-ep2" else ()
    common, plus = _keeper_job(tmp_path, total=16, full_interval=1000, model=more)
    proc, lines = launch_node([*common, *plus], {"DIFFCKPT_FAILPOINT": "plus-hand-over:11@1"})
    log = finish_node(proc, lines)
    assert "failpoint plus-hand-over #11: SIGKILL of rank 1" in log
    assert "recovery: iteration 10 from the replica in the node's keeper" in log, log[-3000:]
    assert "loaded checkpoint from" not in log  # only base 0 exists; it was not read
    _assert_ends_as_straight(tmp_path, 10)


@pytest.mark.distributed
def test_a_fused_replica_in_the_keeper_recovers_to_within_rounding(tmp_path):
    """``replica_kernel=fused`` with the replica in the node's keeper (the host kernel of
    training on GPUs, forced on the CPU): the keeper steps it with torch's fused CPU Adam, every
    base re-anchors it to the training state. Rank 1 dies before handing iteration 11 over: the
    ranks recover iteration 10 from the keepers' replicas, two fused steps past base 8, so the
    job ends within rounding of the uninterrupted run (close, not bit for bit)."""
    common, plus = _keeper_job(tmp_path, total=16, full_interval=4)
    fused = ["--diffckpt-option", "replica_kernel=fused"]
    proc, lines = launch_node(
        [*common, *plus, *fused], {"DIFFCKPT_FAILPOINT": "plus-hand-over:11@1"}
    )
    log = finish_node(proc, lines)
    assert "stepped with the fused host kernel, anchored at every base" in log
    assert "recovery: iteration 10 from the replica in the node's keeper" in log, log[-3000:]
    straight, resumed = load_dumps(tmp_path / "straight", 2), load_dumps(tmp_path / "resumed", 2)
    equal = True
    for rank in range(2):
        losses = resumed[rank]["losses"]
        assert losses == pytest.approx(straight[rank]["losses"][10:], rel=1e-4)
        for name, value in straight[rank]["params"].items():
            got = resumed[rank]["params"][name]
            assert torch.allclose(got, value, rtol=1e-4, atol=1e-6), f"rank {rank}: {name}"
            equal = equal and torch.equal(got, value)
    assert not equal  # the fused kernel rounds differently from training's


@pytest.mark.distributed
@pytest.mark.parametrize("diff_log", ["with-log", "without-log"])
def test_a_keeper_slower_than_training_pauses_until_the_next_base_and_recovery_stays_exact(
    tmp_path, diff_log
):
    """The keeper sleeps 0.4 s per merge (a host that cannot keep up; iterations take about
    50 ms), with ``max_merge_wait_ms=100``: an iteration waits at most 100 ms for the previous
    one's hand-over, then the keeper merges nothing until the next base (every 8), which is
    staged from the training state and re-anchors the keeper's replica; with the keeper's diff
    log every iteration is still handed over and logged, without it nothing is handed over.
    The log line's ``stats`` call does not wait behind a merge (the replica has a connection
    of its own). Rank 1 is SIGKILLed in the pause after base 8 was published; the restart
    recovers to the iteration it was killed at with the log (storage's base 8 and the log the
    keepers wrote in the pause), and no older than base 8 without it (the keepers' replicas may
    not be anchored to it yet: storage's then serves), and ends equal to the uninterrupted run
    (``torch.equal``); the keeper says nothing of the rank that died in the middle of a
    merge."""
    common, plus = _keeper_job(tmp_path, total=20, full_interval=8)
    plus += ["--diffckpt-option", "max_merge_wait_ms=100"]
    if diff_log == "without-log":
        plus += ["--diffckpt-option", "diff_log=false"]
    proc, lines = launch_node([*common, *plus], {"DIFFCKPT_DELAY": "keeper-merge:0.4"})
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not ("base of iteration 8 published" in "".join(lines) and last_logged(
                "".join(lines)) >= 10):  # fmt: skip
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-40:])
            time.sleep(0.01)
        rank_process(1, proc.pid).send_signal(signal.SIGKILL)
        killed_after = last_logged("".join(lines))
        log = finish_node(proc, lines)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    first = log[: log.index("base of iteration 8 published")]
    paused = (
        r"not merged until the next base, which is staged from the training state; the diff "
        r"log goes on"
        if diff_log == "with-log"
        else r"neither merged nor logged"
    )
    for rank in (0, 1):  # both paused before base 8, which re-anchored their replicas
        began = rf"\[rank{rank}\].*iterations from \d+ on are {paused}"
        assert re.search(began, first), first[-4000:]
    staged = r"(iterations \d+-8 were|iteration 8 was) not merged; the base of iteration 8 is"
    assert re.search(staged + " staged from the training state", first), first[-4000:]
    assert re.search(r"merge backlog: \d+ \(not merged until the next base\) \|", first)
    restart = log[log.index("base of iteration 8 published") :]
    assert "the node keepers hold no replica" not in restart, restart[-4000:]  # paused, or behind
    got = re.search(r"recovery: iteration (\d+) from the replica in the node's keeper", restart)
    if got is None:  # the keepers' replicas not anchored to base 8 yet, or apart: storage
        got = re.search(r"recovering to iteration (\d+)", restart)
    assert got is not None, restart[-4000:]
    lowest = killed_after - 1 if diff_log == "with-log" else 8  # rank 1 handed over one less
    assert lowest <= int(got[1]) <= killed_after + 1, (got[0], killed_after)
    assert "Exception occurred during processing" not in log, log[-4000:]
    _assert_ends_as_straight(tmp_path, int(got[1]))


@pytest.mark.distributed
def test_ranks_killed_recover_from_the_keepers_then_a_lost_keeper_falls_back_to_storage(
    tmp_path,
):
    """SIGKILL of both ranks after iteration 11 (bases every 5): the restart recovers, from
    the keepers, no less than they acknowledged of both ranks before the kill (storage holds
    base 10; it is not read). Then
    the whole launcher, keeper included, dies after 17: the next launch's keeper is empty, and
    the job recovers from storage: the newest published base, then the diff log the keepers
    wrote, to the newest iteration both ranks' logs hold. The keepers write the bases' files.
    """
    common, plus = _keeper_job(tmp_path, total=40, full_interval=5)
    plus += ["--diffckpt-option", "keeper_writes_bases=true"]  # the storage fallback reads them
    proc, lines = launch_node([*common, *plus])
    try:
        wait_logged(lines, 11, proc)
        victims = _ranks_of(psutil.Process(proc.pid))
        assert len(victims) == 2, victims
        sock = keeper_socket_in("".join(lines))
        acked = stopped_then_read(victims, lambda: replicas_acknowledged([sock], 2))
        for p in victims:
            p.send_signal(signal.SIGKILL)
        wait_logged(lines, 17, proc)
        everything = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(True)]
        for p in everything:
            p.send_signal(signal.SIGKILL)
        proc.wait(RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.2)
    first = "".join(lines)
    got = re.search(r"recovery: iteration (\d+) from the replica in the node's keeper", first)
    assert got is not None, first[-3000:]
    before = last_logged(first[: got.start()])
    # nothing the keeper acknowledged is lost; nothing rank 0 did not reach is made up; and
    # every rank had 10 acknowledged once 11 was logged (11's first reduction waited for it)
    assert 10 <= acked <= int(got[1]) <= before + 1, (acked, int(got[1]), before)
    assert "loaded checkpoint from" not in first
    # the keepers wrote the bases' files (--diffckpt-option keeper_writes_bases; the ranks
    # planned and published them)
    assert "base of iteration 5 published (written by the node's keeper in" in first, first[-3000:]
    assert "writes its base's files itself" not in first
    # the keepers wrote each rank's diff log (the ranks write none in this mode): its segments
    # reach well past base 10 (iteration 12 was merged long before the kill after 17)
    for rank_dir in (tmp_path / "ckpt" / "diffckpt").glob("rank_*"):
        ends = [int(p.name.split("_")[2].split(".")[0]) for p in rank_dir.glob("seg_*.bin")]
        assert max(ends, default=0) >= 12, (rank_dir, sorted(ends))
    proc, lines = launch_node([*common, *plus])
    log = finish_node(proc, lines)
    assert "recovery: the node keepers hold no replica: recovering from storage" in log
    base = re.search(r"loaded checkpoint from \S+ at iteration (\d+)", log)
    # storage's newest published base (one still being written when the job died is not)
    assert base is not None and int(base[1]) % 5 == 0 and int(base[1]) >= 5, log[-3000:]
    got = re.findall(
        r"recovery: base at iteration (\d+), \d+ differential\(s\) to replay, recovering to "
        r"iteration (\d+) \(this rank's log reaches (\d+)",
        log,
    )
    # (rank 0 logs it) the newest iteration every rank's log holds, replayed
    assert len(got) == 1 and got[0][0] == base[1] and int(got[0][1]) <= int(got[0][2]), got
    _assert_ends_as_straight(tmp_path, int(got[0][1]))


@pytest.mark.distributed
@pytest.mark.parametrize("swap", [False, True], ids=["same-seats", "ranks-swap-nodes"])
def test_two_nodes_recover_the_replicas_ranks_then_a_node_then_everything(tmp_path, swap):
    """One machine as two nodes (:class:`test_keeper.TwoNodes`: two node launchers, keepers in a
    ring, one rank each), LowDiff+ with its replica in the keepers, bases every 10:

    1. after iteration 11, both ranks SIGKILLed: they recover T1 from their keepers, no less
       than what the keepers acknowledged of both before the kill;
    2. after 21, node 1 lost whole: its rank is stopped (so that its keeper's last copies reach
       node 0), then launcher, keeper, agent and rank are SIGKILLed and the node started again
       with a fresh keeper; both ranks recover T2, no less than what node 0's keeper held of
       both when node 1 died. In its seat, node 1's keeper adopts node 0's copy of its rank's
       replica. Seated first (``swap``: torchrun's rendezvous orders nodes by address), node 1
       runs rank 0, whose replica node 0's keeper hands over and lets go, and node 0 runs
       rank 1, whose copy its keeper serves as its own;
    3. after 31, everything: fresh keepers hold nothing, storage's newest published base serves
       (a base still being written when the job dies is not one), no older than the newest
       rank 0 logged published, and the diff log the keepers wrote after it.

    The run ends equal to an uninterrupted one (``torch.equal``, state and losses)."""
    common, plus = _keeper_job(tmp_path, total=40, full_interval=10)
    with TwoNodes(tmp_path, [*common, *plus]) as job:

        def before_node_loss() -> int:
            """Node 1's rank stopped, its keeper's last copies reach node 0: the newest
            iteration node 0's keeper can give of each rank (its own and its copy of node 1's),
            the older of the two."""
            return stopped_then_read(
                _ranks_of(psutil.Process(job.nodes[1].pid)),
                lambda: replicas_acknowledged([job.keeper_socket(0)], 2, copies=True),
            )

        acked, held = job.three_faults(
            lambda: replicas_acknowledged([job.keeper_socket(0), job.keeper_socket(1)], 2),
            before_node_loss,
            node_returns_as="127.0.0.1" if swap else None,
        )
        text, before_all, since_all = job.text(), job.before_all_lost(), job.since_all_lost()
    found = re.findall(
        r"\[rank0\] (\d\d:\d\d:\d\d) recovery: iteration (\d+) from the replica in (.*?) in ",
        text,
    )
    to_storage = "recovery: the node keepers hold no replica: recovering from storage"
    # nothing the keepers acknowledged is lost; 10 was, by both, once 11 was logged
    (t1, tier1), (t2, tier2) = [(int(t), tier) for _, t, tier in sorted(found)]
    assert t1 >= acked >= 10 and tier1 == "the node's keeper", (found, acked)
    assert t2 >= max(held, t1 + 1), (found, held)
    adopted = re.findall(  # (rank, the replica's iteration, where from)
        r"keeper: adopted the replica of (rank_\S+) at iteration (\d+).*? from (.*)", text
    )
    assert all(int(it) + 1 >= t2 for _, it, _ in adopted), adopted  # its held input: t2
    peer = "the keeper of node 0 (a peer)"
    if swap:  # rank 0 runs on node 1, from node 0's replica; rank 1 on node 0, from its copy
        assert tier2 == peer, found
        own_copy = "the node's keeper (its copy of node 1's replica)"
        assert sorted((r, w) for r, _, w in adopted) == [
            ("rank_0_0_0", peer),
            ("rank_0_0_1", own_copy),
        ], adopted
        assert "keeper: rank_0_0_0 runs on another node now: its replica here goes" in text
    else:  # node 1's rank from node 0's copy
        assert tier2 == "the node's keeper", found
        assert [(r, w) for r, _, w in adopted] == [("rank_0_0_1", peer)], adopted
    assert to_storage in since_all
    base = re.findall(r"loaded checkpoint from \S+ at iteration (\d+)", since_all)
    # storage's newest published base, read once: no older than the newest rank 0 saw published
    # before everything died (a base still in flight then is not one; on a slow machine every
    # base after 0 can still be in flight at its kill)
    published = re.findall(
        r"\[rank0\] \S+ LowDiff\+: base of iteration (\d+) published", before_all
    )
    assert len(base) == 1 and int(base[0]) in (0, 10, 20, 30), base
    assert int(base[0]) >= max(map(int, published), default=0), (base, published)
    # then the diff log the keepers wrote (node 1's new keeper continued its rank's log from
    # the adopted replica on): rank 0 logs the newest iteration every rank's log holds
    got = re.findall(
        r"recovery: base at iteration (\d+), \d+ differential\(s\) to replay, recovering to "
        r"iteration (\d+) \(this rank's log reaches (\d+)",
        since_all.split(to_storage)[1],
    )
    assert len(got) == 1 and got[0][0] == base[0] and int(got[0][1]) <= int(got[0][2]), got
    _assert_ends_as_straight(tmp_path, int(got[0][1]))


@pytest.mark.distributed
def test_a_killed_launcher_takes_its_keeper_ranks_and_shared_memory_with_it(tmp_path):
    """LowDiff+ with its replica in the keeper under the node launcher: a SIGKILL of the
    launcher (an OOM kill, a step killed outside Slurm's cgroup) leaves nothing of the job
    alive 10 s later (torchrun, ranks, what they started, the keeper) and removes the keeper's
    socket and shared-memory folders."""
    ckpt = tmp_path / "ckpt"
    args = [*TINY_GPT, "--use-distributed-optimizer", "--train-iters", "500"]
    args += ["--diffckpt-mode", "lowdiff-plus", "--save", str(ckpt), "--load", str(ckpt)]
    proc, lines = launch_node([*args, "--diffckpt-full-interval", "10"])
    try:
        wait_logged(lines, 3, proc)
        sock = keeper_socket_in("".join(lines))
        shm = Path(shared_memory_root()) / Path(sock).parent.name
        job = psutil.Process(proc.pid).children(recursive=True)
        assert shm.is_dir() and len(job) >= 4, (shm, job)  # keeper, watchdog, torchrun, 2 ranks
        proc.kill()
        proc.wait(30)
        gone, alive = psutil.wait_procs(job, timeout=10)
    finally:
        kill_tree(proc)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
    assert not shm.exists() and not Path(sock).parent.exists()
    assert "megatron-diffckpt-launch: the launcher (pid" in "".join(lines)
