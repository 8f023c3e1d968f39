"""``megatron-diffckpt-launch``: torchrun for one node, with the node's keeper, and no process left
behind when it ends.

Usage (the launcher's own flags first, then torchrun's arguments as they are)::

    megatron-diffckpt-launch [--keeper-memory MIB [--keeper-peers DIR]] \
        --nproc-per-node 8 ... pretrain_gpt.py <Megatron flags> --diffckpt-mode lowdiff

It runs ``python -m torch.distributed.run ARGS`` (through :mod:`megatron_diffckpt.torchrun`,
which prints torchrun's report of failed ranks without a traceback) and returns its exit code;
on Slurm ``srun``
runs it once per node (``examples/gpt/slurm/pretrain_gpt.sbatch``). When a rank dies (a killed
task, a failed node), torchrun ends, but processes the ranks started outlive them
(megatron-core's checkpoint writer spawns a ``multiprocessing`` manager on first use, with a
resource tracker): they would linger after the job, and on Slurm they count as the step's, so the
step, ``srun`` and the job would wait for them forever instead of failing and being requeued.
This launcher makes itself the *subreaper* of everything below it (Linux
``PR_SET_CHILD_SUBREAPER``), so the orphans become its children, and kills them once torchrun has
exited (all but the ``multiprocessing`` resource trackers, which end by themselves once the
processes they watched are gone, after removing those processes' named semaphores from /dev/shm;
:func:`kill_leftovers`).

``--keeper-memory MIB`` also starts the node's keeper (:mod:`megatron_diffckpt.keeper`) with that
memory cap before torchrun, and stops it after: the memory tier, which the ranks use under
``--diffckpt-keeper auto`` (the default), so that ranks restarted by torchrun
(``--max-restarts``) recover from memory what storage had not made durable yet. The ranks find
it through ``DIFFCKPT_KEEPER``. ``--keeper-peers DIR`` (a folder every node sees) puts the
keepers of the job's nodes in a ring, each copying to the next node's
(:mod:`megatron_diffckpt.keeper.peers`), so that a node lost whole recovers from its successor.
The keeper's shared-memory folder (``/dev/shm``, named after the keeper's socket folder) is
removed when the keeper stops, even one that died.

However the launcher itself ends (an OOM kill, a SIGKILL of a step outside Slurm's cgroup), the
job's processes on the node end with it: a small *watchdog* process (:func:`watch`, no torch
import) polls the launcher, and once it is gone SIGKILLs every process that carries this
launch's mark in its environment (:data:`JOB_ENV`: torchrun, the ranks, what they started, the
keeper), removes the keeper's socket and shared-memory folders, and exits; within a second.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil

KEEPER_FLAG = "--keeper-memory"
PEERS_FLAG = "--keeper-peers"
THREADS_FLAG = "--keeper-merge-threads"
PROG = "megatron-diffckpt-launch"
RETIRED = {"--diffckpt-keeper-memory": KEEPER_FLAG, "--diffckpt-keeper-peers": PEERS_FLAG}
USAGE = f"""usage: {PROG} [--keeper-memory MIB [--keeper-peers DIR] [--keeper-merge-threads N]]
       TORCHRUN_ARGS...

torchrun (python -m torch.distributed.run) for one node, with the node's keeper, and no process
left behind when it ends. Every argument after the launcher's own goes to torchrun as it is
(see: python -m torch.distributed.run --help).

options:
  -h, --help           show this help and exit
  --keeper-memory MIB  start the node's keeper with this memory cap: the memory tier that
                       ranks restarted by torchrun recover from (--diffckpt-keeper auto)
  --keeper-peers DIR   a folder every node sees: the keepers of the job's nodes form a ring,
                       each copying to the next node's, so a node lost whole recovers from it
  --keeper-merge-threads N
                       CPU threads the keeper steps the node's LowDiff+ replicas with, all
                       ranks together (default: half the CPUs the launcher may run on)
"""
KEEPER_START_S = 60.0
JOB_ENV = "DIFFCKPT_LAUNCH_JOB"
"""Set by the launcher in the environment of everything it starts (torchrun, hence the ranks and
their children, and the keeper): what the watchdog kills when the launcher is gone."""
WATCH_POLL_S = 0.2
TRACKER_WAIT_S = 10.0
"""How long the launcher's last sweep waits for the ranks' resource trackers to end."""

PR_SET_CHILD_SUBREAPER = 36


def launcher_options(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """This launcher's leading flags (``--keeper-memory``, ``--keeper-peers``; ``FLAG VALUE`` or
    ``FLAG=VALUE``), and torchrun's arguments after them. Raises ``SystemExit`` with one line
    for a bad value or a retired flag."""
    opts: dict[str, str] = {}
    while argv:
        flag, _, value = argv[0].partition("=")
        if flag in RETIRED:
            raise SystemExit(f"{PROG}: {flag} was retired; use {RETIRED[flag]}")
        if flag not in (KEEPER_FLAG, PEERS_FLAG, THREADS_FLAG):
            break
        if not value:
            if len(argv) < 2:
                raise SystemExit(f"{PROG}: {flag} needs a value")
            value, argv = argv[1], argv[1:]
        opts[flag], argv = value, argv[1:]
    for flag in (PEERS_FLAG, THREADS_FLAG):
        if flag in opts and KEEPER_FLAG not in opts:
            raise SystemExit(f"{PROG}: {flag} needs {KEEPER_FLAG} (the keeper's cap)")
    if THREADS_FLAG in opts and not (opts[THREADS_FLAG].isdigit() and int(opts[THREADS_FLAG])):
        raise SystemExit(
            f"{PROG}: {THREADS_FLAG} takes a number of threads, got {opts[THREADS_FLAG]}"
        )
    if KEEPER_FLAG in opts:
        try:
            mib = float(opts[KEEPER_FLAG])
        except ValueError:
            mib = -1.0
        if mib <= 0:
            raise SystemExit(
                f"{PROG}: {KEEPER_FLAG} takes a positive size in MiB, got {opts[KEEPER_FLAG]}"
            )
    return opts, argv


def _torchrun_flags(argv: list[str], *names: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for i, arg in enumerate(argv):
        if arg.endswith(".py"):
            break  # the training script: its flags are not torchrun's
        flag, _, value = arg.partition("=")
        flag = flag.replace("_", "-")
        if flag in names:
            found[flag] = value or (argv[i + 1] if i + 1 < len(argv) else "")
    return found


def node_ranks(argv: list[str]) -> int:
    """The ranks of this node: torchrun's ``--nproc-per-node`` where it is a number; for
    ``gpu`` or ``auto``, the GPUs (``CUDA_VISIBLE_DEVICES``, else the ``/dev/nvidiaN`` devices;
    without any, ``auto`` means the CPUs, as for ``cpu``); 1 without the flag."""
    value = _torchrun_flags(argv, "--nproc-per-node").get("--nproc-per-node", "1")
    if value.isdigit():
        return max(1, int(value))
    gpus = 0
    if value in ("gpu", "auto"):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            gpus = len([d for d in visible.split(",") if d.strip()])
        else:
            gpus = len([d for d in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", d)])
    if gpus:
        return gpus
    return (os.cpu_count() or 1) if value in ("cpu", "auto") else 1


def node_of(argv: list[str]) -> tuple[int, int]:
    """``(node rank, nodes)`` of this launch: torchrun's ``--node-rank`` and ``--nnodes`` (the
    largest of a range), else Slurm's ``SLURM_NODEID`` and ``SLURM_NNODES``, else ``(0, 1)``."""
    found = _torchrun_flags(argv, "--node-rank", "--nnodes")
    rank = found.get("--node-rank", os.environ.get("SLURM_NODEID", "0"))
    nnodes = found.get("--nnodes", os.environ.get("SLURM_NNODES", "1")).split(":")[-1]
    return int(rank), int(nnodes)


def start_keeper(
    opts: dict[str, str], argv: list[str], env: dict[str, str]
) -> tuple[subprocess.Popen, str]:
    """The node's keeper, listening on a socket in a fresh private folder, in environment
    ``env``; with ``PEERS_FLAG``, in the job's ring of keepers (advertised at
    ``DIFFCKPT_KEEPER_HOST``, default this host's name)."""
    sock = os.path.join(tempfile.mkdtemp(prefix="diffckpt-keeper-"), "socket")
    cmd = [sys.executable, "-m", "megatron_diffckpt.keeper", "--socket", sock]
    cmd += ["--memory-mib", opts[KEEPER_FLAG], "--shm-dir", shm_dir(sock)]
    cmd += ["--ranks", str(node_ranks(argv))]
    if THREADS_FLAG in opts:
        cmd += ["--merge-threads", opts[THREADS_FLAG]]
    if PEERS_FLAG in opts:
        node, nnodes = node_of(argv)
        cmd += ["--peers", opts[PEERS_FLAG], "--node", str(node), "--nnodes", str(nnodes)]
        if os.environ.get("DIFFCKPT_KEEPER_HOST"):
            cmd += ["--host", os.environ["DIFFCKPT_KEEPER_HOST"]]
    from megatron_diffckpt.failpoints import ENV as FAILPOINT_ENV

    # fail points kill ranks (the keeper writes LowDiff+'s diff log, but is no rank)
    keeper = subprocess.Popen(cmd, env={k: v for k, v in env.items() if k != FAILPOINT_ENV})
    deadline = time.monotonic() + KEEPER_START_S
    while not os.path.exists(sock):
        if keeper.poll() is not None or time.monotonic() > deadline:
            keeper.kill()
            raise SystemExit(f"{PROG}: the keeper did not start ({' '.join(cmd)})")
        time.sleep(0.05)
    return keeper, sock


def shm_dir(sock: str) -> str:
    """The keeper's shared-memory folder (LowDiff+'s replica), named after its socket's folder:
    this launcher removes it even when the keeper died without removing it."""
    from megatron_diffckpt.keeper.shm import shared_memory_root

    return os.path.join(shared_memory_root(), os.path.basename(os.path.dirname(sock)))


def stop_keeper(keeper: subprocess.Popen, sock: str) -> None:
    from megatron_diffckpt.keeper.client import stop

    try:
        stop(sock)
        keeper.wait(timeout=30)
    except (OSError, ConnectionError, subprocess.TimeoutExpired):
        keeper.kill()
    from megatron_diffckpt.keeper.shm import remove_shm

    shutil.rmtree(os.path.dirname(sock), ignore_errors=True)
    remove_shm(shm_dir(sock))


def job_processes(job: str) -> list[psutil.Process]:
    """The processes (of this user) whose environment carries ``JOB_ENV=job``, this one
    excepted."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(JOB_ENV) == job:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def watch(launcher: int, job: str, folders: list[str]) -> None:
    """The watchdog's body: wait until process ``launcher`` (its parent) is gone, then SIGKILL
    the job's processes (until none is left: one may fork while they die) and remove
    ``folders`` (the keeper's socket and shared-memory folders). The launcher kills the
    watchdog when it ends normally; this runs only when the launcher died first."""
    while os.getppid() == launcher:
        time.sleep(WATCH_POLL_S)
    killed = 0
    for _ in range(50):
        left = job_processes(job)
        if not left:
            break
        for p in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        killed += len(left)
        psutil.wait_procs(left, timeout=1)
    from megatron_diffckpt.keeper.shm import remove_shm

    for folder in folders:
        remove_shm(folder)  # and its owner file, if it has one
    print(f"{PROG}: the launcher (pid {launcher}) is gone: killed the {killed} process(es) of its "
          "job", file=sys.stderr, flush=True)  # fmt: skip


def start_watchdog(job: str, folders: list[str]) -> subprocess.Popen:
    """The watchdog of this launcher (:func:`watch`), itself without the job's mark."""
    code = "import sys; from megatron_diffckpt.launch import watch; "
    code += "watch(int(sys.argv[1]), sys.argv[2], sys.argv[3:])"
    env = {k: v for k, v in os.environ.items() if k != JOB_ENV}
    return subprocess.Popen([sys.executable, "-c", code, str(os.getpid()), job, *folders], env=env)


def main(argv: list[str] | None = None) -> int:
    """Run torchrun for this node (the console script ``megatron-diffckpt-launch``); returns
    torchrun's exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    except (AttributeError, OSError):
        pass  # not Linux: orphans are reparented to init, as without this launcher
    opts, argv = launcher_options(argv)
    job = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    keeper, env = None, dict(os.environ, **{JOB_ENV: job})
    # torchrun shares its rendezvous store with the ranks' process groups by default; a restart
    # (--max-restarts) then can read the previous attempt's addresses and fail to connect
    # (pytorch/pytorch#135712): each attempt's ranks get a store of their own instead.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    folders = []
    if KEEPER_FLAG in opts:
        keeper, env["DIFFCKPT_KEEPER"] = start_keeper(opts, argv, env)
        folders = [os.path.dirname(env["DIFFCKPT_KEEPER"]), shm_dir(env["DIFFCKPT_KEEPER"])]
    watchdog = start_watchdog(job, folders)
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "megatron_diffckpt.torchrun", *argv], env=env
    )

    def forward(signum, _frame):  # scancel / preemption reach torchrun, which stops the ranks
        torchrun.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, forward)
    rc = torchrun.wait()
    if keeper is not None:
        stop_keeper(keeper, env["DIFFCKPT_KEEPER"])
    watchdog.kill()
    watchdog.wait()
    killed = kill_leftovers(psutil.Process().children(recursive=True))
    if killed:
        print(f"{PROG}: killed {killed} process(es) left by the ranks", flush=True)
    return rc


def is_resource_tracker(p: psutil.Process) -> bool:
    """Whether ``p`` is a ``multiprocessing`` resource tracker (a rank starts one with its first
    queue or manager)."""
    try:
        return any("multiprocessing.resource_tracker" in arg for arg in p.cmdline())
    except psutil.Error:
        return False


def kill_leftovers(procs: list[psutil.Process]) -> int:
    """SIGKILL ``procs`` (what the ranks left, reparented here) but the resource trackers, then
    give those up to :data:`TRACKER_WAIT_S` to end on their own: once every process that held
    a rank's queues is gone, its tracker removes their named semaphores from /dev/shm and
    exits (killed first, it would leave them there). Returns how many live processes it
    killed (the exited ones it only reaps)."""
    trackers = [p for p in procs if is_resource_tracker(p)]
    killed = 0
    for p in procs:
        if p in trackers:
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.status() != psutil.STATUS_ZOMBIE:
                p.kill()
                killed += 1
    psutil.wait_procs([p for p in procs if p not in trackers], timeout=30)
    _, alive = psutil.wait_procs(trackers, timeout=TRACKER_WAIT_S)
    for p in alive:  # still held open by a process outside the job
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
            killed += 1
    psutil.wait_procs(alive, timeout=30)
    return killed


if __name__ == "__main__":
    sys.exit(main())
