"""Faults until the job is done: 20 SIGKILLs a run, and the end equals an uninterrupted one.

A GPT job (2 processes, DP 2, bases every F = 5, B = 1, dense exchange) is started with the same
command again and again (``--load SAVE`` every time, as a requeued job is), and every attempt but
the last dies by SIGKILL. The first six faults are the first iterations' (no work lost from the
first iteration on): while base 0 is written as the job starts from scratch, then after iteration
1, 2, F-1, F and F+1 (or the iteration after the one the job had reached, where that is later),
each killing one rank or all, drawn. The other faults come at points drawn at random:

- ``iteration-one`` / ``iteration-all``: after iteration k is logged, one rank (the test kills
  the process whose ``RANK`` it is) or all ranks;
- ``base-one`` / ``base-all``: while a base is being written (its folder is getting files and the
  tracker does not name it yet), one rank or all;
- ``segment-write``: one rank, while a diff-log segment is in its ``.tmp`` file
  (fail point ``segment-write``, :mod:`megatron_diffckpt.failpoints`);
- ``replay``: one rank, in the middle of a recovery's replay (fail point ``replay``), drawn only
  when the previous attempt left differentials past the newest base;
- ``helper-one``: the helper processes of one rank (megatron's checkpoint writer machinery,
  an OOM kill's likely victim) once the iteration before a base is logged: the base then fails
  on that rank alone, and the attempt must end by itself within 60 s, every rank saying so in
  one line (:mod:`megatron_diffckpt.control`); LowDiff+, which writes its bases on threads,
  trains on (the attempt then ends as ``fallback``).

An attempt whose drawn point did not come within a few iterations is killed whole
(``fallback``). For each fault the test reports what the job had completed, where the next
attempt recovered to, and the iterations lost. A fault may lose what was not durable yet: the
batch being written and the ``--diffckpt-option max_pending`` batches that may wait for the writer,
(1 + max-pending) B iterations (LowDiff), or B + max-pending (LowDiff+, whose merger may lag by
its snapshot slots); while the writer keeps up, B (the report shows each fault's loss; on a
loaded 2-core machine the background writer has fallen 2 iterations behind). The final state
(parameters, main parameters, Adam moments, step) and losses must equal an uninterrupted run's
(``torch.equal``), and ``megatron-diffckpt verify`` must pass on the final checkpoint. The
draws come from a seed printed in the report; ``DIFFCKPT_FAULT_SEED=N`` replays a run's faults.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from launch import (
    PRETRAIN_GPT,
    REPO,
    RUN_TIMEOUT_S,
    TINY_GPT,
    assert_same_state,
    job_env,
    kill_tree,
    launch_command,
    load_dumps,
    rank_process,
    run_cli,
    uninterrupted_dumps,
)

from megatron_diffckpt import failpoints

FAULTS = 20
TOTAL = 120  # more than 20 attempts can reach: every attempt ends in a fault until the last
F = 5
B = 1
MAX_PENDING = 2
MODES = {"lowdiff": (1 + MAX_PENDING) * B, "lowdiff-plus": B + MAX_PENDING}  # one fault may lose
COMMON = [*TINY_GPT, "--use-distributed-optimizer", "--lr-decay-iters", "200"]
EARLY = ("first-base", 1, 2, F - 1, F, F + 1)  # the first faults' points, in this order
KINDS = ("iteration-one", "iteration-all", "base-one", "base-all", "segment-write", "replay",
         "helper-one")  # fmt: skip
STOP_WITHIN_S = 60.0  # helper-one: the attempt ends by itself within this (a hang detector)
FALLBACK_AFTER = 8  # iterations past the attempt's start after which an unmet point is dropped


@dataclass
class Plan:
    kind: str
    rank: int | None = None  # the rank killed (None: all)
    iteration: int = 0  # iteration-*: kill once this one is logged
    base: int = 0  # base-*: the base being written
    nth: int = 1  # fail points: the n-th hit
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Attempt:
    """What one start of the job printed, as the test follows it."""

    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    logged: list[int] = field(default_factory=list)
    target: int | None = None  # the iteration its recovery said it recovers to
    fired: str | None = None  # a fail point's line

    def follow(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if m := re.search(r"iteration +(\d+)/", line):
                self.logged.append(int(m.group(1)))
            elif m := re.search(r"recovering to iteration (\d+)", line):
                self.target = int(m.group(1))
            elif line.startswith("failpoint "):
                self.fired = line.strip()

    def tail(self) -> str:
        return "".join(self.lines[-40:])


def _start(job: list[str], env: dict[str, str]) -> Attempt:
    proc = subprocess.Popen(
        launch_command(2, PRETRAIN_GPT, job),
        cwd=REPO,
        env={**job_env(), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    attempt = Attempt(proc)
    threading.Thread(target=attempt.follow, daemon=True).start()
    return attempt


def _tracker(ckpt: Path) -> int:
    try:
        return int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    except (OSError, ValueError):
        return -1


def _base_being_written(ckpt: Path, base: int, since: float) -> bool:
    """Base ``base``'s folder is getting files in this attempt and is not published yet (a folder
    an earlier attempt left behind does not count until this one writes into it)."""
    folder = ckpt / f"iter_{base:07d}"
    try:
        fresh = any(p.stat().st_mtime >= since for p in folder.iterdir())
    except OSError:
        return False
    return fresh and _tracker(ckpt) < base


def _draw(rng: random.Random, kind: str, at: int, ckpt: Path) -> Plan:
    rank = rng.randrange(2)
    if kind == "iteration-one":
        return Plan(kind, rank, iteration=at + rng.randint(1, 4))
    if kind == "iteration-all":
        return Plan(kind, None, iteration=at + rng.randint(1, 4))
    if kind in ("base-one", "base-all"):
        return Plan(kind, rank if kind == "base-one" else None, base=(at // F + 1) * F)
    if kind == "helper-one":  # killed once the iteration before the next base is logged
        before_base = (at // F + 1) * F - 1
        return Plan(kind, rank, iteration=before_base if before_base > at else before_base + F)
    if kind == "segment-write":
        nth = rng.randint(1, 3)
        return Plan(kind, rank, nth=nth, env={failpoints.ENV: f"segment-write:{nth}@{rank}"})
    nth = rng.randint(1, max(1, at - max(_tracker(ckpt), 0) - 2))
    return Plan(kind, rank, nth=nth, env={failpoints.ENV: f"replay:{nth}@{rank}"})


def _early(rng: random.Random, point: str | int, at: int) -> Plan:
    """One of the first faults: base 0 while it is written, or after iteration ``point``."""
    rank = rng.choice((0, 1, None))
    one = "one" if rank is not None else "all"
    if point == "first-base":
        return Plan(f"base-{one}", rank, base=0)
    return Plan(f"iteration-{one}", rank, iteration=max(point, at + 1))


def _kill(attempt: Attempt, rank: int | None) -> None:
    """SIGKILL one rank (the launcher then stops the other) or every process of the attempt."""
    if rank is not None:
        try:
            rank_process(rank, attempt.proc.pid).kill()
            attempt.proc.wait(60)
        except (psutil.NoSuchProcess, AssertionError, subprocess.TimeoutExpired):
            pass  # it was ending anyway: the whole tree goes below
    kill_tree(attempt.proc)


def _run_to_fault(attempt: Attempt, plan: Plan, start: int, ckpt: Path, since: float) -> str:
    """Wait for the plan's point and kill there; returns how the attempt ended."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    helpers_killed: float | None = None
    while True:
        last = max(attempt.logged, default=start)
        if attempt.proc.poll() is not None:  # a fail point fired, the job stopped or ended
            kill_tree(attempt.proc)
            if helpers_killed is not None:  # it stopped by itself, every rank in one line
                said = [line for line in attempt.lines if line.rstrip().endswith("the job stops")]
                assert len(said) == 2, attempt.tail()
                return plan.kind
            return plan.kind if attempt.fired else f"exit {attempt.proc.returncode}"
        if plan.kind == "helper-one" and last >= plan.iteration and helpers_killed is None:
            for helper in rank_process(plan.rank, attempt.proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    helper.kill()
            helpers_killed = time.monotonic()
        if helpers_killed is not None:
            assert time.monotonic() - helpers_killed < STOP_WITHIN_S, "no stop:\n" + attempt.tail()
        if plan.kind.startswith("iteration") and last >= plan.iteration:
            _kill(attempt, plan.rank)
            return plan.kind
        if plan.kind.startswith("base") and _base_being_written(ckpt, plan.base, since):
            _kill(attempt, plan.rank)
            return plan.kind
        if last >= start + FALLBACK_AFTER:
            _kill(attempt, None)
            return "fallback"
        assert time.monotonic() < deadline, "the attempt never reached its point:\n" + (
            attempt.tail()
        )
        time.sleep(0.005)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    return uninterrupted_dumps(out, *COMMON, "--train-iters", str(TOTAL))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(MODES))
def test_twenty_random_sigkills_lose_at_most_b_and_end_exactly(
    tmp_path, mode, straight, fault_report
):
    seed = int(os.environ.get("DIFFCKPT_FAULT_SEED") or random.SystemRandom().randrange(10**6))
    rng = random.Random(seed)
    ckpt, dumps = tmp_path / "ckpt", tmp_path / "final"
    job = [*COMMON, "--train-iters", str(TOTAL), "--save", str(ckpt), "--load", str(ckpt),
           "--save-interval", str(F), "--diffckpt-mode", mode, "--diffckpt-batch-size", str(B),
           "--diffckpt-option", f"max_pending={MAX_PENDING}",
           "--dump-state", str(dumps)]  # fmt: skip
    # The first iterations' points; every kind once, in a random order (a replay once there is
    # one); then random draws.
    early = list(EARLY)
    order = list(KINDS)
    rng.shuffle(order)
    faults: list[tuple[str, str, int]] = []  # (how, who was killed, iteration the job reached)
    rows: list[tuple[int, str, str, int, int, int]] = []
    at = 0  # the newest iteration the job completed

    def table() -> str:  # reported whether the test passes or not, with the seed to replay it
        header = f"{'#':>3} {'fault':<14} {'killed':<7} {'reached':>7} {'recovered':>9} {'lost':>4}"
        lines = [f"{mode}: seed {seed}, {len(rows)} faults (DIFFCKPT_FAULT_SEED={seed} replays "
                 "them)", header]  # fmt: skip
        lines += [f"{n:>3} {k:<14} {w:<7} {r:>7} {c:>9} {x:>4}" for n, k, w, r, c, x in rows]
        if rows:
            lost = [row[-1] for row in rows]
            lines.append(f"lost per fault: max {max(lost)}, mean {sum(lost) / len(lost):.2f}")
        return "\n".join(lines)

    try:
        while True:
            if len(faults) >= FAULTS:
                plan = Plan("none")
            elif early:
                plan = _early(rng, early.pop(0), at)
            else:
                kind = order.pop() if order else rng.choice(KINDS)
                if kind == "replay" and at - max(_tracker(ckpt), 0) < 3:
                    # Nothing to replay yet: kill 3 or 4 iterations past a base, replay next.
                    order.append("replay")
                    past = next(k for k in range(at + 1, at + F + 1) if k % F >= 3)
                    plan = Plan("iteration-one", rng.randrange(2), iteration=past)
                else:
                    plan = _draw(rng, kind, at, ckpt)
            since = time.time()
            attempt = _start(job, plan.env)
            if plan.kind == "none":
                attempt.proc.wait(RUN_TIMEOUT_S)
                how = f"exit {attempt.proc.returncode}"
            else:
                how = _run_to_fault(attempt, plan, at, ckpt, since)
            # No base to load: a start from scratch. This closes the previous fault's row.
            recovered = attempt.target if attempt.target is not None else 0
            if faults:
                how_before, who, reached = faults[-1]
                rows.append((len(faults), how_before, who, reached, recovered, reached - recovered))
            if how.startswith("exit"):
                assert how == "exit 0" and plan.kind == "none", (
                    f"attempt with plan {plan} ended {how}:\n{attempt.tail()}"
                )
                break
            who = "all" if plan.rank is None or how == "fallback" else f"rank {plan.rank}"
            at = max(attempt.logged, default=recovered)
            if how.startswith("base"):  # its iteration is done; the log line follows the save
                at = max(at, plan.base)
            if how == "helper-one":  # the base after it failed: its iteration is done, unlogged
                at = max(at, plan.iteration + 1)
            faults.append((how, who, at))
    finally:
        fault_report(table())

    lost = [row[-1] for row in rows]
    assert len(rows) >= FAULTS
    assert rows[0][1].startswith("base") and rows[0][3] == 0, table()  # base 0 was being written
    early = zip(rows[1 : len(EARLY)], EARLY[1:], strict=True)
    assert all(row[3] >= point for row, point in early), table()  # each reached its point
    assert max(lost) <= MODES[mode], table()
    kinds = {row[1] for row in rows}
    assert {"segment-write", "replay"} <= kinds and kinds & {"base-one", "base-all"}, kinds
    final = load_dumps(dumps, 2)
    recovered_last = rows[-1][4]
    for rank in range(2):
        assert final[rank]["losses"] == straight[rank]["losses"][recovered_last:]
        assert_same_state(straight[rank], final[rank], rank)
    verify = run_cli("verify", str(ckpt))
    assert verify.returncode == 0, verify.stdout + verify.stderr
