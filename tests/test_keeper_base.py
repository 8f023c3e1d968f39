"""LowDiff's newest base in the node's keeper: staged, held and dropped by a real keeper process
bit for bit, refused over the cap; the ranks' agreement on the base; and real jobs under the
node launcher whose ranks, SIGKILLed, recover from the keepers' base without reading storage's
(the example's loop) or from a base newer than the one storage published (asynchronous
saves), ending ``torch.equal`` to an uninterrupted run."""

from __future__ import annotations

import io
import os
import re
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch
from launch import (
    KEPT_BASE_ONLY,
    assert_same_state,
    finish_node,
    kill_tree,
    launch_node,
    load_dumps,
    run_cli,
    wait_logged,
)
from test_keeper import (
    ME,
    TwoNodes,
    _ranks_of,
    _wait_for,
    chains_acknowledged,
    keeper_socket_in,
    record,
    replicas_acknowledged,
    start_keeper,
    stopped_then_read,
)
from test_keeper_replica import MOE_EP2, _assert_ends_as_straight, _keeper_job

from megatron_diffckpt.capture import GradShardCapture
from megatron_diffckpt.exchange import ErrorFeedbackResiduals
from megatron_diffckpt.keeper import base_stager
from megatron_diffckpt.keeper.client import KeeperClient, query, stop
from megatron_diffckpt.keeper.replicas import HostedReplica
from megatron_diffckpt.keeper.shm import shared_memory_root
from megatron_diffckpt.replica_merger import replica_of
from megatron_diffckpt.shared_replica import SharedArena, describe
from megatron_diffckpt.storage.format import DiffRecord, encode_record, iter_records


def _trained(n: int = 1000, steps: int = 3, seed: int = 0) -> torch.optim.AdamW:
    """A torch AdamW over two parameters, stepped ``steps`` times (state created)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for _ in range(2)]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(n, generator=g)
        opt.step()
    return opt


def _residuals(n: int = 500) -> ErrorFeedbackResiduals:
    residuals = ErrorFeedbackResiduals()
    residuals.get("bucket0", torch.zeros(n)).copy_(torch.arange(n, dtype=torch.float32))
    return residuals


def _record(iteration: int) -> DiffRecord:
    scalars = {"scheduler_steps": iteration, "consumed_samples": 8 * iteration}
    return DiffRecord(iteration, scalars, {"rng.torch": torch.get_rng_state()})


def _assert_same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    for pa, pb in zip(a.param_groups[0]["params"], b.param_groups[0]["params"], strict=True):
        assert torch.equal(pa, pb)
        assert a.state[pa].keys() == b.state[pb].keys()
        for k, v in a.state[pa].items():
            assert torch.equal(v, b.state[pb][k]), k


def test_a_staged_base_is_served_bit_for_bit_and_dropped_once_a_newer_one_is_published(
    tmp_path,
):
    sock, shm = str(tmp_path / "keeper.sock"), tmp_path / "shm"
    proc = start_keeper(sock, "--shm-dir", str(shm))
    try:
        rank = KeeperClient(sock, ME)
        train, residuals = _trained(), _residuals()
        assert base_stager.stage_base(rank, [train], residuals, _record(5)) == ""
        rank.published(5)
        before = {f.name for f in shm.iterdir()}
        for p in train.param_groups[0]["params"]:  # training goes on: the keeper's copy stays
            p.grad = torch.ones_like(p)
        train.step()
        assert base_stager.stage_base(rank, [train], residuals, _record(10)) == ""
        rank.close()

        # A new attempt's client (the staging one is gone) gets both: 10 is not published
        # yet, and a rank killed before staging it shares only 5 with the others.
        restarted = KeeperClient(sock, ME)
        offered = base_stager.offered_bases(restarted)
        assert sorted(offered.bases) == [5, 10] and offered.newest == 10
        row, counters = offered.bases[10]
        assert counters.scalars["consumed_samples"] == 80
        fresh = _trained(seed=1)
        into = ErrorFeedbackResiduals()
        base_stager.load_kept_base(row, [fresh], into)
        _assert_same_optimizer(train, fresh)
        assert torch.equal(into.tensors()["bucket0"], residuals.tensors()["bucket0"])
        shown = run_cli("inspect", str(tmp_path), "--keeper", sock).stdout
        assert "rank_0_0_1: LowDiff base of iteration 10" in shown, shown

        restarted.published(10)
        offered = base_stager.offered_bases(restarted)
        assert sorted(offered.bases) == [10]
        after = {f.name for f in shm.iterdir()}
        assert after and not before & after  # base 5's files are gone, base 10's are not
        again = _trained(seed=2)
        base_stager.load_kept_base(offered.bases[10][0], [again], None)
        _assert_same_optimizer(train, again)
        held = query(sock)
        assert held["reserved"] == sum(b["bytes"] for b in held["bases"]) > 0
    finally:
        stop(sock)
        proc.wait(30)


def test_a_base_goes_to_the_next_nodes_keeper_and_a_fresh_keeper_adopts_it(tmp_path):
    """Two keepers in a ring on loopback: node 1's rank stages bases 5 and 10 (5 published),
    each copied to node 0's keeper; node 1's keeper is SIGKILLed; a fresh one, asked for the
    rank's bases, adopts node 0's copies and serves them bit for bit (optimizer shard,
    residuals, counters) as its own; a base published through it prunes the copy."""
    peers = str(tmp_path / "peers")
    ring = ["--peers", peers, "--nnodes", "2", "--host", "127.0.0.1"]
    a_sock, b_sock = str(tmp_path / "a.sock"), str(tmp_path / "b.sock")
    a = start_keeper(a_sock, *ring, "--node", "0")
    b = start_keeper(b_sock, *ring, "--node", "1")
    try:
        rank = KeeperClient(b_sock, ME)
        train, residuals = _trained(), _residuals()
        assert base_stager.stage_base(rank, [train], residuals, _record(5)) == ""
        rank.published(5)
        for p in train.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        train.step()
        assert base_stager.stage_base(rank, [train], residuals, _record(10)) == ""

        def copies() -> list[int]:
            return sorted(r["iteration"] for r in query(a_sock)["bases"] if r["copy"])

        _wait_for(lambda: copies() == [5, 10], "node 1's bases at node 0")
        shown = run_cli("inspect", str(tmp_path), "--keeper", a_sock).stdout
        assert "rank_0_0_1: copy of the previous node's LowDiff base of iteration 10" in shown
        assert re.search(r"ring: copies to the keeper of node 1; waiting .*; 0 dropped", shown)
        b.send_signal(signal.SIGKILL)
        b.wait(30)
        fresh = start_keeper(str(tmp_path / "b2.sock"), *ring, "--node", "1")
        try:
            restarted = KeeperClient(str(tmp_path / "b2.sock"), ME)
            offered = base_stager.offered_bases(restarted)
            assert sorted(offered.bases) == [5, 10]
            row, counters = offered.bases[10]
            assert row["tier"] == "the keeper of node 0 (a peer)"
            assert counters.scalars["consumed_samples"] == 80
            into, again = ErrorFeedbackResiduals(), _trained(seed=1)
            base_stager.load_kept_base(row, [again], into)
            _assert_same_optimizer(train, again)
            assert torch.equal(into.tensors()["bucket0"], residuals.tensors()["bucket0"])
            held = query(str(tmp_path / "b2.sock"))["bases"]
            assert sorted(r["iteration"] for r in held if not r["copy"]) == [5, 10]
            restarted.published(10)  # travels the ring: node 0 drops its copy of 5
            _wait_for(lambda: copies() == [10], "the published base at the copy")
        finally:
            stop(str(tmp_path / "b2.sock"))
            fresh.wait(30)
    finally:
        stop(a_sock)
        a.wait(30)
        if b.poll() is None:
            b.kill()


def _rss(pid: int, field: str = "VmHWM") -> int:
    """A process's peak resident bytes (``VmHWM``: heap and mapped pages alike), or its
    resident bytes now (``VmRSS``)."""
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith(f"{field}:"))
    return kib * 1024


def _large(seed: int) -> torch.optim.AdamW:
    """A torch AdamW over 8 parameters of 12M elements, stepped once: 1.1 GiB of state in
    tensors of 48 MB."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(12_000_000, generator=g)) for _ in range(8)]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    for p in params:
        p.grad = torch.randn(12_000_000, generator=g)
    opt.step()
    for p in params:
        p.grad = None
    return opt


@pytest.mark.slow
def test_a_base_past_a_gib_goes_around_the_ring_without_entering_a_keepers_heap(tmp_path):
    """A base of 1.1 GiB (a rank's shard of 96M parameters: weights and Adam moments),
    larger than the ring's queue of records in memory (1 GiB, which a copy held in the
    keeper's heap could not pass): node 1's keeper streams its files to node 0's, which writes
    them into its shared memory as they arrive; node 1 is lost, its fresh keeper adopts the
    copy the same way, and the rank loads it bit for bit. No keeper's peak memory grows near
    the base's size above what it held idle (each maps at most one tensor of it at a time;
    idle, a keeper holds what its imports take: about 0.3 GB with torch's CPU build, 0.8 GB
    with its CUDA build)."""
    peers = str(tmp_path / "peers")
    ring = ["--peers", peers, "--nnodes", "2", "--host", "127.0.0.1", "--memory-mib", "4096"]
    a_sock, b_sock, b2_sock = (str(tmp_path / f"{n}.sock") for n in ("a", "b", "b2"))
    a = start_keeper(a_sock, *ring, "--node", "0")
    b = start_keeper(b_sock, *ring, "--node", "1")
    idle = {"node 0": _rss(a.pid, "VmRSS")}
    fresh = None
    try:
        train = _large(seed=3)
        rank = KeeperClient(b_sock, ME)
        assert base_stager.stage_base(rank, [train], None, _record(7)) == ""
        size = query(b_sock)["bases"][0]["bytes"]
        assert size > 1 << 30

        def copies() -> list[int]:
            return [r["iteration"] for r in query(a_sock)["bases"] if r["copy"]]

        _wait_for(lambda: copies() == [7], "the 1.1 GiB base at node 0", timeout=300)
        b.send_signal(signal.SIGKILL)
        b.wait(30)
        fresh = start_keeper(b2_sock, *ring, "--node", "1")
        idle["node 1, fresh"] = _rss(fresh.pid, "VmRSS")
        offered = base_stager.offered_bases(KeeperClient(b2_sock, ME))
        assert sorted(offered.bases) == [7]
        assert offered.bases[7][0]["tier"] == "the keeper of node 0 (a peer)"
        grown = {
            node: _rss(p.pid) - idle[node] for node, p in (("node 0", a), ("node 1, fresh", fresh))
        }
        again = _large(seed=4)
        base_stager.load_kept_base(offered.bases[7][0], [again], None)
        _assert_same_optimizer(train, again)
        assert all(g < size / 2 for g in grown.values()), (grown, idle, size)
    finally:
        for sock, proc in ((a_sock, a), (b2_sock, fresh)):
            if proc is not None:
                stop(sock)
                proc.wait(30)
        if b.poll() is None:
            b.kill()


def test_a_full_shared_memory_folder_refuses_a_base_instead_of_faulting(tmp_path, tmpfs):
    """Files mapped shared on a full filesystem fault (SIGBUS) when written: their bytes are
    allocated first, so a full folder raises, in one line naming the room asked for, and a
    base that does not fit is refused with the rank training on."""
    shm = tmpfs("shm", "256k")
    arena = SharedArena(str(shm))
    small = arena.empty((1000,), torch.float32)
    with pytest.raises(OSError, match=r"no room for 1\.0 MiB in .*--shm-size"):
        arena.empty((1 << 18,), torch.float32)
    assert [f.name for f in shm.iterdir()] == [os.path.basename(arena.spec(small)["file"])]
    sock = str(tmp_path / "keeper.sock")
    proc = start_keeper(sock, "--shm-dir", str(shm))
    try:
        rank = KeeperClient(sock, ME)
        why = base_stager.stage_base(rank, [_trained(n=100_000)], None, _record(5))
        assert "no room for" in why, why
        assert base_stager.offered_bases(rank).bases == {}
        assert rank.stats()["records"] == 0 and rank.lost is None  # the keeper serves on
    finally:
        stop(sock)
        proc.wait(30)


def test_a_base_over_the_cap_is_refused_and_leaves_no_file(tmp_path):
    sock, shm = str(tmp_path / "keeper.sock"), tmp_path / "shm"
    proc = start_keeper(sock, "--shm-dir", str(shm))  # 8 MiB
    try:
        rank = KeeperClient(sock, ME)
        why = base_stager.stage_base(rank, [_trained(n=400_000)], None, _record(5))
        assert "does not fit the cap" in why, why
        assert not list(shm.iterdir())
        assert base_stager.offered_bases(rank).bases == {}
        assert query(sock)["reserved"] == 0
    finally:
        stop(sock)
        proc.wait(30)


def test_a_base_of_an_attempt_the_restart_did_not_recover_to_is_dropped(tmp_path):
    """Base 10 staged, then the rank trains iteration 9 again (its restart recovered to 8):
    base 10 belongs to the abandoned attempt; base 5 stays."""
    sock, shm = str(tmp_path / "keeper.sock"), tmp_path / "shm"
    proc = start_keeper(sock, "--shm-dir", str(shm))
    try:
        rank = KeeperClient(sock, ME)
        for base in (5, 10):
            assert base_stager.stage_base(rank, [_trained(seed=base)], None, _record(base)) == ""
            if base == 5:
                rank.published(5)
        assert sorted(base_stager.offered_bases(rank).bases) == [5, 10]
        files = {f.name for f in shm.iterdir()}
        assert rank.put(record(9))
        assert sorted(base_stager.offered_bases(rank).bases) == [5]
        assert len(list(shm.iterdir())) == len(files) // 2
    finally:
        stop(sock)
        proc.wait(30)


class _TwoRanks:
    """Two threads as two ranks: ``all_reduce_min`` of each call across both."""

    def __init__(self):
        self._barrier = threading.Barrier(2)
        self._values: list[list[int]] = [[], []]

    def run(self, fn):
        out = [None, None]

        def rank(r):
            def all_reduce_min(values):
                self._values[r] = values
                self._barrier.wait()
                result = [min(a, b) for a, b in zip(*self._values, strict=True)]
                self._barrier.wait()
                return result

            out[r] = fn(r, all_reduce_min)

        threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return out


def _offer(*iterations: int) -> base_stager.OfferedBases:
    return base_stager.OfferedBases({i: ({}, _record(i)) for i in iterations})


@pytest.mark.parametrize(
    "held, storage, chain_end, loaded, expected",
    [
        # rank 1 died before staging 10: the published 5, which both hold
        (((5, 10), (5,)), 5, (12, 12), False, (5, 12)),
        (((5, 10), (5,)), 5, (12, 12), True, None),  # the loop loaded 5 already
        (((5, 10), (10,)), 5, (13, 12), True, (10, 12)),  # newer than storage's
        (((5, 10), (10,)), 5, (13, 9), False, None),  # rank 1's chain cannot reach 10
        (((10,), ()), 10, (12, 12), False, None),  # rank 1's keeper holds none
        (((10,), (10,)), 15, (17, 17), False, None),  # storage has a newer base
    ],
)
def test_the_ranks_agree_on_the_newest_base_every_keeper_holds(
    held, storage, chain_end, loaded, expected
):
    def agree(r, all_reduce_min):
        return base_stager.agree_on_kept_base(
            _offer(*held[r]), storage, chain_end[r], loaded, all_reduce_min
        )

    assert _TwoRanks().run(agree) == [expected, expected]


def _lowdiff_job(
    tmp_path: Path, total: int, *extra: str, model: tuple[str, ...] = ()
) -> tuple[list[str], Path, list[str]]:
    """The uninterrupted reference of ``total`` iterations; ``(model flags, the job's folder,
    its LowDiff flags)``: bases every 5, batches of 8, its end to ``tmp_path/resumed``."""
    common, _ = _keeper_job(tmp_path, total=total, full_interval=5, model=model)
    ckpt = tmp_path / "ckpt"
    diff = ["--diffckpt-mode", "lowdiff", "--diffckpt-batch-size", "8", "--save", str(ckpt)]
    diff += ["--load", str(ckpt), "--diffckpt-full-interval", "5", *extra]
    return common, ckpt, [*diff, "--dump-state", str(tmp_path / "resumed")]


def _covered(rank_dir: Path) -> set[int]:
    """The iterations a rank's diff-log segments hold (by their names)."""
    spans = [re.fullmatch(r"seg_(\d+)_(\d+)\.bin", f.name) for f in rank_dir.glob("seg_*")]
    return {i for m in spans if m for i in range(int(m[1]), int(m[2]) + 1)}


@pytest.mark.distributed
@pytest.mark.parametrize("kept", ["base", "replica", "base-moe-ep2"])
def test_ranks_killed_recover_from_the_keepers_without_reading_storage(tmp_path, kept):
    """Bases every 5 (synchronous), batches of 8: rank 1 dies after handing iteration 12 over.
    The restarted ranks take base 10 from their keepers (storage's is not read) and replay 11-12
    from the keepers' records, or with their replicas (``--diffckpt-keeper auto``) take 12 from
    their keepers' replicas (base 10 stepped with 11 and 12) and replay nothing; either way
    storage's log is made to reach 12, and the run ends equal to an uninterrupted one. The kept
    base also for a mixture of experts with two experts on each rank (``base-moe-ep2``)."""
    model = MOE_EP2 if kept.endswith("moe-ep2") else ()
    kept = kept.removesuffix("-moe-ep2")
    extra = (
        ["--diffckpt-option", "keeper_writes_log=false"]
        if kept == "replica"
        else list(KEPT_BASE_ONLY)
    )
    common, ckpt, diff = _lowdiff_job(tmp_path, 16, *extra, model=model)
    proc, lines = launch_node([*common, *diff], {"DIFFCKPT_FAILPOINT": "iteration-end:12@1"})
    log = finish_node(proc, lines)
    restart = log[log.index("failpoint iteration-end #12: SIGKILL of rank 1") :]
    served, replayed = {
        "base": (r"base of iteration 10 from the node's keeper in [\d.]+ s \(", 2),
        "replica": (r"iteration 12 from the replica in the node's keeper in [\d.]+ s \(nothing "
                    r"replayed; ", 0),
    }[kept]  # fmt: skip
    assert re.search(rf"recovery: {served}storage's newest base: 10, not read\)", restart), restart[
        -3000:
    ]
    assert "loaded checkpoint from" not in restart
    assert f"replayed {replayed} differential(s)" in restart
    assert re.search(r"recovered to iteration 12 in [\d.]+ s \(from the node keepers' memory", log)
    for rank_dir in (ckpt / "diffckpt").glob("rank_*"):  # 11-12 were the keepers' alone
        assert {11, 12} <= _covered(rank_dir), rank_dir.name
    _assert_ends_as_straight(tmp_path, 12)


def flip_a_byte_in_the_middle(path: Path) -> None:
    """Damage ``path`` as a memory fault would: one byte in its middle inverted, in place."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


DAMAGED = {  # the copy each job recovers from, and the line that refuses it once damaged
    "kept-base": r"the base of iteration 10 in the node's keeper is damaged",
    "lowdiff-replica": r"recovery: the replica of iteration 12 in the node's keeper is damaged",
    "lowdiff-plus-replica": r"recovery: the replica of iteration \d+ in the node's keeper is "
    r"damaged",
}


@pytest.mark.distributed
@pytest.mark.parametrize("copy", sorted(DAMAGED))
def test_a_copy_damaged_in_the_keepers_memory_is_refused_and_the_next_tier_serves(tmp_path, copy):
    """Bases every 5 under a keeper holding a kept base (LowDiff), LowDiff's replica, or
    LowDiff+'s replica: after iteration 12 both ranks are stopped, one byte is flipped in the
    middle of every file of the keeper's shared-memory folder, then the ranks are SIGKILLed.
    The restart finds the copy damaged (its checksum, written when it was made or by the
    keeper's last step), says so in one warning per rank and copy, recovers from the next
    tier (storage's base and diff log), and the run ends equal to an uninterrupted one."""
    if copy == "lowdiff-plus-replica":
        common, plus = _keeper_job(tmp_path, total=16, full_interval=5)
        args = [*common, *plus]
    else:
        options = ["--diffckpt-option", "keeper_writes_log=false"]
        common, _, diff = _lowdiff_job(
            tmp_path, 16, *(KEPT_BASE_ONLY if copy == "kept-base" else options)
        )
        args = [*common, *diff]
    proc, lines = launch_node(args)
    try:
        wait_logged(lines, 12, proc)
        shm = Path(shared_memory_root()) / Path(keeper_socket_in("".join(lines))).parent.name
        ranks = _ranks_of(psutil.Process(proc.pid))

        def damage() -> list[Path]:
            files = [f for f in shm.iterdir() if f.is_file() and f.stat().st_size >= 8]
            for f in files:
                flip_a_byte_in_the_middle(f)
            return files

        assert stopped_then_read(ranks, damage)
        TwoNodes.kill(ranks)
        log = finish_node(proc, lines)
    finally:
        kill_tree(proc)
    refused = re.findall(DAMAGED[copy], log)
    assert 1 <= len(refused) <= 2, log[-3000:]  # once per rank
    restart = log[log.index("is damaged") :]
    assert "nothing replayed" not in restart  # no replica served
    assert not re.search(r"recovery: base of iteration \d+ from", restart)  # nor a kept base
    assert "loaded checkpoint from" in restart  # storage's base instead
    (recovered,) = map(int, re.findall(r"\[rank0\] \S+ recovered to iteration (\d+)", log))
    _assert_ends_as_straight(tmp_path, recovered)


def test_the_keepers_replica_steps_each_differential_one_behind_as_a_replay_would(tmp_path):
    """LowDiff's replica in the keeper (``--diffckpt-option keeper_replica``): a kept base, stepped
    with each differential a rank hands over, one behind, equals the training state bit for
    bit; its recovery record carries every generator's state, those a differential left out
    included; a differential that does not follow it is refused."""
    train = _trained(steps=1)
    arena = SharedArena(str(tmp_path))
    replica_opt = replica_of(train, arena.copy, prefix="o0.")
    base_rng = {"rng.torch": torch.get_rng_state(), "rng.python": torch.arange(3)}
    base_record = encode_record(DiffRecord(1, {"scheduler_steps": 1}, base_rng))
    request = {"iteration": 1, "optimizers": describe([replica_opt], arena.spec)}
    hosted = HostedReplica({**request, "layout": [], "slots": []}, base_record, None)
    hosted.rng = dict(base_rng)
    capture, g = GradShardCapture(), torch.Generator().manual_seed(7)
    for it in (2, 3, 4):
        for p in train.param_groups[0]["params"]:
            p.grad = torch.randn(p.shape, generator=g)
        capture.on_ready_grads(0, train)
        train.step()
        moved = ({}, {"rng.torch": torch.full((4,), it, dtype=torch.uint8)})
        record = capture.build_record(it, it, 8 * it, moved)  # rng.python did not move
        hosted.take_differential(encode_record(record))
        assert hosted.merged == it - 1 and hosted.offer() == (it - 1, it)
    with pytest.raises(ValueError, match="expected 5"):
        hosted.take_differential(encode_record(_record(7)))
    assert hosted.settle(4) == [] and hosted.merged == 4
    _assert_same_optimizer(train, hosted.optimizers[0])
    (full,) = iter_records(io.BytesIO(hosted.record))
    assert full.iteration == 4 and full.scalars["consumed_samples"] == 32
    assert torch.equal(full.tensors["rng.python"], base_rng["rng.python"])  # carried over
    assert torch.equal(full.tensors["rng.torch"], torch.full((4,), 4, dtype=torch.uint8))


@pytest.mark.distributed
def test_a_base_the_keepers_hold_but_storage_never_published_is_recovered(tmp_path):
    """Asynchronous bases every 5: rank 1 dies right after its keeper acknowledged base 10, before
    storage published it. The restart finds storage's newest base older than the keepers' 10:
    it recovers 10 with nothing replayed and reads no base from storage, writes storage's log
    up to 10 (a later restart from storage alone gets there too), and ends equal to an
    uninterrupted run."""
    common, ckpt, diff = _lowdiff_job(tmp_path, 14, "--async-save", *KEPT_BASE_ONLY)
    proc, lines = launch_node([*common, *diff], {"DIFFCKPT_FAILPOINT": "base-kept:2@1"})
    log = finish_node(proc, lines)
    assert "failpoint base-kept #2: SIGKILL of rank 1" in log
    restart = log[log.index("failpoint base-kept") :]
    got = re.search(
        r"recovery: base of iteration (\d+) from the node's keeper in [\d.]+ s \(storage's "
        r"newest base: (\d+), not read\)",
        restart,
    )
    assert got is not None, restart[-3000:]
    # Base 10 is never published (the killed rank could not finish it); rank 0 staged it too
    # unless torchrun stopped it first (then both share the published base 5).
    kept, stored = int(got[1]), int(got[2])
    assert kept in (5, 10) and stored <= kept, (kept, stored)
    assert f"replayed {10 - kept} differential(s)" in restart
    assert "loaded checkpoint from" not in restart
    assert re.search(r"recovered to iteration 10 in", restart), restart[-3000:]
    # storage's log reaches 10 from its newest base: a restart from storage alone gets there too
    for rank_dir in (ckpt / "diffckpt").glob("rank_*"):
        assert set(range(stored + 1, 11)) <= _covered(rank_dir), rank_dir.name
    _assert_ends_as_straight(tmp_path, 10)


@pytest.mark.distributed
def test_top_k_residuals_come_back_from_the_keepers_base_as_from_storages(tmp_path):
    """The top-k exchange: a base holds every rank's error-feedback residuals, which no
    differential rebuilds. The same fault (rank 1 dies after handing iteration 12 over, bases
    every 5) recovered from the keepers' base 10, from their replicas at 12
    (``--diffckpt-option keeper_replica``: base 10's residuals) and from storage's base
    (``--diffckpt-option keeper_kept_bases=false``) ends in the same state, ``torch.equal``,
    and the same losses: the keeper gave back the residuals storage's base holds."""
    common, _ = _keeper_job(tmp_path, total=16, full_interval=5)
    ends = {}
    variants = {
        "keeper": list(KEPT_BASE_ONLY),
        "replica": ["--diffckpt-option", "keeper_writes_log=false"],
        "storage": ["--diffckpt-option", "keeper_kept_bases=false,keeper_writes_log=false"],
    }
    for name, extra in variants.items():
        ckpt = tmp_path / name
        diff = ["--diffckpt-mode", "lowdiff", "--diffckpt-compressor", "topk"]
        diff += ["--diffckpt-topk-ratio", "0.05", "--diffckpt-full-interval", "5"]
        diff += [
            "--save",
            str(ckpt),
            "--load",
            str(ckpt),
            "--dump-state",
            str(tmp_path / f"{name}-end"),
        ]
        proc, lines = launch_node(
            [*common, *diff, *extra], {"DIFFCKPT_FAILPOINT": "iteration-end:12@1"}
        )
        restart = finish_node(proc, lines).split("failpoint iteration-end #12")[1]
        from_keeper = "recovery: base of iteration 10 from the node's keeper" in restart
        assert from_keeper == (name == "keeper"), restart[-3000:]
        from_replica = "recovery: iteration 12 from the replica in the node's keeper" in restart
        assert from_replica == (name == "replica"), restart[-3000:]
        assert ("loaded checkpoint from" in restart) == (name == "storage")
        assert re.search(r"recovered to iteration 12 in", restart), restart[-3000:]
        ends[name] = load_dumps(tmp_path / f"{name}-end", 2)
    for rank in range(2):
        for name in ("keeper", "replica"):
            assert ends[name][rank]["losses"] == ends["storage"][rank]["losses"]
            assert_same_state(ends["storage"][rank], ends[name][rank], rank)


@pytest.mark.distributed
def test_a_node_lost_whole_recovers_its_lowdiff_replica_from_the_peers_copy(tmp_path):
    """One machine as two nodes (keepers in a ring), LowDiff's replicas in the keepers, bases
    every 5: each keeper sends its replicas to the next node's keeper, then every differential
    it stepped them with. After iteration 12 node 1 is lost whole (its rank stopped first, so
    that its keeper's last steps reach node 0, then launcher, keeper, agent and rank SIGKILLed)
    and started again with a fresh keeper, which adopts node 0's copy of its rank's replica:
    both ranks recover the same iteration from replicas (nothing replayed, no base read), and
    the run ends equal to an uninterrupted one."""
    text, acked = _node_1_lost_whole(
        tmp_path,
        ["--diffckpt-option", "keeper_writes_log=false"],
        lambda held: [c["system"] for c in held["copies"]] == ["LowDiff"],
        lambda sock: replicas_acknowledged([sock], 2, copies=True),
    )
    adopted = re.findall(
        r"keeper: adopted the replica of (rank_\S+) at iteration (\d+).* from the keeper of "
        r"node 0 \(a peer\)",
        text,
    )
    assert len(adopted) == 1, text[-4000:]
    got = re.search(
        r"\[rank0\] \S+ recovery: iteration (\d+) from the replica in (.*?) in [\d.]+ s "
        r"\(nothing replayed; storage's newest base: (\d+), not read\)",
        text,
    )
    assert got is not None, text[-4000:]
    assert got[2] in ("the node's keeper", "the keeper of node 0 (a peer)"), got[0]
    assert int(got[1]) >= acked >= 11, (got[0], acked)  # nothing node 0's keeper held is lost
    assert int(got[1]) - int(adopted[0][1]) in (0, 1), (got[0], adopted)
    assert "replayed 0 differential(s)" in text and "loaded checkpoint from" not in text
    _assert_ends_as_straight(tmp_path, int(got[1]))


@pytest.mark.distributed
@pytest.mark.parametrize("swap", [False, True], ids=["same-seats", "ranks-swap-nodes"])
def test_a_node_lost_whole_recovers_its_lowdiff_base_from_the_peers_copy(tmp_path, swap):
    """One machine as two nodes (keepers in a ring), LowDiff with kept bases every 5 (no
    replica): each keeper sends its ranks' bases and differentials to the next node's keeper.
    After iteration 12 node 1 is lost whole (its rank stopped first, then launcher, keeper,
    agent and rank SIGKILLed once node 0's keeper holds its copy of base 10) and started again
    with a fresh keeper: both ranks recover from the keepers' base 10 (no base read from
    storage), replay the differentials after it, and the run ends equal to an uninterrupted
    one. In its seat, node 1's keeper adopts node 0's copy of its rank's base (and chain).
    Seated first (``swap``), node 1 runs rank 0, whose base (and chain) node 0's keeper hands
    over, and node 0 runs rank 1, whose copies its keeper serves as its own."""
    text, acked = _node_1_lost_whole(
        tmp_path,
        list(KEPT_BASE_ONLY),
        lambda held: any(b["copy"] and b["iteration"] == 10 for b in held["bases"]),
        lambda sock: chains_acknowledged([sock], 2),
        returns_as="127.0.0.1" if swap else None,
    )
    adopted = re.findall(
        r"keeper: adopted the base of (rank_\S+) at iteration (\d+) from (.*)", text
    )
    peer = "the keeper of node 0 (a peer)"
    if swap:  # rank 0 from node 0's own base, rank 1 from node 0's copy of node 1's
        expected = {
            ("rank_0_0_0", peer),
            ("rank_0_0_1", "the node's keeper (its copy of node 1's)"),
        }
        assert {(r, w) for r, _, w in adopted} == expected, adopted
    else:
        assert {(r, w) for r, _, w in adopted} == {("rank_0_0_1", peer)}, adopted
    assert max(int(i) for _, i, _ in adopted) == 10, adopted
    got = re.search(
        r"\[rank0\] \S+ recovery: base of iteration 10 from (.*?) in [\d.]+ s \(storage's "
        r"newest base: (\d+), not read\)",
        text,
    )
    assert got is not None, text[-4000:]
    assert got[1] == (peer if swap else "the node's keeper"), got[0]
    assert "loaded checkpoint from" not in text  # no rank read a base from storage
    recovered = int(re.search(r"recovered to iteration (\d+)", text)[1])
    assert recovered >= acked >= 11, (recovered, acked)  # nothing node 0's keeper held is lost
    _assert_ends_as_straight(tmp_path, recovered)


@pytest.mark.distributed
def test_a_ring_copy_damaged_in_memory_is_refused_and_storage_serves(tmp_path):
    """As above, but before node 1 is lost one byte is flipped in the middle of every copy
    node 0's keeper received from node 1's (its ``in-*`` files): node 1's fresh keeper adopts
    the copy of base 10 with the checksums it was made with, its rank finds it damaged and
    says so, the ranks load storage's base instead, and the run ends equal to an uninterrupted
    one."""

    def damage(shm: Path) -> None:
        received = [f for f in shm.glob("in-*") if f.stat().st_size >= 8]
        assert received, sorted(shm.iterdir())
        for f in received:
            flip_a_byte_in_the_middle(f)

    text, _ = _node_1_lost_whole(
        tmp_path,
        list(KEPT_BASE_ONLY),
        lambda held: any(b["copy"] and b["iteration"] == 10 for b in held["bases"]),
        lambda sock: chains_acknowledged([sock], 2),
        damage,
    )
    assert re.search(
        r"keeper: the base of iteration 10 in the keeper of node 0 \(a peer\) is damaged", text
    ), text[-4000:]
    assert "recovery: base of iteration 10 from" not in text  # no rank used a kept base
    assert "loaded checkpoint from" in text
    recovered = int(re.findall(r"\[rank0\] \S+ recovered to iteration (\d+)", text)[-1])
    _assert_ends_as_straight(tmp_path, recovered)


def _node_1_lost_whole(
    tmp_path: Path,
    flags: list[str],
    copied: Callable[[dict], bool],
    acknowledged: Callable[[str], int],
    damage: Callable[[Path], None] = lambda _shm: None,
    returns_as: str | None = None,
) -> tuple[str, int]:
    """LowDiff on one machine as two nodes (keepers in a ring), bases every 5, with ``flags``:
    after iteration 12 node 1's rank is stopped (its keeper's last copies go out), and once
    node 0's keeper holds what ``copied`` (of its stats) asks, ``damage(node 0's keeper's
    shared-memory folder)`` runs and node 1 is lost whole (launcher, keeper, agent, rank
    SIGKILLed) and started again with a fresh keeper (at the address ``returns_as``:
    ``"127.0.0.1"`` seats it first, and the ranks swap nodes). The log of the job, which ran
    to its end, and what ``acknowledged(node 0's keeper's socket)`` read just before node 1
    died."""
    common, _ = _keeper_job(tmp_path, total=24, full_interval=5)
    ckpt = tmp_path / "ckpt"
    diff = ["--diffckpt-mode", "lowdiff", "--save", str(ckpt), "--load", str(ckpt)]
    diff += ["--diffckpt-full-interval", "5", "--dump-state", str(tmp_path / "resumed"), *flags]
    with TwoNodes(tmp_path, [*common, *diff]) as job:
        job.logged(12)

        def read() -> int:
            _wait_for(lambda: copied(query(job.keeper_socket(0))), "node 1's copies at node 0")
            return acknowledged(job.keeper_socket(0))

        acked = stopped_then_read(_ranks_of(psutil.Process(job.nodes[1].pid)), read)
        damage(Path(shared_memory_root()) / Path(job.keeper_socket(0)).parent.name)
        job.restart_node(1, returns_as)
        job.wait()
        return job.text(), acked
