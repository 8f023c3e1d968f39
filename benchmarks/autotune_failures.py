"""Fixed (F, B) settings against the auto-tuner, under injected failures with automatic restart.

Run (from the repository root; ``make bench`` runs it after the overhead benchmark)::

    .venv/bin/python benchmarks/autotune_failures.py [--iters 150] [--mtbf 45] [--seeds 2]

Each configuration trains the demo's GPT (2 processes, top-k 1% exchange, LowDiff differentials)
to ``--iters`` iterations. Failures arrive at exponentially distributed wall-clock times (mean
``--mtbf`` seconds, the clock running through restarts too): the whole job is killed with SIGKILL
(every process, as when a node dies) and started again at once with ``--load``, until it
finishes. Every configuration sees the same failure times (same seeds). Reported per
configuration: total wall time, failures, restarts, and the iterations recovered at each restart;
the auto-tuner gets ``--diffckpt-mtbf-hours`` equal to the injected rate, and starts from the
middle fixed setting.

Results go to ``benchmarks/results/autotune_failures.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
RUN_LOCAL = REPO / "examples" / "gpt" / "run_local.sh"
RESULTS = REPO / "benchmarks" / "results"

FIXED = [(5, 1), (20, 1), (60, 1), (20, 8)]
START = (20, 1)


def _kill_tree(proc: subprocess.Popen) -> None:
    victims = psutil.Process(proc.pid).children(recursive=True)
    for p in [*victims, psutil.Process(proc.pid)]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(60)
    psutil.wait_procs(victims, timeout=60)


def run_job(flags: list[str], ckpt: Path, iters: int, failures: list[float], log: Path) -> dict:
    """Train to ``iters`` iterations, killing the job at the wall times in ``failures``."""
    shutil.rmtree(ckpt, ignore_errors=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    pending = list(failures)
    restarts, recovered = 0, []
    with log.open("w") as out:
        while True:
            has_base = (ckpt / "latest_checkpointed_iteration.txt").exists()
            cmd = ["bash", str(RUN_LOCAL), "--train-iters", str(iters), "--log-interval", "5"]
            cmd += ["--lr-decay-iters", str(iters), "--save", str(ckpt), *flags]
            cmd += ["--load", str(ckpt)] if has_base else []
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)  # fmt: skip
            lines: list[str] = []
            reader = threading.Thread(target=lines.extend, args=(proc.stdout,), daemon=True)
            reader.start()
            killed = False
            while proc.poll() is None:
                now = time.perf_counter() - start
                if pending and now >= pending[0]:
                    pending.pop(0)
                    _kill_tree(proc)
                    killed = True
                    break
                time.sleep(0.05)
            reader.join(30)
            text = "".join(lines)
            out.write(text)
            m = re.search(r"recovered to iteration (\d+)", text)
            if m:
                recovered.append(int(m[1]))
            if not killed:
                if proc.returncode != 0:
                    raise SystemExit(f"{' '.join(cmd)} failed; see {log}")
                break
            restarts += 1
            # Failures that fell while the job was down count from the restart on.
            now = time.perf_counter() - start
            while pending and pending[0] <= now:
                pending.pop(0)
    return {
        "wall_s": time.perf_counter() - start,
        "failures": restarts,
        "recovered_to": recovered,
        "tune_decisions": re.findall(
            r"auto-tune at iteration \d+: F \d+ -> \d+, B \d+ -> \d+", log.read_text()
        ),  # fmt: skip
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=150)
    parser.add_argument("--mtbf", type=float, default=45.0, help="mean seconds between failures")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="autotune_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    common = ["--diffckpt-compressor", "topk", "--diffckpt-mode", "lowdiff", "--async-save"]
    configs = {
        f"F={f} B={b}": [*common, "--save-interval", str(f), "--diffckpt-batch-size", str(b)]
        for f, b in FIXED
    }
    configs["auto-tune"] = [
        *common,
        "--save-interval",
        str(START[0]),
        "--diffckpt-batch-size",
        str(START[1]),
        "--diffckpt-auto-tune",
        "--diffckpt-option",
        "retune_interval=10",
        "--diffckpt-mtbf-hours",
        str(args.mtbf / 3600.0),
    ]
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for seed in range(args.seeds):
        rng = random.Random(seed)
        failures, t = [], 0.0
        while t < 3600:
            t += rng.expovariate(1.0 / args.mtbf)
            failures.append(t)
        for name, flags in configs.items():
            tag = re.sub(r"\W+", "_", name)
            result = run_job(flags, work / f"ckpt_{tag}", args.iters, failures,
                             work / f"{tag}_{seed}.log")  # fmt: skip
            runs[name].append(result)
            print(
                f"seed {seed} {name:10s} {result['wall_s']:7.1f} s, {result['failures']} "
                f"failures, recovered to {result['recovered_to']}"
            )
    summary = {
        name: {
            "median_wall_s": statistics.median(r["wall_s"] for r in rs),
            "mean_failures": statistics.mean(r["failures"] for r in rs),
        }
        for name, rs in runs.items()
    }
    best_fixed = min(
        (n for n in summary if n != "auto-tune"), key=lambda n: summary[n]["median_wall_s"]
    )
    result = {
        "command": "python benchmarks/autotune_failures.py " + " ".join(sys.argv[1:]),
        "iterations": args.iters,
        "mtbf_s": args.mtbf,
        "seeds": args.seeds,
        "runs": runs,
        "summary": summary,
        "best_fixed": best_fixed,
        "auto_tune_over_best_fixed": summary["auto-tune"]["median_wall_s"]
        / summary[best_fixed]["median_wall_s"]
        - 1.0,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "autotune_failures.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, out.with_suffix(".png"))
    print(json.dumps(summary, indent=2))
    print(f"auto-tune vs best fixed ({best_fixed}): {result['auto_tune_over_best_fixed']:+.1%}")
    print(f"wrote {out} and {out.with_suffix('.png')} (logs in {work})")
    return 0


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["summary"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = ["tab:orange" if n == "auto-tune" else "tab:blue" for n in names]
    ax.bar(names, [result["summary"][n]["median_wall_s"] for n in names], color=colors)
    for i, n in enumerate(names):
        for r in result["runs"][n]:
            ax.plot(i, r["wall_s"], "k.", markersize=4)
    ax.set_ylabel("wall time to finish (s)")
    ax.set_title(f"{result['iterations']} iterations, failures every {result['mtbf_s']:g} s "
                 "on average (SIGKILL + restart)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
