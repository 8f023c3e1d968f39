"""Start the GPT example as real processes (gloo) and read back what it wrote.

Jobs start through :mod:`rank_launcher` (torchrun's single-node launch without its agent, which
imports torch before any rank starts), its ranks forked by the session's :mod:`fork_server`,
unless a test asks for ``torchrun=True``.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch
from rank_launcher import FORK_SERVER_ENV

from megatron_diffckpt.launch import is_resource_tracker

REPO = Path(__file__).resolve().parent.parent
PRETRAIN_GPT = REPO / "examples" / "gpt" / "pretrain_gpt.py"
# The node launcher as users run it: the console script the editable install put beside python.
LAUNCH = Path(sys.executable).parent / "megatron-diffckpt-launch"
# Under a keeper, --diffckpt-keeper auto gives LowDiff kept bases, a replica and the keeper's
# diff log; tests of one of those paths turn the others off.
KEPT_BASE_ONLY = ("--diffckpt-option", "keeper_replica=false,keeper_writes_log=false")
# A distributed run that hangs (an async-save worker error shows up as a hang) must fail the test.
RUN_TIMEOUT_S = 300

# A tiny GPT that still exercises dropout (so the RNG states must round-trip) and tied embeddings.
TINY_GPT = tuple(
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --lr-warmup-iters 2 "
    "--log-interval 1".split()
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


# In a rank's parent's command line: the launchers (the fork server's job leaders are forks of it).
LAUNCHERS = (
    "torch.distributed.run",
    "megatron_diffckpt.torchrun",
    "rank_launcher.py",
    "fork_server.py",
)
_fork_server: dict[str, str] = {}  # "socket": the session's fork server, once started


def _fork_server_socket() -> str | None:
    """The session's :mod:`fork_server`, started on first use (it ends with this process); None
    with ``DIFFCKPT_TEST_FORK_SERVER=0``."""
    if os.environ.get("DIFFCKPT_TEST_FORK_SERVER", "1") == "0":
        return None
    if "socket" not in _fork_server:
        folder = Path(tempfile.mkdtemp(prefix="diffckpt-fork-server-"))
        sock, log = folder / "socket", folder / "server.log"
        with open(log, "w") as out:
            server = subprocess.Popen(
                [sys.executable, "-u", str(Path(__file__).with_name("fork_server.py")), str(sock)],
                cwd=REPO, env=_env(), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
            )  # fmt: skip
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        atexit.register(server.kill)  # first (atexit runs last in, first out)
        deadline = time.monotonic() + 120
        while not sock.exists():
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise AssertionError("the fork server did not start:\n" + log.read_text()[-4000:])
            time.sleep(0.05)
        _fork_server["socket"] = str(sock)
    return _fork_server["socket"]


def job_env(torchrun: bool = False) -> dict[str, str]:
    """The environment of a job's launcher: with the fork server's socket, unless under
    torchrun."""
    env = _env()
    sock = None if torchrun else _fork_server_socket()
    if sock is not None:
        env[FORK_SERVER_ENV] = sock
    return env


def _leader_of(launcher_pid: int) -> int | None:
    """The fork server's job leader of the job whose launcher is ``launcher_pid`` (its ranks are
    the leader's children), or None."""
    sock = _fork_server.get("socket")
    try:
        return int(Path(f"{sock}.{launcher_pid}").read_text()) if sock else None
    except (OSError, ValueError):
        return None


def job_processes(launcher_pid: int) -> list[psutil.Process]:
    """Every process of the job whose launcher is ``launcher_pid``, the launcher excluded: its
    descendants, and where the fork server runs the job, the job leader and its descendants."""
    found = []
    for root, include in ((launcher_pid, False), (_leader_of(launcher_pid), True)):
        if root is None:
            continue
        try:
            p = psutil.Process(root)
            found += [p] * include + p.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    return found


def launch_command(nproc: int, script: Path, args, torchrun: bool = False) -> list[str]:
    """The command line of a job of ``nproc`` ranks of ``script``: under torchrun
    (``--standalone``) or :mod:`rank_launcher`; run it with :func:`job_env`."""
    if torchrun:
        launcher = ["-m", "torch.distributed.run", "--standalone"]
    else:
        launcher = [str(Path(__file__).with_name("rank_launcher.py"))]
    return [sys.executable, *launcher, f"--nproc-per-node={nproc}", str(script), *args]


def run_gpt(
    nproc: int, *args: str, check: bool = True, script: Path = PRETRAIN_GPT, torchrun: bool = False
) -> subprocess.CompletedProcess:
    """Run ``script`` (``pretrain_gpt.py``) on ``nproc`` CPU processes (under torchrun when
    ``torchrun``); output captured, bounded in time."""
    cmd = launch_command(nproc, script, args, torchrun)
    proc = subprocess.run(
        cmd, cwd=REPO, env=job_env(torchrun), capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- output tail ---\n"
            + (proc.stdout + proc.stderr)[-6000:]
        )
    return proc


def _rank_of(p: psutil.Process) -> int | None:
    try:
        return int(p.environ().get("RANK", ""))
    except (psutil.Error, ValueError):
        return None


def outliving_a_killed_rank(
    script: Path, args: list[str], ready: Callable[[], bool], helpers_at_work: bool = False
) -> list[str]:
    """Run ``script`` on 2 ranks under plain ``torchrun`` (not the node launcher, which reaps
    orphans itself) until ``ready()`` (and, with ``helpers_at_work``, until a helper of the
    rank with ``RANK=1`` has a process of its own: megatron-core 0.16's persistent checkpoint
    worker forking its file writers, 0.19's fork server and the worker it forked), SIGKILL that
    rank (found by its environment, not by its place in a process list), let torchrun stop the
    other rank and exit, wait 10 s: the command lines of the processes that ever ran below
    torchrun and are still alive (killed, so the machine stays clean for the next test), and the
    named semaphores (``sem.mp-*`` in /dev/shm) the job created and nothing removed (removed
    too)."""
    semaphores = set(Path("/dev/shm").glob("sem.mp-*"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    torchrun = subprocess.Popen(
        [*cmd, str(script), *args], cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    seen: dict[int, float] = {}  # pid -> create time, of every process ever below torchrun

    def look() -> None:
        for p in psutil.Process(torchrun.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                seen.setdefault(p.pid, p.create_time())

    def rank_1() -> psutil.Process | None:
        return next((p for p in psutil.Process(torchrun.pid).children() if _rank_of(p) == 1), None)

    def at_work() -> bool:  # a helper multiprocessing started (spawn, fork server) has a child
        rank = rank_1()
        with contextlib.suppress(psutil.Error):
            for helper in [] if rank is None else rank.children():
                line = " ".join(helper.cmdline())
                if "multiprocessing.spawn" in line or "multiprocessing.forkserver" in line:
                    if helper.children():
                        return True
        return False

    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while not (ready() and (not helpers_at_work or at_work())):
            assert torchrun.poll() is None, "training ended early"
            assert time.monotonic() < deadline, "training never got ready"
            look()
            time.sleep(0.005 if helpers_at_work else 0.02)
        look()
        rank_1().send_signal(signal.SIGKILL)
        torchrun.wait(RUN_TIMEOUT_S)
    finally:
        if torchrun.poll() is None:
            os.killpg(torchrun.pid, signal.SIGKILL)
    assert len(seen) > 2  # the ranks and at least one helper of megatron's writer
    time.sleep(10)
    alive = []
    for pid, created in seen.items():
        with contextlib.suppress(psutil.NoSuchProcess):
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(" ".join(p.cmdline())[:200])
                p.kill()
    left = sorted(set(Path("/dev/shm").glob("sem.mp-*")) - semaphores)
    for path in left:
        path.unlink(missing_ok=True)
    return alive + [str(path) for path in left]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``megatron-diffckpt ARGS``, by its ``main`` in this process (a new process would spend
    seconds importing torch; ``test_cli.py`` runs the command itself): its exit code and what it
    printed."""
    from megatron_diffckpt.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(
        ["megatron-diffckpt", *args], code, out.getvalue(), err.getvalue()
    )


def run_until_killed(
    args: list[str],
    kill_after: int | None = None,
    kill_when_exists: Path | list[Path] | None = None,
    script: Path = PRETRAIN_GPT,
) -> str:
    """Start a 2-process training; SIGKILL every process once ``kill_after`` iterations were
    logged and ``kill_when_exists`` (a path, or all of a list; a callable in the list is a
    condition that must hold) is on disk (either alone when the other is not given).
    Returns the output so far."""
    cmd = launch_command(2, script, args)
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reached = threading.Event()
    pattern = re.compile(rf"iteration +{kill_after}/") if kill_after is not None else None

    def follow():
        for line in proc.stdout:
            lines.append(line)
            if pattern is not None and pattern.search(line):
                reached.set()

    threading.Thread(target=follow, daemon=True).start()
    waited = kill_when_exists if isinstance(kill_when_exists, list) else [kill_when_exists]
    waited = [p for p in waited if p is not None]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while True:
            logged = pattern is None or reached.is_set()
            if logged and all(p() if callable(p) else p.exists() for p in waited):
                break
            assert proc.poll() is None, "training ended before the kill point:\n" + "".join(
                lines[-40:]
            )
            assert time.monotonic() < deadline, "training never reached the kill point:\n" + (
                "".join(lines[-40:])
            )
            time.sleep(0.005)
    finally:
        kill_tree(proc)
    return "".join(lines)


def tracker_at(ckpt: Path, iteration: int):
    """A condition for :func:`run_until_killed`: ``ckpt``'s tracker names ``iteration`` or a
    later base (a job from scratch publishes its base 0 first)."""
    tracker = ckpt / "latest_checkpointed_iteration.txt"

    def published() -> bool:
        try:
            return int(tracker.read_text()) >= iteration
        except (OSError, ValueError):
            return False

    return published


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process of its job (:func:`job_processes`), as a lost
    node loses them, but the ``multiprocessing`` resource trackers: they remove the named
    semaphores that the killed processes' queues (megatron's persistent checkpoint worker) left
    in /dev/shm, which a lost node loses with its memory, and end once those processes are
    gone."""
    victims = job_processes(proc.pid)  # empty when it ended by itself: the caller says why
    trackers = [p for p in victims if is_resource_tracker(p)]
    victims = [p for p in victims if p not in trackers]
    for p in victims:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:  # it ended in the meantime (a writer, a dying rank)
            pass
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    psutil.wait_procs(victims, timeout=30)
    _, alive = psutil.wait_procs(trackers, timeout=30)
    for p in alive:  # one still held open by a process outside the job
        p.kill()
    proc.stdout.close()


def rank_process(rank: int, launcher_pid: int | None = None) -> psutil.Process:
    """The training process of global ``rank``: one whose environment says ``RANK=rank`` and
    whose parent's does not (a process a rank forked shares its command line and environment);
    in the job of the launcher ``launcher_pid`` when given, else below any launcher."""
    sock = _fork_server.get("socket")
    if launcher_pid is not None and sock and os.path.exists(f"{sock}.{launcher_pid}.ranks"):
        # forked by the fork server, whose job leader lists its ranks' pids by rank
        pids = Path(f"{sock}.{launcher_pid}.ranks").read_text().split()
        return psutil.Process(int(pids[rank]))
    if launcher_pid is not None:
        candidates = job_processes(launcher_pid)
    else:
        candidates = [
            p
            for p in psutil.process_iter()
            if any(name in arg for arg in _cmdline(p.ppid()) for name in LAUNCHERS)
        ]
    found = []
    for p in candidates:
        try:
            if p.environ().get("RANK") == str(rank) and "RANK" not in p.parent().environ():
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
            continue  # gone, or its parent is (AttributeError: no parent)
    assert len(found) == 1, f"expected one process of rank {rank}, found {found}"
    return found[0]


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def run_script(
    *args: str, world_size: int = 1, script: Path = PRETRAIN_GPT
) -> subprocess.CompletedProcess:
    """Run ``script`` as one plain process: argument errors come before any rank starts."""
    env = _env()
    env["WORLD_SIZE"] = str(world_size)
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )


def assert_help_lists_every_flag(proc: subprocess.CompletedProcess) -> None:
    """``--help`` of a training entry exited 0 and shows every ``--diffckpt-*`` flag of
    :class:`~megatron_diffckpt.config.DiffCkptConfig`, each with its help."""
    from dataclasses import fields

    from megatron_diffckpt.config import DiffCkptConfig, flag_of

    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = proc.stdout.split("differential checkpointing (megatron-diffckpt):")[1]
    for f in fields(DiffCkptConfig):
        line = re.search(rf"^  {flag_of(f.name)}\b.*\n(.*)", shown, re.M)
        assert line is not None and line[0].split(maxsplit=2)[-1].strip(), f.name


def recovered_iteration(proc: subprocess.CompletedProcess) -> int:
    """The iteration a resumed run says it recovered to (``recovered to iteration N``)."""
    log = proc.stdout + proc.stderr
    m = re.search(r"recovered to iteration (\d+)", log)
    assert m, log[-3000:]
    return int(m.group(1))


def uninterrupted_dumps(out: Path, *args: str) -> list[dict]:
    """The final per-rank states (``--dump-state out``) of an uninterrupted 2-process run."""
    run_gpt(2, *args, "--dump-state", str(out))
    return load_dumps(out, 2)


def load_dumps(path: Path, nproc: int) -> list[dict]:
    """The per-rank states that ``--dump-state`` wrote."""
    return [torch.load(path / f"rank_{r}.pt", weights_only=True) for r in range(nproc)]


OPTIMIZER_STATE = ("main_param", "exp_avg", "exp_avg_sq", "step")


def assert_same_state(expected: dict, got: dict, rank: int) -> None:
    """Two ``--dump-state`` dumps of one rank hold bit-identical parameters and optimizer state
    (main params, exp_avg, exp_avg_sq, step): ``torch.equal``, tensor by tensor."""
    assert expected["params"].keys() == got["params"].keys()
    for name, value in expected["params"].items():
        assert torch.equal(value, got["params"][name]), f"rank {rank}: parameter {name}"
    assert len(expected["optimizer"]) == len(got["optimizer"]) > 0
    for i, (a, b) in enumerate(zip(expected["optimizer"], got["optimizer"], strict=True)):
        for key in OPTIMIZER_STATE:
            assert torch.equal(a[key], b[key]), f"rank {rank}: optimizer entry {i} {key}"


def launch_node(
    args: list[str],
    env: dict | None = None,
    keeper_memory: str | None = "64",
    script: Path = PRETRAIN_GPT,
    torchrun: tuple[str, ...] = (),
) -> tuple[subprocess.Popen, list[str]]:
    """``megatron-diffckpt-launch`` of 2 ranks of ``script`` with a keeper of
    ``keeper_memory`` MiB (``None``: none), one torchrun restart and torchrun's flags
    ``torchrun``; its output lines, followed."""
    keeper = ["--keeper-memory", keeper_memory] if keeper_memory else []
    cmd = [str(LAUNCH), *keeper, "--standalone", *torchrun]
    cmd += ["--nproc-per-node", "2", "--max-restarts", "1", str(script), *args]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []

    def follow():
        for line in proc.stdout:
            lines.append(line)

    threading.Thread(target=follow, daemon=True).start()
    return proc, lines


def wait_logged(lines: list[str], iteration: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not any(re.search(rf"iteration +{iteration}/", line) for line in lines):
        assert proc.poll() is None and time.monotonic() < deadline, job_failure(lines)
        time.sleep(0.01)


def job_failure(lines: list[str]) -> str:
    """What a job that ended early said: every rank's error lines (tracebacks and the lines
    after them), then its last 40 lines (torchrun's summary)."""
    said = [
        "".join(lines[i : i + 12])
        for i, line in enumerate(lines)
        if "Traceback" in line or re.search(r"\b\w*Error\b", line)
    ]
    return "".join(said[-8:]) + "\n--- last lines ---\n" + "".join(lines[-40:])


def last_logged(log: str) -> int:
    return max(int(i) for i in re.findall(r"iteration +(\d+)/", log))


def finish_node(proc: subprocess.Popen, lines: list[str]) -> str:
    try:
        assert proc.wait(RUN_TIMEOUT_S) == 0, "".join(lines[-60:])
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.2)  # the reader thread takes the last lines
    return "".join(lines)
