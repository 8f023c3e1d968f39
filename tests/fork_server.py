"""The suite's rank processes, forked from one process that imported torch and megatron-core once.

A training job of the suite spends most of its life starting: each rank imports torch (with
``torch._dynamo``, which torch's optimizers import at their first step) and megatron-core, about
3.5 s of a 2-core machine, before it trains a tiny GPT for a second or two. This server pays that
once per test session. It is started by :func:`launch.fork_server_env` (on first use; it ends
with the pytest process), imports those modules in CPU mode, and serves
:mod:`rank_launcher` clients on a Unix socket:

1. A client (``rank_launcher.py``, started by the test as the job's process) sends its request
   (script, arguments, environment, working directory, ranks) and its stdin, stdout and stderr.
2. The server forks a *job leader* and writes the leader's pid to ``<socket>.<client pid>``,
   before any rank exists (:func:`launch.kill_tree` finds the job's processes through it: they
   are not the client's children).
3. The leader forks the ranks, each ``runpy``-ing the script as ``__main__`` with the
   environment torchrun gives its workers (:func:`rank_launcher.rank_env`), and supervises them
   as ``rank_launcher`` does (:func:`rank_launcher.supervise`). Their pids, by rank, go to
   ``<socket>.<client pid>.ranks`` (:func:`launch.rank_process`: a forked process's
   ``/proc/PID/environ`` is the server's, so ``RANK`` there cannot tell). When the client goes
   away (the test SIGKILLed it, or its timeout did) the leader SIGKILLs the ranks.
4. The server reaps the leader and sends its exit status to the client, which exits with it.

A rank runs the script's own code from its first line; what it does not do is import torch and
megatron-core itself, and CPU mode is on before the script calls ``cpu_mode.enable()`` (which is
then a no-op). The start-up path itself stays under test where it is the subject: torchrun in
``test_orphans.py``, ``test_slurm.py`` and the jobs that pass ``torchrun=True``;
``DIFFCKPT_TEST_FORK_SERVER=0`` runs every job as ``rank_launcher.py`` execs it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import socket
import struct
import sys
import threading
import traceback

PR_SET_CHILD_SUBREAPER = 36
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "megatron.core",
    "megatron.core.dist_checkpointing",
    "megatron.core.distributed",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron.core.tensor_parallel",
)
_HEADER = struct.Struct("!I")  # the request's length; the client's three descriptors come with it


def request(sock_path: str, payload: dict) -> socket.socket:
    """Client side: send ``payload`` and this process's stdin, stdout, stderr; returns the
    connection, on which the server answers ``{"pid": leader}`` then ``{"exit": code}``."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(sock_path)
    data = json.dumps(payload).encode()
    socket.send_fds(conn, [_HEADER.pack(len(data))], [0, 1, 2])
    conn.sendall(data)
    return conn


def read_message(conn: socket.socket, buffer: bytearray) -> dict | None:
    """One newline-terminated JSON message from ``conn`` (None at EOF)."""
    while b"\n" not in buffer:
        chunk = conn.recv(4096)
        if not chunk:
            return None
        buffer += chunk
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return json.loads(line)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
    while len(head) < _HEADER.size:
        head += conn.recv(_HEADER.size - len(head))
    (size,) = _HEADER.unpack(head)
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the client went away during its request")
        data += chunk
    return json.loads(data), fds


def _write_atomically(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)


def _run_rank(script: str, args: list[str], env: dict[str, str]) -> None:
    """In a forked rank: become ``python -u SCRIPT ARGS`` with ``env``, run, exit. Never returns."""
    os.setsid()  # as rank_launcher's ranks (torchrun's workers): a session of its own
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from megatron_diffckpt import cpu_mode

    os.environ.clear()
    os.environ.update(env)
    os.environ[cpu_mode._INHERITED] = "1"  # as cpu_mode.enable() sets it, for spawned helpers
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:  # what the interpreter does at exit: join non-daemon threads, run atexit
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _lead(request: dict, conn: socket.socket, go: int, server: int) -> None:
    """In a forked job leader: once the server says go (the job file is written), fork the
    ranks, supervise them, exit with the job's code. Never returns."""
    import psutil
    import rank_launcher

    os.setsid()
    # What the ranks leave (megatron's writer helpers) becomes the leader's, and goes with it.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    os.read(go, 1)
    os.close(go)
    nproc, script, args = request["nproc"], request["script"], request["args"]
    port, run_id = rank_launcher.free_port(), f"fork-{os.getpid()}"
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            conn.close()
            _run_rank(
                script, args, rank_launcher.rank_env(request["env"], rank, nproc, port, run_id)
            )
        pids.append(pid)
    ranks = [rank_launcher.ForkedRank(pid) for pid in pids]
    _write_atomically(request["job_file"] + ".ranks", " ".join(map(str, pids)))

    def abandoned() -> bool:  # the client was killed, or the session ended: kill the job
        if os.getppid() != server:
            return True
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and not conn.recv(1)

    code = 1
    try:
        code = rank_launcher.supervise(ranks, abandon=abandoned)
    finally:
        leftovers = psutil.Process().children(recursive=True)
        for p in leftovers:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(leftovers, timeout=30)
        os._exit(code)


def serve(sock_path: str) -> None:
    """The server's loop: accept clients, fork their job leaders, report their exits. Ends when
    the process that started it (the test session) is gone."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from megatron_diffckpt import cpu_mode

    cpu_mode.enable()
    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:
        raise RuntimeError(f"{threading.active_count()} threads after the imports: cannot fork")
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path + ".tmp")
    listener.listen(16)
    os.rename(sock_path + ".tmp", sock_path)  # clients connect only once it listens
    jobs: dict[int, tuple[socket.socket, str]] = {}
    while os.getppid() == parent:
        readable, _, _ = select.select([listener], [], [], 0.05)
        if readable:
            conn, _ = listener.accept()
            try:
                req, fds = _receive(conn)
            except (ConnectionError, OSError, ValueError):
                conn.close()
                continue
            req["job_file"] = job_file = f"{sock_path}.{req['client']}"
            go_read, go_write = os.pipe()
            server = os.getpid()
            pid = os.fork()
            if pid == 0:
                listener.close()
                os.close(go_write)
                for other, _ in jobs.values():
                    other.close()
                for target, fd in zip((0, 1, 2), fds, strict=True):
                    os.dup2(fd, target)
                    os.close(fd)
                os.chdir(req["cwd"])
                _lead(req, conn, go_read, server)
            os.close(go_read)
            for fd in fds:
                os.close(fd)
            _write_atomically(job_file, str(pid))
            os.write(go_write, b"1")
            os.close(go_write)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            jobs[pid] = (conn, job_file)
        while jobs:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid not in jobs:
                continue
            conn, job_file = jobs.pop(pid)
            try:
                conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode()
                             + b"\n")  # fmt: skip
            except OSError:
                pass  # the client is gone
            conn.close()
            for path in (job_file, job_file + ".ranks"):
                if os.path.exists(path):
                    os.unlink(path)
    # The session ended: the leaders see their parent gone and SIGKILL their ranks.


if __name__ == "__main__":
    serve(sys.argv[1])
