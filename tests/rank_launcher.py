"""A single-node torchrun launch without torchrun's agent: the suite's way to start ranks.

``python tests/rank_launcher.py --nproc-per-node=N SCRIPT ARGS`` starts N processes of
``python -u SCRIPT ARGS`` with the environment torchrun gives its workers (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, the
``GROUP_``/``ROLE_``/``TORCHELASTIC_`` variables; rank 0 hosts the rendezvous store, as
``init_process_group("env://")`` does without an agent store) and ends as a failing torchrun job
ends: when a rank exits with an error or is killed, the others get SIGTERM, then SIGKILL
after :data:`KILL_TIMEOUT_S`, and the launcher exits 1; it exits 0 when every rank did. SIGTERM
and SIGINT sent to the launcher reach the ranks.

Why not torchrun itself: its agent imports torch before it starts a rank, about 2 s of a
2-core machine per launch, and the suite starts some 200 jobs. The ranks cannot tell the two
apart. torchrun itself stays under test where the launch is the subject: ``test_orphans.py``
(plain torchrun), ``test_slurm.py`` (``examples/gpt/node_launcher.py``), and the jobs that
tests pass ``torchrun=True`` (:func:`launch.run_gpt`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

KILL_TIMEOUT_S = 30  # torchrun's default grace between SIGTERM and SIGKILL
POLL_S = 0.05


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    for name in ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK"):
        env[name] = str(rank) if name != "GROUP_RANK" else "0"
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE"):
        env[name] = str(nproc)
    env.update(
        GROUP_WORLD_SIZE="1",
        ROLE_NAME="default",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_RUN_ID=run_id,
    )
    return env


def _stop(ranks: list[subprocess.Popen]) -> None:
    """SIGTERM every rank still running, SIGKILL what is left after the grace period."""
    for p in ranks:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + KILL_TIMEOUT_S
    while any(p.poll() is None for p in ranks) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for p in ranks:
        if p.poll() is None:
            p.kill()
            p.wait()


def main(argv: list[str]) -> int:
    if not argv or not argv[0].startswith("--nproc-per-node="):
        print("usage: rank_launcher.py --nproc-per-node=N SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    nproc = int(argv[0].split("=", 1)[1])
    script, args = argv[1], argv[2:]
    port, run_id = _free_port(), f"local-{os.getpid()}"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-u", script, *args],
            env=_rank_env(rank, nproc, port, run_id),
            start_new_session=True,  # as torchrun's workers: a signal to the job's group is ours
        )
        for rank in range(nproc)
    ]

    def forward(signum, _frame):
        for p in ranks:
            if p.poll() is None:
                p.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    while True:
        codes = [p.poll() for p in ranks]
        if any(c not in (None, 0) for c in codes):
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            rank, code = failed[0]  # "exitcode: N" as torchrun's failure summary says it
            print(f"rank_launcher: rank {rank} failed (exitcode: {code}); stopping the job",
                  file=sys.stderr, flush=True)  # fmt: skip
            _stop(ranks)
            return 1
        if all(c == 0 for c in codes):
            return 0
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
