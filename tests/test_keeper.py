"""The node's keeper: what it holds and drops, that it outlives a SIGKILLed client, and a real
training job whose ranks torchrun restarts after a SIGKILL: they recover what storage had not
made durable from the keeper, and the run ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from launch import (
    KEPT_BASE_ONLY,
    LAUNCH,
    REPO,
    RUN_TIMEOUT_S,
    TINY_GPT,
    assert_same_state,
    load_dumps,
    run_cli,
    run_gpt,
)

from megatron_diffckpt import recovery
from megatron_diffckpt.keeper.client import KeeperClient, query, stop
from megatron_diffckpt.keeper.server import KeeperState
from megatron_diffckpt.keeper.shm import OWNER
from megatron_diffckpt.keeper.wire import FRAME, recv, send
from megatron_diffckpt.out_of_space import StorageFullError
from megatron_diffckpt.storage.format import DiffRecord, SegmentIdentity, encode_record
from megatron_diffckpt.storage.reader import RankLogScan, scan_rank_log

ME = SegmentIdentity("run", 0, 0, 1, "layout")
ME_DICT = {"run_id": "run", "tp_rank": 0, "pp_rank": 0, "dp_rank": 1, "layout_hash": "layout"}


def record(iteration: int, n: int = 16) -> DiffRecord:
    g = torch.Generator().manual_seed(iteration)
    return DiffRecord(
        iteration, {"skipped": False}, {"o0.g0.p0:dense": torch.randn(n, generator=g)}
    )


def held(state: KeeperState, after: int) -> list[int]:
    return [i for i, _ in state.chain(ME_DICT, after)]


def test_state_holds_a_consecutive_chain_and_drops_what_a_base_covers():
    state = KeeperState(memory=1 << 20)
    for i in range(1, 6):
        assert state.put(ME_DICT, i, encode_record(record(i)))[0]
    assert held(state, 0) == [1, 2, 3, 4, 5]
    assert held(state, 3) == [4, 5]
    assert held(state, 7) == []  # the chain does not reach there
    state.published(ME_DICT, 3)
    assert held(state, 0) == []  # iteration 1 is gone: no chain from the base before it
    assert held(state, 3) == [4, 5]
    assert not state.put(ME_DICT, 2, encode_record(record(2)))[0]  # before the published base
    # A restarted attempt that resumed at 4 replaces the tail; one after a gap starts anew.
    assert state.put(ME_DICT, 5, encode_record(record(50)))[0]
    assert held(state, 3) == [4, 5]
    assert state.chain(ME_DICT, 4)[0][1] == encode_record(record(50))
    assert state.put(ME_DICT, 9, encode_record(record(9)))[0]
    assert held(state, 3) == [] and held(state, 8) == [9]
    assert state.stats()["records"] == 1
    other = dict(ME_DICT, layout_hash="another")
    assert state.chain(other, 8) == []  # never served to another layout


def test_state_evicts_the_oldest_of_the_longest_chain_and_refuses_what_cannot_fit():
    one = len(encode_record(record(1)))
    state = KeeperState(memory=4 * one)
    other = dict(ME_DICT, dp_rank=0)
    for i in range(1, 4):
        state.put(ME_DICT, i, encode_record(record(i)))
    state.put(other, 1, encode_record(record(1)))
    assert state.put(ME_DICT, 4, encode_record(record(4)))[0]
    assert held(state, 1) == [2, 3, 4] and state.nbytes <= state.memory
    assert [i for i, _ in state.chain(other, 0)] == [1]
    assert state.stats()["evicted"] == 1
    ok, why = state.put(ME_DICT, 5, encode_record(record(5, n=4 * one)))
    assert not ok and "exceeds the cap" in why


def start_keeper(sock: str, *extra: str) -> subprocess.Popen:
    """A keeper process on ``sock`` (8 MiB), once it answers (a file left at ``sock`` by a keeper
    that died is there before the new one listens)."""
    cmd = [sys.executable, "-m", "megatron_diffckpt.keeper", "--socket", sock]
    proc = subprocess.Popen([*cmd, "--memory-mib", "8", *extra], cwd=REPO, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        try:
            query(sock)
            return proc
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.05)


@pytest.fixture
def keeper(tmp_path):
    sock = str(tmp_path / "keeper.sock")
    proc = start_keeper(sock)
    yield sock
    try:
        stop(sock)
    except OSError:
        pass  # the test stopped it
    proc.wait(30)


def test_a_keeper_removes_the_shared_memory_folders_of_keepers_that_died(tmp_path):
    """A keeper SIGKILLed (with its launcher: a node lost whole) leaves its shared-memory folder
    behind; the next keeper started beside it removes it, and only it: not a live keeper's, not
    one without an owner, not another name."""
    dead = start_keeper(
        str(tmp_path / "dead.sock"), "--shm-dir", str(tmp_path / "diffckpt-keeper-a")
    )
    (tmp_path / "diffckpt-keeper-a" / "replica").write_bytes(b"x" * 4096)
    dead.send_signal(signal.SIGKILL)
    dead.wait(30)
    alive = start_keeper(
        str(tmp_path / "alive.sock"), "--shm-dir", str(tmp_path / "diffckpt-keeper-b")
    )
    (tmp_path / "diffckpt-keeper-c").mkdir()  # no owner: left alone
    (tmp_path / "other").mkdir()
    (tmp_path / f"other{OWNER}").write_text("1 0.0")  # not a keeper's name: left alone
    fresh = start_keeper(
        str(tmp_path / "fresh.sock"), "--shm-dir", str(tmp_path / "diffckpt-keeper-d")
    )
    try:
        names = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
        assert names == ["diffckpt-keeper-b", "diffckpt-keeper-c", "diffckpt-keeper-d", "other"]
        assert (tmp_path / f"diffckpt-keeper-d{OWNER}").read_text().split()[0] == str(fresh.pid)
        assert not (tmp_path / f"diffckpt-keeper-a{OWNER}").exists()
    finally:
        for sock, proc in (("alive.sock", alive), ("fresh.sock", fresh)):
            stop(str(tmp_path / sock))
            proc.wait(30)


def test_a_keeper_does_not_import_what_it_never_uses(tmp_path):
    """A keeper, started and stopped as the launcher does, never imports PyTorch DCP (with
    sympy and DTensor behind it: about 45 MB of every keeper's memory and a second of its start)
    nor megatron: it saves no base and builds no model. Read from the real process's
    ``-X importtime`` report."""
    sock, report = str(tmp_path / "keeper.sock"), tmp_path / "imports.txt"
    cmd = [sys.executable, "-X", "importtime", "-m", "megatron_diffckpt.keeper", "--socket", sock]
    with open(report, "w") as err:
        proc = subprocess.Popen([*cmd, "--memory-mib", "8"], cwd=REPO, stderr=err)
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):
            assert proc.poll() is None and time.monotonic() < deadline, report.read_text()
            time.sleep(0.05)
        assert query(sock)["ranks"] == 0
        stop(sock)
        assert proc.wait(30) == 0
    lines = report.read_text().splitlines()
    imported = {line.split("|")[-1].strip() for line in lines if line.startswith("import time:")}
    assert "megatron_diffckpt.keeper.replicas" in imported and "torch" in imported
    unused = ("torch.distributed.checkpoint", "torch.distributed.tensor", "sympy", "megatron")
    assert not [name for name in unused if name in imported]
    assert "keeper: stopped after" in lines[-1]


def test_a_socket_in_use_is_refused_in_one_line_and_a_dead_keepers_is_taken_over(tmp_path):
    """A second keeper on a live keeper's socket exits 2 with one line, and the live one serves
    on; once that keeper is SIGKILLed (its socket file stays), a new keeper takes the path."""
    sock = str(tmp_path / "keeper.sock")
    first = start_keeper(sock)
    cmd = [sys.executable, "-m", "megatron_diffckpt.keeper", "--socket", sock, "--memory-mib", "8"]
    second = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert second.returncode == 2
    assert second.stderr.splitlines()[-1] == f"[keeper] keeper: a keeper already listens on {sock}"
    assert "Traceback" not in second.stderr
    assert query(sock)["ranks"] == 0  # the first one serves on
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    assert os.path.exists(sock)
    third = start_keeper(sock)
    try:
        assert query(sock)["ranks"] == 0
    finally:
        stop(sock)
        third.wait(30)
    assert f"removed {sock}, left by a keeper that died" in third.stderr.read().decode()


def test_a_message_frames_a_payload_past_4_gib():
    """A replica or base of a large model's shard (12 bytes per parameter) goes to a peer in one
    message: its frame counts the payload in 64 bits."""
    n, p = FRAME.unpack(FRAME.pack(123, 5 << 30))
    assert (n, p) == (123, 5 << 30)


def test_an_unknown_request_is_answered_and_the_connection_serves_on(keeper):
    client = KeeperClient(keeper, ME)
    assert client.call({"op": "no-such-request"})[0] == {
        "error": "unknown request 'no-such-request'"
    }
    assert client.stats()["ranks"] == 0 and client.lost is None
    client.close()


def test_what_a_killed_client_handed_over_is_served_back_exactly(keeper, tmp_path):
    script = textwrap.dedent(
        f"""
        import os, signal, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_keeper import ME, record
        from megatron_diffckpt.keeper.client import KeeperClient
        client = KeeperClient({keeper!r}, ME)
        for i in range(1, 8):
            assert client.put(record(i))
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    client = KeeperClient(keeper, ME)
    chain = client.chain(2)
    assert [r.iteration for r in chain] == [3, 4, 5, 6, 7]
    for r in chain:
        assert torch.equal(
            r.tensors["o0.g0.p0:dense"], record(r.iteration).tensors["o0.g0.p0:dense"]
        )
    client.published(5)
    assert [r.iteration for r in client.chain(5)] == [6, 7]
    assert client.stats()["records"] == 2
    shown = run_cli("inspect", str(tmp_path), "--keeper", keeper).stdout
    assert f"keeper {keeper}: 2 record(s) of 1 rank(s)" in shown
    assert "rank_0_1_1: iterations 6-7" not in shown and "rank_0_0_1: iterations 6-7" in shown
    stats = stop(keeper)
    assert stats["records"] == 2
    assert client.put(record(8)) is False  # refused while it stops, or it is gone already
    deadline = time.monotonic() + 30
    while os.path.exists(keeper):  # removed once it stopped
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client.put(record(8)) is False and client.lost  # gone: storage only


def _wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_node_lost_whole_recovers_from_the_peer_keepers_copy(tmp_path):
    """Two keepers in a ring (nodes 0 and 1 on loopback): node 1's records are copied to node
    0's keeper; node 1's keeper is SIGKILLed, a fresh one serves its ranks node 0's copy, bit
    for bit; a base published through the fresh one reaches the copy; a peer request without
    the receiver's token is refused."""
    peers = str(tmp_path / "peers")
    ring = ["--peers", peers, "--nnodes", "2", "--host", "127.0.0.1"]
    a = start_keeper(str(tmp_path / "a.sock"), *ring, "--node", "0")
    b = start_keeper(str(tmp_path / "b.sock"), *ring, "--node", "1")
    other = SegmentIdentity("run", 0, 0, 0, "layout")
    try:
        on_b, on_a = (
            KeeperClient(str(tmp_path / "b.sock"), ME),
            KeeperClient(str(tmp_path / "a.sock"), other),
        )
        for i in range(1, 8):
            assert on_b.put(record(i))
        for i in range(1, 4):
            assert on_a.put(record(i))

        def copied(path, rank, last):
            chains = query(path)["chains"]
            return any(c["dp_rank"] == rank and c.get("peer_last") == last for c in chains)

        _wait_for(lambda: copied(str(tmp_path / "b.sock"), 1, 7), "node 1's copy at node 0")
        _wait_for(lambda: copied(str(tmp_path / "a.sock"), 0, 3), "node 0's copy at node 1")
        b.send_signal(signal.SIGKILL)
        b.wait(30)
        fresh = start_keeper(str(tmp_path / "b2.sock"), *ring, "--node", "1")
        try:
            client = KeeperClient(str(tmp_path / "b2.sock"), ME)
            chain = client.chain(2)
            assert [r.iteration for r in chain] == [3, 4, 5, 6, 7]
            assert client.served_by == "the keeper of node 0 (a peer)"
            for r in chain:
                expected = record(r.iteration).tensors["o0.g0.p0:dense"]
                assert torch.equal(r.tensors["o0.g0.p0:dense"], expected)
            client.published(5)
            _wait_for(
                lambda: [c["first"] for c in query(str(tmp_path / "a.sock"))["chains"]
                         if c["dp_rank"] == 1] == [6],
                "the published base at the copy",
            )  # fmt: skip
            assert [r.iteration for r in on_a.chain(0)] == [1, 2, 3]  # its own, untouched
        finally:
            stop(str(tmp_path / "b2.sock"))
            fresh.wait(30)
        doc = json.loads((tmp_path / "peers" / "keeper_0.json").read_text())
        with socket.create_connection((doc["host"], doc["port"]), timeout=30) as sock:
            send(sock, {"op": "chain", "identity": ME_DICT, "after": 0, "token": "guess"})
            assert "token" in recv(sock)[0]["error"]
    finally:
        stop(str(tmp_path / "a.sock"))
        a.wait(30)
        if b.poll() is None:
            b.kill()


def test_join_tiers_extends_storage_and_fill_log_makes_storage_reach_as_far(tmp_path):
    rank_dir = str(tmp_path / ME.dirname())
    recovery.fill_log(rank_dir, ME, "identity", [record(i) for i in (1, 2, 3)])
    scan = scan_rank_log(rank_dir, ME, 0)
    assert scan.last_iteration == 3
    chain = recovery.join_tiers(scan, [record(i) for i in (2, 3, 4, 5, 7)])
    assert [r.iteration for r in chain.records] == [1, 2, 3, 4, 5]
    assert chain.served(5) == "1-3 from the diff log, 4-5 from the node's keeper"
    assert chain.served(2) == "1-2 from the diff log"
    assert recovery.join_tiers(RankLogScan(0), [record(2)]).last_iteration == 0  # a gap
    recovery.fill_log(rank_dir, ME, "identity", chain.records[3:])
    again = scan_rank_log(rank_dir, ME, 0)
    assert [r.iteration for r in again.records] == [1, 2, 3, 4, 5] and not again.problems
    assert torch.equal(
        again.records[4].tensors["o0.g0.p0:dense"], record(5).tensors["o0.g0.p0:dense"]
    )


def test_fill_log_on_a_full_filesystem_stops_in_one_line_and_leaves_nothing(tmpfs):
    rank_dir = tmpfs("full", "64k") / ME.dirname()
    with pytest.raises(StorageFullError, match="no room for iterations 1-2, recovered from"):
        recovery.fill_log(str(rank_dir), ME, "identity", [record(i, n=1 << 14) for i in (1, 2)])
    assert not any(rank_dir.iterdir())


PRETRAIN_GPT = REPO / "examples" / "gpt" / "pretrain_gpt.py"


def _ranks_of(launcher: psutil.Process) -> list[psutil.Process]:
    """The training processes below ``launcher``: RANK set, their parent's not."""
    found = []
    for p in launcher.children(recursive=True):
        try:
            if "RANK" in p.environ() and "RANK" not in p.parent().environ():
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
            continue
    return found


def keeper_socket_in(log: str) -> str:
    """The socket of the newest keeper a node launcher's ``log`` started."""
    return re.findall(r"keeper: listening on (\S+), memory cap", log)[-1]


def stopped_then_read(ranks: list[psutil.Process], read: Callable[[], Any]) -> Any:
    """SIGSTOP ``ranks``, give the keepers a second to take in what had reached them, then
    ``read()`` (what the keepers acknowledged: a SIGKILL of the ranks now may lose none of it).
    Rank 0's log line of iteration ``t`` does not say every rank's keeper has ``t``: another
    rank may not have handed it over yet (LowDiff+'s hand-over is a background thread's)."""
    for rank in ranks:
        rank.send_signal(signal.SIGSTOP)
    time.sleep(1.0)
    return read()


def replicas_acknowledged(sockets: list[str], rows: int, copies: bool = False) -> int:
    """The newest iteration every replica in these keepers (``rows`` of them) can be
    recovered to: its held input, else what it merged. The ranks' own replicas; with
    ``copies``, the ring's copies too."""
    tables = ("replicas", "copies") if copies else ("replicas",)
    found = [r for s in sockets for t in tables for r in query(s)[t]]
    assert len(found) == rows, found
    return min(r["merged"] if r["held"] is None else r["held"] for r in found)


def chains_acknowledged(sockets: list[str], ranks: int) -> int:
    """The newest iteration every one of ``ranks`` ranks' LowDiff differentials reach in these
    keepers (each rank's newest in any of them: its own keeper's, or a peer's copy)."""
    last: dict[tuple, int] = {}
    for s in sockets:
        for c in query(s)["chains"]:
            key = (c["tp_rank"], c["pp_rank"], c["dp_rank"])
            last[key] = max(last.get(key, -1), c["last"])
    assert len(last) == ranks, last
    return min(last.values())


@pytest.mark.distributed
@pytest.mark.parametrize("writes_log", [False, True], ids=["ranks_write", "keeper_writes"])
def test_ranks_restarted_by_torchrun_recover_from_the_keeper_exactly(tmp_path, writes_log):
    """Batches of 8 iterations: when the ranks die after iteration 11, storage holds 1-8 and the
    keeper the rest (read with the ranks stopped, before the kill); the restarted ranks recover
    to no less than every rank's keeper acknowledged, and the run ends equal to an
    uninterrupted one (``torch.equal``). With ``--diffckpt-option keeper_writes_log`` the keeper
    writes the log, and the part batch of each killed rank as its connection ends: storage
    alone then serves the whole recovery."""
    total, kill_after = 16, 11
    ckpt, common, diff = _straight_run_and_flags(tmp_path, total, batch=8)
    diff += ["--diffckpt-option", "keeper_writes_log=true"] if writes_log else []
    cmd = [str(LAUNCH), "--keeper-memory", "64", "--standalone"]
    cmd += ["--nproc-per-node", "2", "--max-restarts", "1", str(PRETRAIN_GPT), *common, *diff]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    reached = threading.Event()

    def follow():
        for line in proc.stdout:
            lines.append(line)
            if re.search(rf"iteration +{kill_after}/", line):
                reached.set()

    threading.Thread(target=follow, daemon=True).start()
    try:
        assert reached.wait(RUN_TIMEOUT_S), "".join(lines[-40:])
        launcher = psutil.Process(proc.pid)
        victims = _ranks_of(launcher)
        assert len(victims) == 2, victims
        sock = keeper_socket_in("".join(lines))
        acked = stopped_then_read(victims, lambda: chains_acknowledged([sock], 2))
        for p in victims:
            p.send_signal(signal.SIGKILL)
        assert proc.wait(RUN_TIMEOUT_S) == 0, "".join(lines[-60:])
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.2)  # the reader thread takes the last lines
    log = "".join(lines)
    segments = sorted(p.name for p in (ckpt / "diffckpt").glob("rank_*/seg_*"))
    assert any("seg_0000000001_0000000008" in s for s in segments), segments
    kept = [int(k) for k in re.findall(r"its keeper (\d+) in", log)]  # rank 0 logs
    assert len(kept) == 1, log[-4000:]
    recovered = int(re.search(r"recovered to iteration (\d+)", log)[1])
    # nothing the keepers acknowledged is lost, though storage held 8
    assert 9 <= acked <= recovered <= kept[0], (acked, recovered, kept)
    if writes_log:
        assert log.count("keeper: writes the diff log of rank_0_0_") == 4  # 2 ranks, 2 attempts
        assert f"1-{recovered} from the diff log" in log, log[-4000:]
        assert "this rank writes it" not in log  # no take-over
    else:
        assert f"1-8 from the diff log, 9-{recovered} from the node's keeper" in log
    # storage now reaches the recovered iteration too, and the run ended exactly as straight
    for rank_dir in (ckpt / "diffckpt").glob("rank_*"):
        assert (rank_dir / f"seg_0000000009_{recovered:010d}.bin").exists()
    _assert_ends_as_straight(tmp_path, recovered)
    assert "keeper: stopped after" in log


@pytest.mark.distributed
def test_two_nodes_recover_by_tiers_ranks_then_a_node_then_everything(tmp_path):
    """One machine as two nodes: two node launchers (``--nnodes 2``, c10d rendezvous on
    loopback, hosted by node 0; one rank each, node 0's first), each with its keeper, in a
    ring. Batches larger than the run: storage holds only
    the base at 0 and what recoveries write back, so every tier's part is exact. Three faults,
    each by SIGKILL:

    1. after iteration 11, both ranks only: torchrun restarts them, they recover 1-T1 from their
       nodes' keepers (and write them back to storage);
    2. after iteration 21, node 1 whole (launcher, keeper, torchrun's agent, rank), started
       again with a fresh, empty keeper: node 0's rank recovers T1+1-T2 from its keeper, node
       1's from node 0's copy; both write them back;
    3. after iteration 31, everything, both nodes started again: fresh keepers hold nothing,
       recovery comes from storage alone, exactly to T2.

    The run ends equal to an uninterrupted one (``torch.equal``, state and losses)."""
    ckpt, common, diff = _straight_run_and_flags(tmp_path, total=40, batch=1000)
    with TwoNodes(tmp_path, [*common, *diff]) as job:
        # What node 0's keeper holds of both ranks (its own, and its copy of node 1's) when
        # node 1 dies: none of it may be lost.
        acked, held = job.three_faults(
            lambda: chains_acknowledged([job.keeper_socket(0), job.keeper_socket(1)], 2),
            lambda: chains_acknowledged([job.keeper_socket(0)], 2),
        )
        text = job.text()
    # Rank 0 logs the recoveries: in time order.
    found = re.findall(
        r"\[rank0\] (\d\d:\d\d:\d\d) recovery: base at iteration 0, \d+ differential\(s\) to "
        r"replay, recovering to iteration (\d+) \(.*?\): (.*)",
        text,
    )
    (t1, served1), (t2, served2), (t3, served3) = [(int(t), s) for _, t, s in sorted(found)]
    assert t1 >= acked >= 1 and served1 == f"1-{t1} from the node's keeper", (found, acked)
    mine, peer = "the node's keeper", "the keeper of node 0 (a peer)"
    assert t2 >= max(held, t1 + 1) and served2.split(", ")[-1] in (
        f"{t1 + 1}-{t2} from {mine}",
        f"{t1 + 1}-{t2} from {peer}",
    ), found
    assert t3 == t2 and served3 == f"1-{t2} from the diff log", found  # storage alone
    for rank_dir in ("rank_0_0_0", "rank_0_0_1"):  # what each recovery wrote back
        written = sorted(p.name for p in (ckpt / "diffckpt" / rank_dir).glob("seg_*"))
        assert written[:2] == [f"seg_0000000001_{t1:010d}.bin", f"seg_{t1 + 1:010d}_{t2:010d}.bin"]
    _assert_ends_as_straight(tmp_path, t3)


class TwoNodes:
    """One machine as two nodes: two node launchers (``--nnodes 2``, c10d rendezvous on
    loopback, hosted by node 0; one rank each), each with its keeper, in a ring, running
    ``args``; torchrun restarts ranks up to 3 times. A context manager: whatever is left runs
    is killed at its end.

    torchrun's rendezvous seats the nodes in the order of their ``--local-addr`` (then of their
    agents' process ids), not by ``--node-rank``: each node has an address of its own on the
    loopback (``addrs``), so that node 0 runs rank 0 until a test restarts a node under
    another address (:meth:`restart_node`)."""

    def __init__(self, tmp_path: Path, args: list[str]):
        self.tmp_path, self.args = tmp_path, args
        self.addrs = ["127.0.0.2", "127.0.0.3"]
        self.env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        self.env["DIFFCKPT_KEEPER_HOST"] = "127.0.0.1"
        self.port = _free_port()
        self.logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
        self.nodes: list[subprocess.Popen] = []
        self.lost_at: list[int] = []  # each log's length when everything was lost

    def __enter__(self) -> TwoNodes:
        self.nodes = self._started(self._node(0))
        return self

    def __exit__(self, *exc) -> None:
        for n in self.nodes:
            if n.poll() is None:
                n.kill()

    def _node(self, rank: int) -> subprocess.Popen:
        cmd = [str(LAUNCH), "--keeper-memory", "64", "--keeper-peers", str(self.tmp_path / "peers")]
        cmd += ["--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1"]
        cmd += ["--local-addr", self.addrs[rank]]
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}"]
        cmd += ["--rdzv-id", "two-nodes", "--max-restarts", "3", str(PRETRAIN_GPT)]
        with open(self.logs[rank], "a") as out:
            return subprocess.Popen([*cmd, *self.args], cwd=REPO, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT)  # fmt: skip

    def _started(self, first: subprocess.Popen) -> list[subprocess.Popen]:
        """Node 0, then node 1 once node 0's agent serves the rendezvous: the node that hosts
        torchrun's rendezvous store is the one a job cannot lose (torchrun's limit)."""
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return [first, self._node(1)]
            except OSError:
                assert time.monotonic() < deadline and first.poll() is None, self.text()[-3000:]
                time.sleep(0.1)

    def text(self) -> str:
        return "".join(log.read_text() for log in self.logs if log.exists())

    def before_all_lost(self) -> str:
        """Both logs up to :meth:`restart_all` (whichever node each rank ran on)."""
        return "".join(log.read_text()[:n] for log, n in zip(self.logs, self.lost_at, strict=True))

    def since_all_lost(self) -> str:
        """Both logs after :meth:`restart_all`."""
        return "".join(log.read_text()[n:] for log, n in zip(self.logs, self.lost_at, strict=True))

    def logged(self, iteration: int) -> None:
        """Wait until some rank logged ``iteration``."""
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while f" {iteration}/" not in self.text():
            alive = all(n.poll() is None for n in self.nodes)
            assert time.monotonic() < deadline and alive, self.text()[-4000:]
            time.sleep(0.05)

    def keeper_socket(self, rank: int) -> str:
        """The socket of node ``rank``'s keeper (its newest)."""
        return keeper_socket_in(self.logs[rank].read_text())

    def ranks(self) -> list[psutil.Process]:
        return [r for n in self.nodes for r in _ranks_of(psutil.Process(n.pid))]

    @staticmethod
    def kill(processes: list[psutil.Process]) -> None:
        for p in processes:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass

    def _whole(self, rank: int) -> list[psutil.Process]:
        top = psutil.Process(self.nodes[rank].pid)
        return [*top.children(recursive=True), top]

    def restart_node(self, rank: int, addr: str | None = None) -> None:
        """SIGKILL node ``rank`` whole (launcher, keeper, agent, rank), then start it again
        (with a fresh, empty keeper; under ``addr``, if given)."""
        self.addrs[rank] = addr or self.addrs[rank]
        self.kill(self._whole(rank))
        self.nodes[rank].wait(30)
        self.nodes[rank] = self._node(rank)

    def restart_all(self) -> None:
        """SIGKILL everything, then start both nodes again (:meth:`before_all_lost` and
        :meth:`since_all_lost` split the logs there)."""
        self.kill([p for rank in range(2) for p in self._whole(rank)])
        for n in self.nodes:
            n.wait(30)
        self.lost_at = [len(log.read_text()) for log in self.logs]
        self.nodes = self._started(self._node(0))

    def wait(self) -> None:
        for n in self.nodes:
            assert n.wait(RUN_TIMEOUT_S) == 0, self.text()[-4000:]

    def three_faults(
        self,
        before_ranks_lost: Callable[[], Any] = lambda: None,
        before_node_loss: Callable[[], Any] = lambda: None,
        node_returns_as: str | None = None,
    ) -> tuple[Any, Any]:
        """Three faults, each by SIGKILL, then the job's end: after iteration 11 both ranks
        (torchrun restarts them); after 21 node 1 whole, started again with a fresh keeper;
        after 31 everything, both nodes started again. ``before_ranks_lost()`` runs with both
        ranks stopped (:func:`stopped_then_read`), ``before_node_loss()`` before node 1 dies:
        their results are returned. ``node_returns_as``: node 1's address when it comes back
        (``"127.0.0.1"`` seats it first: the ranks swap nodes)."""
        self.logged(11)
        ranks = self.ranks()
        seen = stopped_then_read(ranks, before_ranks_lost)
        self.kill(ranks)
        self.logged(21)
        seen = (seen, before_node_loss())
        self.restart_node(1, node_returns_as)
        self.logged(31)
        self.restart_all()
        self.wait()
        return seen


def _straight_run_and_flags(
    tmp_path: Path, total: int, batch: int
) -> tuple[Path, list[str], list[str]]:
    """Run the uninterrupted reference (``tmp_path/straight``); ``(ckpt, the model's flags,
    LowDiff's flags)`` for the job under test: batches of ``batch``, no base but the first,
    ``--load`` from the start (so that restarted ranks resume), its end in ``tmp_path/resumed``."""
    ckpt = tmp_path / "ckpt"
    common = [*TINY_GPT, "--use-distributed-optimizer", "--lr-decay-iters", "100"]
    common += ["--train-iters", str(total)]
    run_gpt(2, *common, "--dump-state", str(tmp_path / "straight"))
    diff = ["--diffckpt-mode", "lowdiff", "--diffckpt-batch-size", str(batch), "--save", str(ckpt)]
    diff += ["--load", str(ckpt), "--diffckpt-full-interval", "1000"]
    diff += ["--dump-state", str(tmp_path / "resumed"), *KEPT_BASE_ONLY]
    return ckpt, common, diff


def _assert_ends_as_straight(tmp_path: Path, recovered: int) -> None:
    """The job's end equals the uninterrupted run's (``torch.equal``), and its losses after
    ``recovered`` are the uninterrupted run's."""
    straight, resumed = load_dumps(tmp_path / "straight", 2), load_dumps(tmp_path / "resumed", 2)
    for rank in range(2):
        assert resumed[rank]["losses"] == straight[rank]["losses"][recovered:]
        assert_same_state(straight[rank], resumed[rank], rank)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
