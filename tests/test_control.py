"""The job's control plane (:mod:`megatron_diffckpt.control`) on 2 real processes (gloo, a TCP
store as torchrun's): a collective a rank never reaches times out naming it and where it was; the
ranks agree on a failure (skippable for space, else every rank stops with the failed rank's
line); a failed rank whose peer waits elsewhere stops the job; a rank that waits elsewhere is
stopped by its watcher (exit :data:`~megatron_diffckpt.control.FAULT_EXIT`) in one line."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_diffckpt import control, recovery
from megatron_diffckpt.control import FAULT_EXIT, JobControl, JobFault


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out: str, scenario: str) -> None:
    logging.basicConfig(
        filename=f"{out}/rank{rank}.log", level=logging.INFO, format="%(message)s", force=True
    )
    # what torch's C++ side prints too (its store client's warnings)
    os.dup2(os.open(f"{out}/rank{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    control.FAILED_WAIT_S = 2.0
    plane = JobControl.start(timeout_s=3.0)
    result: dict = {}
    if scenario in ("peer-killed", "host-killed"):  # rank 0 hosts the store
        _peer_killed(rank, out, plane, victim=0 if scenario == "host-killed" else 1)
        return
    try:
        recovery.all_reduce_min([rank], what="first")
        if scenario == "late":
            if rank == 1:
                time.sleep(30)  # waits elsewhere: its watcher stops it
            recovery.all_reduce_min([rank], what="second")
        else:
            failing = 0 if scenario == "stuck" else 1
            error = None
            if rank == failing and scenario != "ok":
                full = scenario == "full"
                error = OSError(errno.ENOSPC, "No space left") if full else ValueError("boom")
            if scenario == "stuck" and rank == 1:
                time.sleep(30)  # never comes to the exchange: its watcher stops it
            agreed = plane.agree("base 5: save", error, full=scenario == "full" and rank == 1)
            result["agreed"] = [agreed.failed, agreed.full, agreed.first]
            if agreed.failed and not agreed.full:
                plane.stop_agreed("base 5: save", agreed, error)
    except JobFault as exc:
        result["fault"] = str(exc)
        control.stop_others(exc)  # as a training entry does, once it printed the line
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    plane.close()


def _peer_killed(rank: int, out: str, plane: JobControl, victim: int) -> None:
    """Rank ``victim`` is SIGKILLed between two of training's own collectives; the other's
    second one fails, and it ends as a training entry does (:func:`control.end_rank`)."""
    dist.all_reduce(torch.ones(4))
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    said: list[str] = []
    try:
        dist.all_reduce(torch.ones(4))
        result = {"error": None}
    except RuntimeError as exc:
        status = control.end_rank(exc, said.append)
        result = {"status": status, "said": said, "posted": plane.posted(), "raw": str(exc)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def _run(tmp_path: Path, scenario: str) -> tuple[list[dict | None], list[int], list[str]]:
    """Each rank's result (``None``: it wrote none), exit code and log."""
    ctx = mp.get_context("spawn")
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path), scenario)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    results = [
        json.loads(f.read_text()) if (f := tmp_path / f"rank{r}.json").exists() else None
        for r in (0, 1)
    ]
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in (0, 1)]
    return results, codes, logs


@pytest.mark.distributed
def test_a_collective_a_rank_never_reaches_times_out_naming_it_and_stops_it(tmp_path):
    (r0, r1), codes, logs = _run(tmp_path, "late")
    assert r0 == {
        "fault": "rank 0: the collective 'second' timed out after 3 s; not arrived: rank 1 "
        "(last at 'first'); the job stops"
    }, r0
    assert r1 is None and codes == [0, FAULT_EXIT], (r1, codes)
    assert logs[1].strip().splitlines() == [f"stopping: {r0['fault']}"]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("scenario", "expected"),
    [
        ("ok", {"agreed": [False, False, None]}),
        ("full", {"agreed": [True, True, 1]}),
        ("error", {"agreed": [True, False, 1],
                   "fault": "rank 1: base 5: save: ValueError: boom; the job stops"}),
    ],
)  # fmt: skip
def test_the_ranks_agree_on_a_base_that_failed_on_one_of_them(tmp_path, scenario, expected):
    results, codes, _ = _run(tmp_path, scenario)
    assert results == [expected, expected] and codes == [0, 0], (results, codes)


@pytest.mark.distributed
def test_a_failed_rank_whose_peer_waits_elsewhere_stops_the_job(tmp_path):
    """Rank 0's save failed, rank 1 never comes to the exchange (it waits in megatron's save):
    rank 0 stops the job after FAILED_WAIT_S, naming its error and rank 1; rank 1's watcher
    stops it with the same line."""
    (r0, r1), codes, logs = _run(tmp_path, "stuck")
    line = (
        "rank 0: base 5: save: ValueError: boom; not at the exchange: rank 1 (last at 'first'); "
        "the job stops"
    )
    assert r0 == {"fault": line} and r1 is None and codes == [0, FAULT_EXIT], (r0, r1, codes)
    assert logs[1].strip().splitlines() == [f"stopping: {line}"]


@pytest.mark.distributed
def test_a_rank_whose_peer_was_killed_says_so_in_one_line(tmp_path):
    """Rank 1 SIGKILLed between two of training's all-reduces: rank 0's fails in gloo (a
    connection reset or closed by the peer), and the training entries' ending says so in one
    line (no traceback), without gloo's source location and advice, posts it for any other
    rank, and exits 1."""
    (r0, r1), codes, _ = _run(tmp_path, "peer-killed")
    assert r1 is None and codes[1] == -signal.SIGKILL, (r1, codes)
    assert r0["status"] == 1 and len(r0["said"]) == 1, r0
    cause = r"RuntimeError: [^();]*Connection (reset|closed) by peer"
    line = r0["said"][0]
    assert re.fullmatch(
        rf"error: rank 0: lost its connection to another rank during a collective \({cause}\): "
        r"that rank's process ended, or the network failed; the job stops "
        r"\(a restart with --load recovers\)",
        line,
    ), (line, r0["raw"])
    assert "pair.cc" in r0["raw"] and "pair.cc" not in line  # gloo's words, trimmed
    assert re.fullmatch(rf"rank 0: lost a peer: {cause}; the job stops", r0["posted"]), r0


@pytest.mark.distributed
def test_a_rank_whose_peer_hosted_the_store_ends_with_one_line_and_one_store_warning(tmp_path):
    """Rank 0, whose process hosts the job's store, SIGKILLed between two all-reduces: rank 1
    says its one line and ends, and torch's store client warns (with a C++ backtrace) about
    one failed call at most: the control plane makes no further call once one failed (posting
    the fault, reading the board, counting itself stopped)."""
    (r0, r1), codes, _ = _run(tmp_path, "host-killed")
    assert r0 is None and codes[0] == -signal.SIGKILL, (r0, codes)
    assert r1["status"] == 1 and len(r1["said"]) == 1, r1
    assert r1["said"][0].startswith("error: rank 1: lost its connection to another rank"), r1
    assert r1["posted"].startswith("the job's store is gone ("), r1
    err = (tmp_path / "rank1.err").read_text()
    warned = re.findall(r"^.*\[W[^]]* TCPStore\.cpp:\d+\] .*$", err, flags=re.M)
    assert len(warned) <= 1, err[-6000:]
