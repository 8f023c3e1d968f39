"""A rank's process at exit (:mod:`megatron_diffckpt.background`): real interpreters, each
with torch's DataLoader workers, run to their end."""

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
