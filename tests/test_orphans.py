"""Nothing outlives a killed rank, under plain torchrun too.

A LowDiff+ job writes a base from its replica every iteration (megatron's checkpoint writer
keeps a results manager, a process the rank forks at start-up), under plain ``torchrun`` (not
the project's node launcher, which reaps orphans itself). The rank with ``RANK=1`` (found by its
environment, not by its place in a process list) gets SIGKILL; torchrun stops the other rank and
exits. Every process that ever ran below torchrun must be gone 10 s later. Real processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from launch import PRETRAIN_GPT, REPO, RUN_TIMEOUT_S, TINY_GPT, _env


def _rank_of(p: psutil.Process) -> int | None:
    try:
        return int(p.environ().get("RANK", ""))
    except (psutil.Error, ValueError):
        return None


@pytest.mark.distributed
def test_no_process_of_a_killed_lowdiff_plus_job_outlives_torchrun(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [*TINY_GPT, "--use-distributed-optimizer", "--train-iters", "1000", "--save",
            str(ckpt), "--save-interval", "1", "--diffckpt-mode", "lowdiff-plus"]  # fmt: skip
    torchrun = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(PRETRAIN_GPT),
            *args,
        ],  # fmt: skip
        cwd=REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    seen: dict[int, float] = {}  # pid -> create time, of every process ever below torchrun
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        # Until bases have been written for a while (the writer's processes exist by then).
        while not (ckpt / "iter_0000004" / "metadata.json").exists():
            assert torchrun.poll() is None, "training ended early"
            assert time.monotonic() < deadline, "training never reached its fourth base"
            for p in psutil.Process(torchrun.pid).children(recursive=True):
                seen.setdefault(p.pid, p.create_time())
            time.sleep(0.02)
        for p in psutil.Process(torchrun.pid).children(recursive=True):
            seen.setdefault(p.pid, p.create_time())
        victim = next(p for p in psutil.Process(torchrun.pid).children() if _rank_of(p) == 1)
        victim.send_signal(signal.SIGKILL)
        torchrun.wait(RUN_TIMEOUT_S)
    finally:
        if torchrun.poll() is None:
            os.killpg(torchrun.pid, signal.SIGKILL)
    assert len(seen) > 2  # the ranks and at least one helper of megatron's writer
    time.sleep(10)
    alive = []
    for pid, created in seen.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(" ".join(p.cmdline())[:200])
                p.kill()  # leave the machine clean for the other tests, then fail
        except psutil.NoSuchProcess:
            continue
    assert not alive, f"{len(alive)} process(es) of the killed job still alive: {alive}"
