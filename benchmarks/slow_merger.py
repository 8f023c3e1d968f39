"""LowDiff+ on a host that cannot keep pace with training: what training pays for it.

Run (from the repository root)::

    .venv/bin/python benchmarks/slow_merger.py [--repeats N] [--delay SECONDS]

The 3M model of lowdiff_overhead.py (``MODEL``: 4 layers, hidden 256) on 2 processes; in every
LowDiff+ configuration but ``plus`` every merge on every rank first sleeps ``--delay`` seconds
(``DIFFCKPT_DELAY=merge:S``: a host that steps the replica that much slower than training runs
an iteration), configurations interleaved round by round:

- ``none``: no checkpoints;
- ``plus``: LowDiff+ with the diff log, a base every ``BASE_INTERVAL`` iterations, the merger
  not slowed (it keeps up);
- ``plus_slow``: the same with the slowed merger, by default: every iteration merged, training
  waits for the merger as long as it takes (it runs at the merger's pace);
- ``plus_slow_bounded``: the same with ``--diffckpt-option max_merge_wait_ms=BOUND_MS``: past
  the bound the merger skips to the next base, staged from the training state, while the diff
  log goes on;
- ``plus_slow_tuned``: ``--diffckpt-auto-tune`` (decisions every ``BASE_INTERVAL`` iterations,
  F at most ``BASE_INTERVAL``): the tuner bounds the wait at its first decision and drops the
  replica once the merges paused in two base intervals in a row.

An iteration's time is the whole loop body, as the example logs it. Per run: the mean over the
measured window (after ``WARMUP``, without the last iteration, which ends with a save) and over
its last ``TAIL`` iterations (after the tuner's decisions), and for ``plus_slow_tuned`` the
iteration its replica was dropped at. Per configuration: the median over runs, the overhead
against ``none``. Results go to ``benchmarks/results/slow_merger.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lowdiff_overhead import (  # noqa: E402
    MODEL,
    RESULTS,
    WARMUP,
    interleaved,
    iteration_times,
    measured,
    run,
)

BASE_INTERVAL = 10
BOUND_MS = 100
ITERS = 60  # measured iterations per run
TAIL = 20  # of them, the last: after the tuner's decisions
DROPPED = re.compile(r"auto-tune at iteration (\d+): LowDiff\+ drops its replica")


def configs(ckpt: str) -> dict[str, list[str]]:
    plus = ["--save", ckpt, "--diffckpt-mode", "lowdiff-plus"]
    fixed = [*plus, "--diffckpt-full-interval", str(BASE_INTERVAL)]
    tuned = [*plus, "--save-interval", str(BASE_INTERVAL), "--diffckpt-auto-tune"]
    tuned += ["--diffckpt-option", f"retune_interval={BASE_INTERVAL}"]
    tuned += ["--diffckpt-option", f"max_full_interval={BASE_INTERVAL}"]
    return {
        "none": [],
        "plus": fixed,
        "plus_slow": fixed,
        "plus_slow_bounded": [*fixed, "--diffckpt-option", f"max_merge_wait_ms={BOUND_MS}"],
        "plus_slow_tuned": tuned,
    }


def measure(work: Path, repeats: int, delay: float) -> dict:
    total = WARMUP + ITERS + 1
    names = list(configs(""))
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for round_, name in interleaved(names, repeats):
        ckpt = work / f"{name}_{round_}"
        args = [*MODEL, "--train-iters", str(total), *configs(str(ckpt))[name]]
        env = {"DIFFCKPT_DELAY": f"merge:{delay}"} if name.startswith("plus_slow") else {}
        text, _ = run(args, work / f"{name}_{round_}.log", env=env)
        window = measured(iteration_times(text), total)
        dropped = DROPPED.search(text)
        runs[name].append(
            {
                "mean_s": statistics.fmean(window),
                "tail_mean_s": statistics.fmean(window[-TAIL:]),
                "dropped_at": int(dropped[1]) if dropped else None,
            }
        )
        print(f"round {round_} {name}: {runs[name][-1]}", flush=True)
    rows = {}
    for name, per_run in runs.items():
        rows[name] = {
            "runs": per_run,
            "mean_s": statistics.median(r["mean_s"] for r in per_run),
            "tail_mean_s": statistics.median(r["tail_mean_s"] for r in per_run),
        }
    base = rows["none"]
    for row in rows.values():
        row["overhead"] = row["mean_s"] / base["mean_s"] - 1.0
        row["tail_overhead"] = row["tail_mean_s"] / base["tail_mean_s"] - 1.0
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration")
    parser.add_argument(
        "--delay", type=float, default=1.0, help="seconds every merge sleeps (the slowed host)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="slow-merger-") as work:
        rows = measure(Path(work), args.repeats, args.delay)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    result = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "commit": commit,
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "delay_s": args.delay,
        "base_interval": BASE_INTERVAL,
        "bound_ms": BOUND_MS,
        "iterations": ITERS,
        "tail": TAIL,
        "rows": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "slow_merger.json"
    out.write_text(json.dumps(result, indent=1))
    for name, row in rows.items():
        dropped = [r["dropped_at"] for r in row["runs"] if r["dropped_at"] is not None]
        print(
            f"{name:18s} {1000 * row['mean_s']:8.1f} ms {100 * row['overhead']:+7.1f}%  "
            f"last {TAIL}: {1000 * row['tail_mean_s']:8.1f} ms {100 * row['tail_overhead']:+7.1f}%"
            + (f"  replica dropped at {dropped}" if dropped else "")
        )
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
