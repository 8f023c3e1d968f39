"""Faults that end cleanly (real processes under ``megatron-diffckpt-launch``, torchrun restarting
the ranks once): a failure on one rank stops every rank within seconds, each in one line naming
the failed rank and its cause, never a hang; the restart recovers, and the job ends equal to an
uninterrupted run (``torch.equal``)."""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from launch import (
    PRETRAIN_GPT,
    TINY_GPT,
    finish_node,
    kill_tree,
    launch_node,
    rank_process,
    run_gpt,
    wait_logged,
)
from test_keeper import _assert_ends_as_straight

from megatron_diffckpt.failpoints import ENV as FAILPOINT_ENV

STOP_WITHIN_S = 60.0  # a hang detector, not a measurement: the job stops in about 10 s


def _job(tmp_path: Path, mode: str, total: int) -> list[str]:
    """The uninterrupted reference (``tmp_path/straight``), and the flags of the job under test
    (bases every 5; its end to ``tmp_path/resumed``)."""
    common = [*TINY_GPT, "--use-distributed-optimizer", "--train-iters", str(total)]
    run_gpt(2, *common, "--dump-state", str(tmp_path / "straight"))
    ckpt = tmp_path / "ckpt"
    flags = ["--diffckpt-mode", mode, "--save", str(ckpt), "--load", str(ckpt)]
    flags += ["--diffckpt-full-interval", "5", "--dump-state", str(tmp_path / "resumed")]
    return [*common, *flags]


def stop_then_restart(
    args: list[str],
    fault: Callable[[int], None],
    undo: Callable[[], None],
    script: Path = PRETRAIN_GPT,
) -> str:
    """Run ``script``'s job under the launcher; after iteration 7, ``fault(launcher pid)``;
    wait (at most :data:`STOP_WITHIN_S`) until both ranks said that rank 0 failed at base 10,
    then ``undo()`` (so that the restart's base 10 can be written) and let torchrun's restart
    finish. Asserts one line per rank, ending the job, and no traceback; returns the log."""
    proc, lines = launch_node(args, keeper_memory=None, script=script)
    failed = re.compile(r"(error|stopping): rank 0: base 10: (save|write|finalize): \w+")
    try:
        wait_logged(lines, 7, proc)
        fault(proc.pid)
        deadline = time.monotonic() + STOP_WITHIN_S
        while len([line for line in lines if failed.search(line)]) < 2:
            assert time.monotonic() < deadline, "no stop within 60 s:\n" + "".join(lines[-40:])
            time.sleep(0.05)
        undo()
        log = finish_node(proc, lines)
    finally:
        kill_tree(proc)
    said = [line for line in lines if "rank 0: base 10: " in line]
    assert len(said) == 2 and all(s.rstrip().endswith("the job stops") for s in said), said
    prefixes = {m.group(0) for s in said if (m := re.match(r"\[rank\d\]", s))}
    assert len(prefixes) in (0, 2), said  # where lines name their rank: one line per rank
    assert "Traceback" not in log, log[-3000:]
    return log


PEER_GONE = re.compile(r"error: rank 0: lost its connection to another rank during a collective")


def kill_a_rank_then_restart(args: list[str], script: Path = PRETRAIN_GPT) -> str:
    """Run ``script``'s job under the launcher; after iteration 7, SIGKILL rank 1 (its
    process: the kernel's OOM killer, a crashed node) while rank 0 waits for it in a
    collective. Rank 0, whose collective finds its peer gone, says so in one line; no rank
    prints a traceback; torchrun's restart finishes the job. Returns the log.

    torchrun stops the ranks left (SIGTERM) at its first look after a rank died, every
    ``--monitor-interval`` (0.1 s by default): a rank that has not met the failure by then
    ends without its line, the launcher's report of the dead rank being the job's account.
    Here rank 1 is held (SIGSTOP) for a second before it is killed, so that rank 0 is inside
    a collective, and torchrun looks every second, so that rank 0 has the time to say it."""
    monitor = ("--monitor-interval", "1")
    proc, lines = launch_node(args, keeper_memory=None, script=script, torchrun=monitor)
    try:
        wait_logged(lines, 7, proc)
        victim = rank_process(1, proc.pid)
        victim.suspend()
        time.sleep(1)
        victim.kill()
        log = finish_node(proc, lines)
    finally:
        kill_tree(proc)
    said = [line for line in lines if PEER_GONE.search(line)]
    killed_at = re.search(r"iteration +7/", log)  # what the ranks and torchrun said from there
    assert len(said) == 1 and said[0].rstrip().endswith("(a restart with --load recovers)"), (
        said or log[killed_at.start() if killed_at else 0 :][:8000]
    )
    # (Megatron-LM's forward step logs an exception that passes through it as one warning
    # line, its traceback as a list: Megatron-LM's own, as without this library)
    at = re.search(r"^Traceback", log, re.MULTILINE)
    assert at is None, log[max(at.start() - 1500, 0) : at.start() + 3000]
    return log


def _ends_as_straight(tmp_path: Path, log: str) -> None:
    recovered = re.findall(r"\[rank0\] \S+ recovered to iteration (\d+)", log)
    assert len(recovered) == 1 and int(recovered[0]) >= 5, recovered
    _assert_ends_as_straight(tmp_path, int(recovered[0]))


@pytest.mark.distributed
def test_a_rank_whose_checkpoint_writer_died_stops_every_rank_in_one_line(tmp_path):
    """LowDiff, rank 0's helper processes (megatron's checkpoint writer machinery, forked at
    start) SIGKILLed after iteration 7: the next base fails on rank 0 alone, while rank 1's
    save goes on into megatron's own barrier, where nothing of this library runs. Every rank
    stops within seconds in one line naming rank 0, the base and the cause; torchrun's restart
    recovers, and the run ends as an uninterrupted one."""

    def kill_helpers(launcher: int) -> None:
        helpers = rank_process(0, launcher).children(recursive=True)
        assert helpers, "rank 0 started no helper process"
        for helper in helpers:
            helper.kill()

    log = stop_then_restart(_job(tmp_path, "lowdiff", total=20), kill_helpers, lambda: None)
    _ends_as_straight(tmp_path, log)


@pytest.mark.distributed
def test_a_rank_killed_mid_training_leaves_its_peer_one_line(tmp_path):
    """LowDiff+, rank 1 SIGKILLed from outside after iteration 7: rank 0's next collective
    fails in gloo, and it ends in one line saying a peer's process ended (not gloo's
    traceback); torchrun's restart recovers, and the run ends as an uninterrupted one."""
    log = kill_a_rank_then_restart(_job(tmp_path, "lowdiff-plus", total=16))
    _ends_as_straight(tmp_path, log)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["lowdiff", "lowdiff-plus"])
def test_a_write_refused_on_one_rank_stops_every_rank_in_one_line(tmp_path, mode):
    """Base 10's folder already holds, where rank 0's file goes, a folder (a write refused on
    one rank: its node's filesystem, a permission): megatron's save fails on rank 0 (alone, or
    reported by megatron on every rank). Every rank stops within seconds in one line naming rank
    0; once the obstacle is gone the restart recovers and ends as an uninterrupted run."""
    blocker = tmp_path / "ckpt" / "iter_0000010" / "__0_0.distcp"

    def refuse(_launcher: int) -> None:
        blocker.mkdir(parents=True)

    undo = lambda: shutil.rmtree(blocker.parent)  # noqa: E731
    _ends_as_straight(tmp_path, stop_then_restart(_job(tmp_path, mode, total=20), refuse, undo))


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["lowdiff", "lowdiff-plus"])
def test_strict_loses_at_most_b_iterations_and_recovers_exactly(tmp_path, monkeypatch, mode):
    """``--diffckpt-when-full strict`` with B = 3: rank 0 SIGKILLed right after handing
    iteration 11 over; the restart recovers at least iteration 8 (11 - B) and ends as an
    uninterrupted run. (The bound under a storage slower than training:
    ``tests/storage/test_log.py``.)"""
    args = [*_job(tmp_path, mode, total=16), "--diffckpt-when-full", "strict"]
    args += ["--diffckpt-batch-size", "3"]
    monkeypatch.setenv(FAILPOINT_ENV, "iteration-end:11@0")
    killed = run_gpt(2, *args, check=False)
    assert killed.returncode != 0 and "failpoint iteration-end #11" in killed.stderr + killed.stdout
    monkeypatch.delenv(FAILPOINT_ENV)
    resumed = run_gpt(2, *args)
    log = resumed.stdout + resumed.stderr
    recovered = int(re.findall(r"\[rank0\] \S+ recovered to iteration (\d+)", log)[0])
    assert 11 - 3 <= recovered <= 11, recovered
    _assert_ends_as_straight(tmp_path, recovered)
