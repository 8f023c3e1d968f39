"""A single-node torchrun launch without torchrun's agent: the suite's way to start ranks.

``python tests/rank_launcher.py --nproc-per-node=N SCRIPT ARGS`` runs N ranks of
``python -u SCRIPT ARGS`` with the environment torchrun gives its workers (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, the
``GROUP_``/``ROLE_``/``TORCHELASTIC_`` variables; rank 0 hosts the rendezvous store, as
``init_process_group("env://")`` does without an agent store) and ends as a failing torchrun job
ends: when a rank exits with an error or is killed, the others get SIGTERM, then SIGKILL
after :data:`KILL_TIMEOUT_S`, and the job exits 1; it exits 0 when every rank did. SIGTERM
and SIGINT sent to the launcher reach the ranks.

The ranks are forked by the session's :mod:`fork_server` when ``DIFFCKPT_FORK_SERVER`` names
its socket (this process is then the job's client: it hands over its stdio and exits with the
job's code), else started here as new interpreters.

Why not torchrun itself: its agent imports torch before it starts a rank, about 2 s of a
2-core machine per launch, and the suite starts some 200 jobs. The ranks cannot tell the
difference. torchrun itself stays under test where the launch is the subject: ``test_orphans.py``
(plain torchrun), ``test_slurm.py`` (``megatron-diffckpt-launch``), and the jobs that tests
start with ``torchrun=True`` (:func:`launch.run_gpt`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

KILL_TIMEOUT_S = 30  # torchrun's default grace between SIGTERM and SIGKILL
POLL_S = 0.05
FORK_SERVER_ENV = "DIFFCKPT_FORK_SERVER"  # the fork server's socket, when the session has one


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(base: dict[str, str], rank: int, nproc: int, port: int, run_id: str) -> dict:
    """``base`` plus what torchrun sets for worker ``rank`` of a single-node job."""
    env = dict(base)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop(FORK_SERVER_ENV, None)  # a rank's own launches (none today) start afresh
    for name in ("RANK", "LOCAL_RANK", "ROLE_RANK"):
        env[name] = str(rank)
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE"):
        env[name] = str(nproc)
    env.update(
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        ROLE_NAME="default",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_RUN_ID=run_id,
    )
    return env


class ForkedRank:
    """The ``Popen`` calls :func:`supervise` makes, for a rank this process forked."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def _stop(ranks: list, timeout_s: float = KILL_TIMEOUT_S) -> None:
    """SIGTERM every rank still running, SIGKILL what is left after ``timeout_s``."""
    for p in ranks:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in ranks) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for p in ranks:
        if p.poll() is None:
            p.kill()
            p.wait()


def supervise(ranks: list, abandon: Callable[[], bool] | None = None) -> int:
    """Wait for the ranks as torchrun does (the module docstring); SIGTERM and SIGINT to this
    process are forwarded to them; when ``abandon()`` turns true, SIGKILL them all. Returns the
    job's exit code."""

    def forward(signum, _frame):
        for p in ranks:
            if p.poll() is None:
                p.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    while True:
        codes = [p.poll() for p in ranks]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]  # in the words of torchrun's error line and failure table
            pid = ranks[rank].pid
            print(f"rank_launcher: failed (exitcode: {code}) local_rank: {rank} (pid: {pid}); "
                  f"stopping the job\n  rank      : {rank} (local_rank: {rank})\n"
                  f"  exitcode  : {code} (pid: {pid})", file=sys.stderr, flush=True)  # fmt: skip
            _stop(ranks)
            return 1
        if all(c == 0 for c in codes):
            return 0
        if abandon is not None and abandon():
            _stop(ranks, timeout_s=0)
            return 1
        time.sleep(POLL_S)


def _through_fork_server(sock_path: str, nproc: int, script: str, args: list[str]) -> int:
    import fork_server

    env = dict(os.environ)
    env.pop(FORK_SERVER_ENV)
    conn = fork_server.request(sock_path, {"client": os.getpid(), "nproc": nproc,
                                           "script": script, "args": args, "env": env,
                                           "cwd": os.getcwd()})  # fmt: skip
    buffer = bytearray()
    started = fork_server.read_message(conn, buffer)
    if started is None:
        print("rank_launcher: the fork server refused the job", file=sys.stderr, flush=True)
        return 1
    leader = started["pid"]

    def forward(signum, _frame):  # to the leader, which forwards to the ranks
        try:
            os.kill(leader, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    ended = fork_server.read_message(conn, buffer)
    return 1 if ended is None else ended["exit"]


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].startswith("--nproc-per-node="):
        print("usage: rank_launcher.py --nproc-per-node=N SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    nproc = int(argv[0].split("=", 1)[1])
    script, args = argv[1], argv[2:]
    sock_path = os.environ.get(FORK_SERVER_ENV)
    if sock_path and os.path.exists(sock_path):
        return _through_fork_server(sock_path, nproc, script, args)
    port, run_id = free_port(), f"local-{os.getpid()}"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-u", script, *args],
            env=rank_env(dict(os.environ), rank, nproc, port, run_id),
            start_new_session=True,  # as torchrun's workers: a session of their own
        )
        for rank in range(nproc)
    ]
    return supervise(ranks)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
