"""LowDiff+ against no checkpointing, stock megatron saves and PyTorch DCP, every iteration.

Run (from the repository root; ``make bench`` installs the plotting requirements first)::

    .venv/bin/python benchmarks/lowdiff_plus_overhead.py [--repeats 3] [--iters 20]

One invocation, the configurations interleaved round by round so that drift of the machine hits
them alike. Each trains the same uncompressed GPT (``MODEL`` of lowdiff_overhead.py, 2 processes,
the distributed optimizer with overlapped gradient reduction):

- ``none``: no checkpoints;
- ``plus``: ``--diffckpt-mode lowdiff-plus``, a recoverable state every iteration: bucket
  snapshots merged into the host replica, every merged step appended to the diff log (dense,
  exact), a base written from the replica every ``PLUS_BASE_INTERVAL`` iterations;
- ``plus_f1``: LowDiff+ writing a full base from the replica every iteration (no diff log);
- ``stock_sync`` / ``stock_async``: a stock megatron ``dist_checkpointing`` save every iteration;
- ``dcp_async``: PyTorch DCP ``async_save`` of the same state every iteration
  (``--ckpt-format torch_dcp --async-save``).

With PP = 2 (``none_pp2``, ``plus_pp2``) the same comparison reports the share of snapshot copy
time that fell inside pipeline bubbles (from the stages' traces).

An iteration's time is the whole loop body (train step, LowDiff+ hand-off, save), as the example
logs it. Per run: median and mean over the measured iterations (the first ``WARMUP`` and the last,
which ends with a save, are left out; the mean includes the iterations that write a base); per
configuration: the median over runs. Overhead is against ``none`` (``plus_pp2`` against
``none_pp2``). Peak host memory: the largest sum of the resident set sizes of all processes of a
run (torchrun, ranks, writer processes), sampled every 50 ms. LowDiff+'s direct cost on the
training path (flushes, slot waits, hand-off; logged per iteration as "diff time") is reported
too: a figure the run-to-run noise does not blur (it leaves out the background threads'
competition for the cores).

Results go to ``benchmarks/results/lowdiff_plus_overhead.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lowdiff_overhead import (  # noqa: E402
    MODEL,
    NOISE_FLOOR,
    NPROC,
    PRETRAIN_GPT,
    REPO,
    RESULTS,
    WARMUP,
    diff_times,
    folder_bytes,
    interleaved,
    iteration_times,
    measured,
)

PLUS_BASE_INTERVAL = 10
PP2 = ["--pipeline-model-parallel-size", "2"]


def configs(ckpt: str) -> dict[str, list[str]]:
    plus = ["--diffckpt-mode", "lowdiff-plus", "--save", ckpt]
    every = ["--save", ckpt, "--save-interval", "1"]
    return {
        "none": [],
        "plus": [*plus, "--diffckpt-full-interval", str(PLUS_BASE_INTERVAL)],
        "plus_f1": [*plus, "--diffckpt-full-interval", "1", "--diffckpt-plus-no-diff-log"],
        "stock_sync": every,
        "stock_async": [*every, "--async-save"],
        "dcp_async": [*every, "--ckpt-format", "torch_dcp", "--async-save"],
        "none_pp2": PP2,
        "plus_pp2": [*PP2, *plus, "--diffckpt-full-interval", str(PLUS_BASE_INTERVAL)],
    }


def run_sampled(args: list[str], log: Path) -> tuple[str, float]:
    """Train with ``args``; the rank-0 log and the peak summed RSS (bytes) of the process tree."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=os.environ.get("OMP", "1"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={NPROC}", str(PRETRAIN_GPT), *args]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    peak = 0
    done = threading.Event()

    def sample():
        nonlocal peak
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                tree = [root, *root.children(recursive=True)]
                total = 0
                for p in tree:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                peak = max(peak, total)
            except psutil.Error:
                pass
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate(timeout=1800)
    done.set()
    sampler.join()
    log.write_text(out)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed; see {log}")
    return out, peak


def _trace_summary(ckpt: Path) -> dict:
    """The stages' LowDiff+ traces: copy time, the part inside bubbles, per stage."""
    stages = {}
    for path in sorted((ckpt / "diffckpt" / "trace").glob("*.json")):
        stages[path.stem] = json.loads(path.read_text())["summary"]
    copy = sum(s["copy_seconds"] for s in stages.values())
    inside = sum(s["copy_seconds_in_bubbles"] for s in stages.values())
    return {"stages": stages, "share_in_bubbles": inside / copy if copy else 0.0}


def measure(work: Path, repeats: int, iters: int) -> dict:
    total = WARMUP + iters + 1
    names = list(configs(""))
    med: dict[str, list[float]] = {n: [] for n in names}
    mean: dict[str, list[float]] = {n: [] for n in names}
    direct: dict[str, list[float]] = {n: [] for n in names}
    peak: dict[str, list[int]] = {n: [] for n in names}
    extra: dict[str, dict] = {n: {} for n in names}
    for round_, name in interleaved(names, repeats):
        ckpt = work / f"ckpt_{name}"
        shutil.rmtree(ckpt, ignore_errors=True)
        args = [*MODEL, "--train-iters", str(total), *configs(str(ckpt))[name]]
        text, rss = run_sampled(args, work / f"{name}_{round_}.log")
        window = measured(iteration_times(text), total)
        med[name].append(statistics.median(window))
        mean[name].append(statistics.fmean(window))
        peak[name].append(rss)
        diffs = diff_times(text)
        if name.startswith("plus") and diffs:
            direct[name].append(statistics.median(measured(diffs, total)))
        print(
            f"round {round_ + 1}/{repeats} {name:12s} median {med[name][-1] * 1000:8.1f} ms "
            f"mean {mean[name][-1] * 1000:8.1f} ms peak RSS {rss / 2**20:7.0f} MiB",
            flush=True,
        )
        if round_ == 0 and name.startswith("plus"):
            extra[name] = {
                **_trace_summary(ckpt),
                "diff_log_bytes_per_iteration_per_rank": sum(
                    folder_bytes(d) for d in (ckpt / "diffckpt").glob("rank_*")
                )
                / NPROC
                / total,
            }
        if round_ == 0 and name in ("stock_sync", "dcp_async", "plus_f1"):
            one = sorted(ckpt.glob("iter_*"))[-1]
            extra[name]["checkpoint_bytes_per_rank"] = folder_bytes(one) / NPROC
    rows = {}
    for name in names:
        reference = "none_pp2" if name.endswith("pp2") else "none"
        ref_med, ref_mean = statistics.median(med[reference]), statistics.median(mean[reference])
        m, a = statistics.median(med[name]), statistics.median(mean[name])
        rows[name] = {
            "iteration_s": m,
            "iteration_mean_s": a,
            "runs_s": med[name],
            "overhead": m / ref_med - 1.0,
            "overhead_mean": a / ref_mean - 1.0,
            "peak_host_memory_bytes": statistics.median(peak[name]),
            **extra[name],
            **(
                {
                    "direct_s": statistics.median(direct[name]),
                    "direct_share": (statistics.median(direct[name]) / ref_med),
                }
                if direct[name]
                else {}
            ),
        }
    plus = rows["plus"]["overhead"]
    stock_best = min(rows[n]["overhead"] for n in ("stock_sync", "stock_async", "dcp_async"))
    summary = {
        "plus_overhead": plus,
        "plus_overhead_mean": rows["plus"]["overhead_mean"],
        "plus_direct_share": rows["plus"].get("direct_share"),
        "plus_f1_overhead": rows["plus_f1"]["overhead"],
        "best_stock_overhead": stock_best,
        "best_stock_over_plus": stock_best / max(plus, NOISE_FLOOR),
        "none_run_spread": (max(med["none"]) - min(med["none"])) / statistics.median(med["none"]),
        "plus_pp2_overhead": rows["plus_pp2"]["overhead"],
        "plus_pp2_share_in_bubbles": rows["plus_pp2"].get("share_in_bubbles"),
        "ratios_floor_plus_overhead_at": NOISE_FLOOR,
    }
    return {"rows": rows, "summary": summary}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [n for n in rows if not n.endswith("pp2")] + ["none_pp2", "plus_pp2"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = ["#888" if n.startswith("none") else "#2a7" if "plus" in n else "#c55" for n in names]
    ax1.bar(names, [rows[n]["overhead"] * 100 for n in names], color=colors)
    ax1.axhline(5, color="k", lw=0.8, ls="--")
    ax1.set_ylabel("overhead vs no checkpoint (%, median iteration)")
    ax1.set_title("checkpoint every iteration (recoverable state)")
    ax1.tick_params(axis="x", rotation=35)
    ax2.bar(names, [rows[n]["peak_host_memory_bytes"] / 2**30 for n in names], color=colors)
    ax2.set_ylabel("peak host memory of the run (GiB)")
    ax2.tick_params(axis="x", rotation=35)
    fig.suptitle(
        f"LowDiff+ on {result['machine']}; GPT {result['params_desc']}, 2 processes", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration")
    parser.add_argument("--iters", type=int, default=20, help="measured iterations per run")
    parser.add_argument("--work", type=str, default=None, help="scratch folder (default: temp)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="lowdiff_plus_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    measurements = measure(work, args.repeats, args.iters)
    result = {
        "command": "python benchmarks/lowdiff_plus_overhead.py "
        f"--repeats {args.repeats} --iters {args.iters}",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, no GPU"
        if not _cuda()
        else f"{platform.machine()}, GPU",
        "params_desc": _model_description(work),
        "model_args": MODEL,
        "plus_base_interval": PLUS_BASE_INTERVAL,
        **measurements,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "lowdiff_plus_overhead.json"
    out.write_text(json.dumps(result, indent=1))
    plot(result, RESULTS / "lowdiff_plus_overhead.png")
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {out}")
    return 0


def _model_description(work: Path) -> str:
    """The model as the first run's log describes it."""
    text = (work / "none_0.log").read_text()
    m = re.search(
        r"GPT: (\d+) layers, hidden (\d+), \d+ heads, seq (\d+);.*?(\d+) parameters", text
    )
    if not m:
        return "see model_args"
    layers, hidden, seq, params = m.groups()
    return f"{layers} layers, hidden {hidden}, seq {seq} ({int(params) / 1e6:.1f}M parameters)"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
