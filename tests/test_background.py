"""A rank's process at exit and the processes it forks (:mod:`megatron_diffckpt.background`):
real interpreters with torch's DataLoader workers, run to their end, and real forks under a
subreaper."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import atexit, signal, sys
    import torch
    from torch.utils.data import DataLoader
    from megatron_diffckpt.background import quiet_child_exits_at_exit

    batches = iter(DataLoader(list(range(64)), batch_size=4, num_workers=2))
    next(batches)  # the workers run; torch's SIGCHLD handler is in place
    if sys.argv[1] == "own":
        def own(signum, frame):
            pass
        signal.signal(signal.SIGCHLD, own)

    def report():  # runs after the project's hook and before multiprocessing's exit function
        handler = signal.getsignal(signal.SIGCHLD)
        alive = [p.is_alive() for p in batches._workers]
        name = "SIG_DFL" if handler == signal.SIG_DFL else handler.__qualname__
        print(name, alive, flush=True)

    atexit.register(report)
    if sys.argv[1] != "without":
        quiet_child_exits_at_exit()
        quiet_child_exits_at_exit()  # idempotent
    """
)


def _run(case: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, case], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    return done.stdout.strip()


def test_at_exit_the_dataloaders_sigchld_handler_is_gone_before_its_workers_are_stopped():
    # the workers are still running when SIGCHLD is given back its default action
    assert _run("with") == "SIG_DFL [True, True]"
    # what the hook changes: without it, torch's handler is still there when they are stopped
    assert _run("without") == "_set_SIGCHLD_handler.<locals>.handler [True, True]"


def test_at_exit_a_sigchld_handler_other_than_the_dataloaders_is_left_alone():
    assert _run("own") == "own [True, True]"


# A subreaper (as a container's init or a service manager can be) forks a process that forks a
# child and exits while the child's fork hooks run: the child is adopted by the subreaper, not
# init. What the child writes to the pipe, if it outlives its hooks, and its exit code.
ADOPTED = textwrap.dedent(
    """
    import ctypes, os, sys, time
    assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.register_at_fork(after_in_child=lambda: time.sleep(1))  # runs before the next hook
        from megatron_diffckpt.background import children_die_with_this_process
        children_die_with_this_process()
        if os.fork() == 0:
            os.write(write, b"alive")
        os._exit(0)
    os.close(write)
    os.waitpid(middle, 0)
    child, status = os.wait()  # the adopted child
    print(os.read(read, 16).decode() or "nothing", os.waitstatus_to_exitcode(status))
    """
)


def test_a_forked_child_whose_forker_died_ends_when_a_subreaper_adopted_it():
    done = subprocess.run(
        [sys.executable, "-c", ADOPTED], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["nothing", "1"]
