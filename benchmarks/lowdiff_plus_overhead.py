"""LowDiff+ as the model grows: against no checkpointing, stock megatron saves and PyTorch DCP.

Run (from the repository root; ``make bench`` installs the plotting requirements first)::

    .venv/bin/python benchmarks/lowdiff_plus_overhead.py [--sizes 3M,13M,50M] [--repeats N]

One invocation per sweep; within each model size the configurations run interleaved round by
round, so that drift of the machine hits them alike. Each trains the same uncompressed GPT
(``SIZES`` of lowdiff_overhead.py: 4 layers, hidden 256 / 512 / 1024, about 3.3M / 12.9M /
50.9M parameters) on 2 processes (the distributed optimizer with overlapped gradient reduction):

- ``none``: no checkpoints;
- ``plus``: ``--diffckpt-mode lowdiff-plus``, a recoverable state every iteration: bucket
  snapshots merged into the host replica, every merged step appended to the diff log (dense,
  exact), a base written from the replica every ``PLUS_BASE_INTERVAL`` iterations;
- ``plus_buffered``: the same with the diff log written through the page cache
  (``--diffckpt-option buffered_io=true``) instead of direct I/O;
- ``plus_fused``: the same with ``--diffckpt-option replica_kernel=fused``: the replica steps
  with torch's fused CPU Adam (the host kernel of training on GPUs, where bit-identity cannot
  hold) and every base re-anchors it to the training state first;
- ``plus_nolog``: the same without the diff log (a recoverable state at every base only);
- ``plus_f1``: LowDiff+ writing a base from the replica every iteration (no diff log): what a
  base costs, side by side with
- ``stock_async`` (a stock megatron ``dist_checkpointing`` async save every iteration), and
  ``stock_sync`` / ``dcp_async`` (PyTorch DCP ``async_save``, ``--ckpt-format torch_dcp``) of the
  same state every iteration.

At ``3M``, PP = 2 too (``none_pp2``, ``plus_pp2``), with the share of snapshot copy time that
fell inside pipeline bubbles (from the stages' traces).

An iteration's time is the whole loop body (train step, LowDiff+ hand-off, save), as the example
logs it. Per run: median and mean over the measured iterations (the first ``WARMUP`` and the last,
which ends with a save, are left out; the mean includes the iterations that write a base); per
configuration: the median over runs. Overhead is against ``none`` (``plus_pp2`` against
``none_pp2``). From each LowDiff+ run (rank 0's trace): the CPU seconds per iteration of the
background work by activity (snapshot copy, merge step, diff-log record and write) beside the
training optimizer's own step (and every run's merge step against that step: one run's ratio
moves by a third or more, the summary takes the median), the CPU seconds per base by step, and
the host memory LowDiff+ holds (replica, persist copy, snapshot slots, host model parameters).
Host memory of a run: the peak of the summed proportional set sizes (PSS: pages shared between
processes, e.g. after a fork, counted once) of all its processes, sampled every second. Bytes
per iteration: the diff log's per rank, a checkpoint's per rank.

Results go to ``benchmarks/results/lowdiff_plus_overhead.json`` and ``.png``. ``--sizes`` with
some of the sizes measures those and keeps the others' rows from the JSON (each size records
the command that measured it).
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
    NOISE_FLOOR,
    NPROC,
    PRETRAIN_GPT,
    REPO,
    RESULTS,
    SIZES,
    WARMUP,
    diff_times,
    folder_bytes,
    interleaved,
    iteration_times,
    measured,
)

PLUS_BASE_INTERVAL = 10
PP2 = ["--pipeline-model-parallel-size", "2"]


def configs(ckpt: str, with_pp2: bool) -> dict[str, list[str]]:
    plus = ["--diffckpt-mode", "lowdiff-plus", "--save", ckpt]
    every = ["--save", ckpt, "--save-interval", "1"]
    bases = ["--diffckpt-full-interval", str(PLUS_BASE_INTERVAL)]
    names = {
        "none": [],
        "plus": [*plus, *bases],
        "plus_buffered": [*plus, *bases, "--diffckpt-option", "buffered_io=true"],
        "plus_fused": [*plus, *bases, "--diffckpt-option", "replica_kernel=fused"],
        "plus_nolog": [*plus, *bases, "--diffckpt-option", "diff_log=false"],
        "plus_f1": [*plus, "--diffckpt-full-interval", "1", "--diffckpt-option", "diff_log=false"],
        "stock_sync": every,
        "stock_async": [*every, "--async-save"],
        "dcp_async": [*every, "--ckpt-format", "torch_dcp", "--async-save"],
    }
    if with_pp2:
        names["none_pp2"] = PP2
        names["plus_pp2"] = [*PP2, *plus, *bases]
    return names


def run_sampled(args: list[str], log: Path) -> tuple[str, float]:
    """Train with ``args``; the rank-0 log and the peak summed PSS (bytes) of the process tree."""
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
                total = 0
                for p in [root, *root.children(recursive=True)]:
                    try:
                        total += p.memory_full_info().pss
                    except psutil.Error:
                        pass
                peak = max(peak, total)
            except psutil.Error:
                pass
            time.sleep(1.0)  # reading smaps costs about 10 ms per process: sample sparsely

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate(timeout=3600)
    done.set()
    sampler.join()
    log.write_text(out)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed; see {log}")
    return out, peak


def _traces(ckpt: Path) -> dict:
    """The stages' LowDiff+ traces: copy time inside bubbles; rank 0's CPU report."""
    stages = {}
    for path in sorted((ckpt / "diffckpt" / "trace").glob("*.json")):
        stages[path.stem] = json.loads(path.read_text())
    copy = sum(s["summary"]["copy_seconds"] for s in stages.values())
    inside = sum(s["summary"]["copy_seconds_in_bubbles"] for s in stages.values())
    first = stages[sorted(stages)[0]] if stages else {}
    return {"share_in_bubbles": inside / copy if copy else 0.0, "cpu": first.get("cpu", {})}


def measure(work: Path, size: str, repeats: int | None, with_pp2: bool) -> dict:
    model, iters, runs = SIZES[size]
    repeats = repeats or runs
    total = WARMUP + iters + 1
    names = list(configs("", with_pp2))
    med: dict[str, list[float]] = {n: [] for n in names}
    mean: dict[str, list[float]] = {n: [] for n in names}
    direct: dict[str, list[float]] = {n: [] for n in names}
    peak: dict[str, list[int]] = {n: [] for n in names}
    extra: dict[str, dict] = {n: {} for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for round_, name in interleaved(names, repeats):
        ckpt = work / f"ckpt_{size}_{name}"
        shutil.rmtree(ckpt, ignore_errors=True)
        args = [*model, "--train-iters", str(total), *configs(str(ckpt), with_pp2)[name]]
        text, pss = run_sampled(args, work / f"{size}_{name}_{round_}.log")
        window = measured(iteration_times(text), total)
        med[name].append(statistics.median(window))
        mean[name].append(statistics.fmean(window))
        peak[name].append(pss)
        diffs = diff_times(text)
        if name.startswith("plus") and diffs:
            direct[name].append(statistics.median(measured(diffs, total)))
        traces = _traces(ckpt) if name.startswith("plus") else {}
        if traces:  # each run's: one run's ratio moves by a third or more
            ratios[name].append(_merge_over_training(traces["cpu"]))
        print(
            f"{size} round {round_ + 1}/{repeats} {name:12s} median {med[name][-1] * 1000:8.1f} "
            f"ms mean {mean[name][-1] * 1000:8.1f} ms peak PSS {pss / 2**20:7.0f} MiB",
            flush=True,
        )
        if round_ == 0 and name.startswith("plus"):
            extra[name] = {
                **traces,
                "diff_log_bytes_per_iteration_per_rank": sum(
                    folder_bytes(d) for d in (ckpt / "diffckpt").glob("rank_*")
                )
                / NPROC
                / total,
            }
        if round_ == 0 and name in ("stock_sync", "dcp_async", "plus_f1"):
            one = sorted(ckpt.glob("iter_*"))[-1]
            extra[name]["checkpoint_bytes_per_rank"] = folder_bytes(one) / NPROC
        shutil.rmtree(ckpt, ignore_errors=True)
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
            **({"merge_over_training_runs": ratios[name]} if ratios[name] else {}),
            **(
                {
                    "direct_s": statistics.median(direct[name]),
                    "direct_share": statistics.median(direct[name]) / ref_med,
                }
                if direct[name]
                else {}
            ),
        }
    return {"rows": rows, "summary": _summary(rows, med), "params": _params(work, size)}


def _summary(rows: dict, med: dict) -> dict:
    plus, plus_mean = rows["plus"]["overhead"], rows["plus"]["overhead_mean"]
    dcp = rows["dcp_async"]["overhead"]
    summary = {
        "plus_overhead": plus,
        "plus_overhead_mean": plus_mean,
        "plus_nolog_overhead": rows["plus_nolog"]["overhead"],
        "plus_nolog_overhead_mean": rows["plus_nolog"]["overhead_mean"],
        "plus_direct_share": rows["plus"].get("direct_share"),
        "dcp_async_overhead": dcp,
        "dcp_async_over_plus": dcp / max(plus, NOISE_FLOOR),
        "dcp_async_over_plus_mean": dcp / max(plus_mean, NOISE_FLOOR),
        # A base every iteration: from the replica against a stock async save of the same state.
        "base_every_iteration_plus": rows["plus_f1"]["overhead"],
        "base_every_iteration_stock_async": rows["stock_async"]["overhead"],
        "base_from_replica_at_most_stock_async": rows["plus_f1"]["iteration_s"]
        <= rows["stock_async"]["iteration_s"],
        # the median over the runs with the diff log (where bit-identity is required)
        "merge_step_over_training_step": statistics.median(
            rows["plus"].get("merge_over_training_runs") or [0.0]
        ),
        # where it is not (the fused host kernel, anchored at every base)
        "merge_step_over_training_step_fused": statistics.median(
            rows["plus_fused"].get("merge_over_training_runs") or [0.0]
        ),
        "plus_fused_overhead": rows["plus_fused"]["overhead"],
        "plus_fused_overhead_mean": rows["plus_fused"]["overhead_mean"],
        "none_run_spread": (max(med["none"]) - min(med["none"])) / statistics.median(med["none"]),
        "ratios_floor_plus_overhead_at": NOISE_FLOOR,
    }
    if "plus_pp2" in rows:
        summary["plus_pp2_overhead"] = rows["plus_pp2"]["overhead"]
        summary["plus_pp2_share_in_bubbles"] = rows["plus_pp2"].get("share_in_bubbles")
    return summary


def _merge_over_training(cpu: dict) -> float:
    """A LowDiff+ run's merge step against the training optimizer's own step, in CPU time per
    iteration on rank 0 (its trace's ``cpu``)."""
    per_iteration = cpu.get("per_iteration_s", {})
    training = per_iteration.get("training optimizer step", 0.0)
    return per_iteration.get("merge step", 0.0) / training if training else 0.0


def _params(work: Path, size: str) -> int:
    """The model's parameter count, as the first run's log says."""
    text = (work / f"{size}_none_0.log").read_text()
    m = re.search(r"TP=1 PP=1 DP=\d+; (\d+) parameters", text)
    return int(m.group(1)) if m else 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(result["sizes"])
    params = [result["sizes"][s]["params"] / 1e6 for s in sizes]
    rows = {s: result["sizes"][s]["rows"] for s in sizes}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    lines = [
        ("plus", "LowDiff+ (diff log, base per 10)"),
        ("plus_buffered", "LowDiff+, diff log through the page cache"),
        ("plus_fused", "LowDiff+, fused host kernel"),
        ("plus_nolog", "LowDiff+ without diff log"),
        ("plus_f1", "LowDiff+ base every iteration"),
        ("stock_sync", "stock sync save"),
        ("stock_async", "stock async save"),
        ("dcp_async", "DCP async_save"),
    ]
    for key, ax, title in (
        ("overhead", axes[0][0], "median iteration"),
        ("overhead_mean", axes[0][1], "mean iteration (bases included)"),
    ):
        for name, label in lines:
            _line(ax, params, sizes, rows, name, lambda row, k=key: row[k] * 100, label)
        ax.axhline(0, color="k", lw=0.6)
        _size_axis(ax, params)
        ax.set_ylabel("overhead vs no checkpoint (%)")
        ax.set_title(f"a checkpoint every iteration: {title}")
    axes[0][0].legend(fontsize=7)
    ax = axes[1][0]
    acts = sorted({a for s in sizes for a in rows[s]["plus"]["cpu"].get("per_iteration_s", {})})
    width = 0.8 / max(1, len(acts))
    for i, act in enumerate(acts):
        ax.bar(
            [j + i * width for j in range(len(sizes))],
            [rows[s]["plus"]["cpu"]["per_iteration_s"].get(act, 0) * 1000 for s in sizes],
            width,
            label=act,
        )
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))])
    ax.set_xticklabels([f"{p:.1f}M" for p in params])
    ax.set_ylabel("CPU ms per iteration (rank 0)")
    ax.set_title("LowDiff+ work per iteration, beside the training optimizer's step")
    ax.legend(fontsize=7)
    ax = axes[1][1]
    for name, label in (("none", "no checkpoint"), *lines):
        _line(
            ax, params, sizes, rows, name, lambda row: row["peak_host_memory_bytes"] / 2**30, label
        )
    _size_axis(ax, params)
    ax.set_ylabel("peak host memory of the run (GiB, summed PSS)")
    ax.legend(fontsize=7)
    fig.suptitle(f"LowDiff+ as the model grows, {result['machine']}, 2 processes", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _line(ax, params: list[float], sizes: list[str], rows: dict, name: str, value, label: str):
    """``value(row)`` of configuration ``name`` over the sizes that measured it (one added
    later is missing from older sizes' rows)."""
    at = [(p, value(rows[s][name])) for p, s in zip(params, sizes, strict=True) if name in rows[s]]
    if at:
        ax.plot(*zip(*at, strict=True), "o-", label=label)


def _size_axis(ax, params: list[float]) -> None:
    """A log axis of model sizes, ticked at the measured ones."""
    ax.set_xscale("log")
    ax.set_xticks(params, [f"{p:.1f}M" for p in params])
    ax.minorticks_off()
    ax.set_xlabel("parameters")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help="model sizes, of " + str(SIZES))
    parser.add_argument("--repeats", type=int, default=None, help="runs per configuration")
    parser.add_argument("--work", type=str, default=None, help="scratch folder (default: temp)")
    parser.add_argument(
        "--out", type=str, default=str(RESULTS / "lowdiff_plus_overhead"), help="results stem"
    )
    parser.add_argument(
        "--plot-only", action="store_true", help="redraw the plot from the results JSON"
    )
    args = parser.parse_args()
    out = Path(args.out)
    if args.plot_only:
        plot(json.loads(out.with_suffix(".json").read_text()), out.with_suffix(".png"))
        return 0
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown sizes {unknown}; known: {list(SIZES)}")
    work = Path(args.work or tempfile.mkdtemp(prefix="lowdiff_plus_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/lowdiff_plus_overhead.py --sizes " + args.sizes
    command += f" --repeats {args.repeats}" if args.repeats else ""
    kept = {}
    if out.with_suffix(".json").exists() and set(sizes) != set(SIZES):
        before = json.loads(out.with_suffix(".json").read_text())
        kept = {
            s: {"command": before["command"], **rows}
            for s, rows in before["sizes"].items()
            if s not in sizes
        }
    result = {
        "command": command,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        + ("GPU" if _cuda() else "no GPU"),
        "plus_base_interval": PLUS_BASE_INTERVAL,
        "sizes": kept,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    for size in sizes:
        started = time.perf_counter()
        measured_size = measure(work, size, args.repeats, with_pp2=size == "3M")
        result["sizes"][size] = {
            "command": command,
            "model_args": SIZES[size][0],
            "measured_iterations": SIZES[size][1],
            "runs": args.repeats or SIZES[size][2],
            "minutes": (time.perf_counter() - started) / 60,
            **measured_size,
        }
        print(json.dumps({size: measured_size["summary"]}, indent=1), flush=True)
        result["sizes"] = {s: result["sizes"][s] for s in SIZES if s in result["sizes"]}
        out.with_suffix(".json").write_text(json.dumps(result, indent=1))  # after every size
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')}")
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
