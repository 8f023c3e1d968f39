"""torchrun, and no process left behind when it ends (one node of a job; run_local.sh, Slurm).

``run_local.sh`` runs it, and on Slurm ``srun`` runs it once per node; it runs
``python -m torch.distributed.run ARGS`` and returns its exit code. When a rank dies (a killed
task, a failed node), torchrun ends, but processes the ranks started outlive them
(megatron-core's checkpoint writer spawns a ``multiprocessing`` manager on first use, with a
resource tracker): they would linger after the job, and on Slurm they count as the step's, so the
step, ``srun`` and the job would wait for them forever instead of failing and being requeued.
This launcher makes itself the *subreaper* of everything below it (Linux
``PR_SET_CHILD_SUBREAPER``), so the orphans become its children, and kills them once torchrun has
exited.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys

import psutil

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    except (AttributeError, OSError):
        pass  # not Linux: orphans are reparented to init, as without this launcher
    torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *argv])

    def forward(signum, _frame):  # scancel / preemption reach torchrun, which stops the ranks
        torchrun.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, forward)
    rc = torchrun.wait()
    leftovers = psutil.Process().children(recursive=True)
    for p in leftovers:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(leftovers, timeout=30)
    if leftovers:
        print(f"node_launcher: killed {len(leftovers)} process(es) left by the ranks", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
