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

``--diffckpt-keeper-memory MIB`` (before torchrun's arguments) also starts the node's keeper
(:mod:`megatron_diffckpt.keeper`) with that memory cap before torchrun, and stops it after: it
holds every differential the ranks hand it, so that ranks restarted by torchrun
(``--max-restarts``) recover what storage had not made durable yet, from memory. The ranks find
it through ``DIFFCKPT_KEEPER``.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil

KEEPER_FLAG = "--diffckpt-keeper-memory"
KEEPER_START_S = 60.0

PR_SET_CHILD_SUBREAPER = 36


def keeper_memory(argv: list[str]) -> tuple[float | None, list[str]]:
    """``(MiB, torchrun's arguments)`` from this launcher's leading ``KEEPER_FLAG``."""
    if argv and argv[0].startswith(KEEPER_FLAG + "="):
        value, rest = argv[0].split("=", 1)[1], argv[1:]
    elif argv and argv[0] == KEEPER_FLAG:
        if len(argv) < 2:
            raise SystemExit(f"node_launcher: {KEEPER_FLAG} needs a value in MiB")
        value, rest = argv[1], argv[2:]
    else:
        return None, argv
    try:
        mib = float(value)
    except ValueError:
        mib = -1.0
    if mib <= 0:
        raise SystemExit(f"node_launcher: {KEEPER_FLAG} takes a positive size in MiB, got {value}")
    return mib, rest


def start_keeper(mib: float) -> tuple[subprocess.Popen, str]:
    """The node's keeper, listening on a socket in a fresh private folder."""
    sock = os.path.join(tempfile.mkdtemp(prefix="diffckpt-keeper-"), "socket")
    cmd = [sys.executable, "-m", "megatron_diffckpt.keeper", "--socket", sock]
    keeper = subprocess.Popen([*cmd, "--memory-mib", str(mib)])
    deadline = time.monotonic() + KEEPER_START_S
    while not os.path.exists(sock):
        if keeper.poll() is not None or time.monotonic() > deadline:
            keeper.kill()
            raise SystemExit(f"node_launcher: the keeper did not start ({' '.join(cmd)})")
        time.sleep(0.05)
    return keeper, sock


def stop_keeper(keeper: subprocess.Popen, sock: str) -> None:
    from megatron_diffckpt.keeper import stop

    try:
        stop(sock)
        keeper.wait(timeout=30)
    except (OSError, ConnectionError, subprocess.TimeoutExpired):
        keeper.kill()
    shutil.rmtree(os.path.dirname(sock), ignore_errors=True)


def main(argv: list[str]) -> int:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    except (AttributeError, OSError):
        pass  # not Linux: orphans are reparented to init, as without this launcher
    mib, argv = keeper_memory(argv)
    keeper, env = None, dict(os.environ)
    # torchrun shares its rendezvous store with the ranks' process groups by default; a restart
    # (--max-restarts) then can read the previous attempt's addresses and fail to connect
    # (pytorch/pytorch#135712): each attempt's ranks get a store of their own instead.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if mib is not None:
        keeper, env["DIFFCKPT_KEEPER"] = start_keeper(mib)
    torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *argv], env=env)

    def forward(signum, _frame):  # scancel / preemption reach torchrun, which stops the ranks
        torchrun.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, forward)
    rc = torchrun.wait()
    if keeper is not None:
        stop_keeper(keeper, env["DIFFCKPT_KEEPER"])
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
