"""Nothing outlives a killed rank, under plain torchrun too.

A LowDiff+ job writes a base from its replica every iteration (megatron's checkpoint writer
keeps a results manager, a process the rank forks at start-up), under plain ``torchrun`` (not
the project's node launcher, which reaps orphans itself). The rank with ``RANK=1`` (found by its
environment, not by its place in a process list) gets SIGKILL; torchrun stops the other rank and
exits. Every process that ever ran below torchrun must be gone 10 s later, and the named
semaphores its queues made removed. Real processes.

The same rule, shown without a race: a process that the rank's spawned helper forks (megatron-core
0.16's persistent checkpoint worker forks its file writers) dies with the helper when the rank is
SIGKILLed, even where it waits forever.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest
from launch import PRETRAIN_GPT, REPO, TINY_GPT, _env, outliving_a_killed_rank

# An entry script as the examples are (helpers_die_with_this_rank at import) whose rank spawns a
# helper, as megatron-core 0.16 spawns its persistent checkpoint worker; the helper forks a
# process that never ends by itself, as a file writer waiting on a queue whose other end died.
RANK_SCRIPT = """
import multiprocessing, os, sys, time
from megatron_diffckpt.background import helpers_die_with_this_rank

helpers_die_with_this_rank()


def started(name):
    with open(os.path.join(sys.argv[1], name + ".tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(sys.argv[1], name + ".tmp"), os.path.join(sys.argv[1], name))


def writer():
    started("writer")
    time.sleep(600)


def worker():
    started("worker")
    process = multiprocessing.get_context("fork").Process(target=writer)
    process.start()
    process.join()


if __name__ == "__main__":
    multiprocessing.get_context("spawn").Process(target=worker).start()
    time.sleep(600)
"""


@pytest.mark.distributed
def test_no_process_of_a_killed_lowdiff_plus_job_outlives_torchrun(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [*TINY_GPT, "--use-distributed-optimizer", "--train-iters", "1000", "--save",
            str(ckpt), "--save-interval", "1", "--diffckpt-mode", "lowdiff-plus"]  # fmt: skip
    # until bases have been written for a while (the writer's processes exist by then)
    left = outliving_a_killed_rank(
        PRETRAIN_GPT, args, (ckpt / "iter_0000004" / "metadata.json").exists
    )
    assert not left, f"{len(left)} process(es) or semaphore(s) of the killed job left: {left}"


def test_what_a_spawned_helper_forks_dies_with_the_killed_rank(tmp_path):
    """The rank SIGKILLed: within 10 s neither its spawned helper nor the process the helper
    forked is alive (the fork was orphaned before: the helper's interpreter had no fork hook)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    rank = subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=REPO, env=_env())
    helpers = []
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "writer").exists():
            assert rank.poll() is None and time.monotonic() < deadline, "the helpers never started"
            time.sleep(0.05)
        helpers = [psutil.Process(int((tmp_path / n).read_text())) for n in ("worker", "writer")]
        rank.send_signal(signal.SIGKILL)
        rank.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in helpers):
            time.sleep(0.05)
        left = [p.pid for p in helpers if _alive(p)]
        assert not left, f"of the helper and its fork ({[p.pid for p in helpers]}): {left} alive"
    finally:
        if rank.poll() is None:
            rank.kill()
        for p in helpers:
            if _alive(p):
                p.kill()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
