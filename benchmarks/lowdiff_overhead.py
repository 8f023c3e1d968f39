"""LowDiff against no checkpointing and stock megatron saves, at per-iteration frequency.

Run (from the repository root; ``make bench`` installs the plotting requirements first)::

    .venv/bin/python benchmarks/lowdiff_overhead.py [--repeats 3] [--iters 20]

Everything runs in one invocation on the same machine, the configurations interleaved round by
round so that drift of the machine hits them alike. Each configuration trains the same GPT
(``MODEL`` below) on 2 processes (CPU with gloo when there is no GPU), the distributed optimizer
with overlapped gradient reduction:

- ``dense``: megatron's dense gradient reduction, no checkpoints;
- ``topk``: the top-k (1%) compressed exchange, no checkpoints: LowDiff's baseline;
- ``lowdiff_b1`` / ``lowdiff_b8``: ``topk`` with a differential every iteration, written in
  batches of 1 and 8 iterations;
- ``lowdiff_b8_keeper``: ``lowdiff_b8`` under the node launcher with the node's keeper, which
  holds every differential in memory that outlives the ranks (its cost: the hand-over);
- ``stock_sync`` / ``stock_async``: ``topk`` with a stock ``dist_checkpointing`` save (model,
  optimizer, residuals, RNG, scheduler) every iteration, synchronous and asynchronous.

An iteration's time is the whole loop body (train step, differential hand-off, save), as the
example logs it. Per run: the median over the measured iterations (the first ``WARMUP`` and the
last, which ends with a save, are left out); per configuration: the median over runs. Overhead is
against ``topk`` (for the ``dense`` row, the cost of compression is reported the same way).
The LowDiff rows also report the differential's own time on the training path (capture, record,
hand-off), measured inside the run: a direct figure that run-to-run noise does not blur (it does
not include the background writer's competition for the cores).

Bytes: the differential log's bytes per iteration and rank, against the compressed payload it
carries (the values and int32 indices of the sparse gradient shard, read back from the log); a
stock checkpoint's bytes per iteration and rank.

Recovery: a base at iteration 1 and N differentials after it; new processes load the base and
replay N differentials (the newest base of the run is withdrawn, as if the job died just before
publishing it). Reported: base load, log read and replay times against N.

Loss curves: ``dense``, top-k 10% and top-k 1% over a longer run of the demo's model on the
shipped corpus.

Sizes (``--sizes 13M,50M``, or ``--sizes-only`` to keep the rest of the JSON): the overhead rows
(``SWEEP_CONFIGS``) at the larger models of ``SIZES``, one interleaved run per size; the plot's
last panel shows how each row grows with the model (``3M`` is ``MODEL``, from the main rows).

Results go to ``benchmarks/results/lowdiff_overhead.json`` and ``.png``.
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megatron_diffckpt.storage.reader import list_segments, read_segment  # noqa: E402

PRETRAIN_GPT = REPO / "examples" / "gpt" / "pretrain_gpt.py"
LAUNCH = Path(sys.executable).parent / "megatron-diffckpt-launch"
KEEPER_MIB = "2048"  # the keeper's cap: it holds every record of the measured window
RESULTS = REPO / "benchmarks" / "results"
NPROC = 2
WARMUP = 3
RATIO = "0.01"

# DESIGN.md's calibration model with the example's byte-level vocabulary.
MODEL = (
    "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 "
    "--max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 8 "
    "--lr 1e-3 --lr-warmup-iters 2 --lr-decay-iters 1000 --use-distributed-optimizer "
    "--overlap-grad-reduce "
    "--log-interval 1"
).split()
# The demo's model, for the loss curves, at a learning rate where top-k with error feedback is
# stable (at the demo's 2e-3 the compressed runs spike and stall near the unigram loss).
DEMO_MODEL = (
    "--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 "
    "--max-position-embeddings 128 --micro-batch-size 8 --global-batch-size 16 "
    "--lr 5e-4 --min-lr 5e-5 --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.1 "
    "--clip-grad 1.0 --use-distributed-optimizer --overlap-grad-reduce --log-interval 1"
).split()


def model_at(hidden: int, micro_batch: int) -> list[str]:
    """``MODEL`` at another hidden size and micro-batch."""
    args = list(MODEL)
    args[args.index("--hidden-size") + 1] = str(hidden)
    args[args.index("--micro-batch-size") + 1] = str(micro_batch)
    args[args.index("--global-batch-size") + 1] = str(micro_batch * NPROC)
    return args


# The size sweep (this benchmark's ``--sizes`` and lowdiff_plus_overhead.py): name -> (model
# arguments, measured iterations per run, runs per configuration). ``3M`` is ``MODEL``. The
# largest size trains a smaller micro-batch (an iteration of about the 13M model's length), fewer
# iterations per run and fewer runs (``--repeats`` overrides the runs of every size).
SIZES = {
    "3M": (model_at(256, 4), 20, 2),
    "13M": (model_at(512, 4), 20, 3),
    "50M": (model_at(1024, 1), 10, 2),
}

TOPK = ["--diffckpt-compressor", "topk", "--diffckpt-topk-ratio", RATIO]
NO_BASES = "100000"  # --diffckpt-full-interval: no base inside the measured window


def configs(ckpt: str) -> dict[str, list[str]]:
    lowdiff = [*TOPK, "--diffckpt-mode", "lowdiff", "--save", ckpt]
    lowdiff += ["--diffckpt-full-interval", NO_BASES]
    stock = [*TOPK, "--save", ckpt, "--save-interval", "1"]
    return {
        "dense": [],
        "topk": TOPK,
        "lowdiff_b1": [*lowdiff, "--diffckpt-batch-size", "1"],
        "lowdiff_b8": [*lowdiff, "--diffckpt-batch-size", "8"],
        # run(keeper=True); the keeper holds the differentials and bases only
        "lowdiff_b8_keeper": [
            *lowdiff,
            "--diffckpt-batch-size",
            "8",
            "--diffckpt-option",
            "keeper_replica=false,keeper_writes_log=false",
        ],  # fmt: skip
        "stock_sync": stock,
        "stock_async": [*stock, "--async-save"],
    }


ITER_LINE = re.compile(
    r"iteration +(\d+)/ *\d+ \|.*elapsed time per iteration \(ms\): ([\d.]+) \|.*"
    r"lm loss: ([\d.E+-]+)"
)


def run(
    args: list[str],
    log: Path,
    keeper: bool = False,
    restarts: int = 0,
    env: dict[str, str] | None = None,
) -> tuple[str, float]:
    """Train with ``args`` on NPROC processes; the rank-0 log and the wall time. ``keeper``:
    under the node launcher with the node's keeper (``KEEPER_MIB``); ``restarts``: torchrun's
    ``--max-restarts``; ``env``: added to the environment."""
    env = dict(
        os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=os.environ.get("OMP", "1"), **(env or {})
    )
    if restarts:  # what the node launcher sets: a store per attempt (pytorch/pytorch#135712)
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    if keeper:
        cmd = [str(LAUNCH), "--keeper-memory", KEEPER_MIB]
        cmd += ["--standalone"]
    cmd += [f"--nproc-per-node={NPROC}", f"--max-restarts={restarts}", str(PRETRAIN_GPT), *args]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - start
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed; see {log}")
    return proc.stdout + proc.stderr, wall


def iteration_times(text: str) -> dict[int, float]:
    return {int(m[1]): float(m[2]) / 1000.0 for m in ITER_LINE.finditer(text)}


DIFF_TIME = re.compile(r"iteration +(\d+)/.*diff time \(ms\): ([\d.]+) \|")


def diff_times(text: str) -> dict[int, float]:
    """Per iteration: the differential's time on the training path (capture, record, hand-off)."""
    return {int(m[1]): float(m[2]) / 1000.0 for m in DIFF_TIME.finditer(text)}


def losses(text: str) -> dict[int, float]:
    return {int(m[1]): float(m[3]) for m in ITER_LINE.finditer(text)}


def diff_log_bytes(ckpt: Path, iters: int) -> dict[str, float]:
    """Per rank and iteration: bytes on disk, and the sparse-gradient payload inside them."""
    files, payload, ranks = 0, 0, 0
    for rank_dir in sorted((ckpt / "diffckpt").glob("rank_*")):
        ranks += 1
        for _, _, path in list_segments(str(rank_dir)):
            files += os.path.getsize(path)
            for record in read_segment(path).records:
                payload += sum(
                    t.numel() * t.element_size() for k, t in record.tensors.items() if ":" in k
                )
    return {
        "bytes_per_iteration_per_rank": files / ranks / iters,
        "payload_per_iteration_per_rank": payload / ranks / iters,
        "bytes_over_payload": files / payload,
    }


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def interleaved(names: list[str], repeats: int):
    """``(round, name)``: every configuration once per round, the order rotated each round and
    reversed every other round, so that drift of the machine hits them alike and no
    configuration always runs right after the same one (a run's cost can depend on what the
    previous run left behind: its deleted checkpoints' discards, the page cache)."""
    for round_ in range(repeats):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in reversed(order) if round_ % 2 else order:
            yield round_, name


def measured(per_iteration: dict[int, float], total: int) -> list[float]:
    """The measured window: after the warm-up, without the last iteration (it ends with a save)."""
    return [per_iteration[i] for i in range(WARMUP + 1, total)]


# At the sweep's larger sizes: the rows that show how LowDiff's cost grows, without the
# synchronous save (it costs what the asynchronous one does plus the wait).
SWEEP_CONFIGS = ("dense", "topk", "lowdiff_b1", "lowdiff_b8", "lowdiff_b8_keeper", "stock_async")


def measure_overhead(
    work: Path, repeats: int, iters: int, model: list[str] = MODEL, names: list[str] | None = None
) -> dict:
    total = WARMUP + iters + 1
    names = names or list(configs(""))
    per_run: dict[str, list[float]] = {n: [] for n in names}
    diff_run: dict[str, list[float]] = {n: [] for n in names}
    extra: dict[str, dict] = {}
    for round_, name in interleaved(names, repeats):
        ckpt = work / f"ckpt_{name}"
        shutil.rmtree(ckpt, ignore_errors=True)
        args = [*model, "--train-iters", str(total), *configs(str(ckpt))[name]]
        text, _ = run(args, work / f"{name}_{round_}.log", keeper=name.endswith("_keeper"))
        per_run[name].append(statistics.median(measured(iteration_times(text), total)))
        diffs = diff_times(text)
        if diffs:
            diff_run[name].append(statistics.median(measured(diffs, total)))
        print(f"round {round_ + 1}/{repeats} {name:12s} {per_run[name][-1] * 1000:8.1f} ms")
        if round_ == 0 and name.startswith("lowdiff"):
            extra[name] = diff_log_bytes(ckpt, total)
        if round_ == 0 and name.startswith("stock"):
            one = next(ckpt.glob("iter_*"))
            extra[name] = {"bytes_per_iteration_per_rank": folder_bytes(one) / NPROC}
    base = statistics.median(per_run["topk"])
    rows = {}
    for name in names:
        med = statistics.median(per_run[name])
        rows[name] = {
            "iteration_s": med,
            "runs_s": per_run[name],
            "overhead_vs_topk": med / base - 1.0,
            **extra.get(name, {}),
            **(
                {
                    "diff_time_s": statistics.median(diff_run[name]),
                    "diff_time_share": statistics.median(diff_run[name]) / base,
                }
                if diff_run[name]
                else {}
            ),
        }
    ld = rows["lowdiff_b1"]["overhead_vs_topk"]
    summary = {
        "lowdiff_b1_overhead": ld,
        "lowdiff_b8_overhead": rows["lowdiff_b8"]["overhead_vs_topk"],
        **(
            {
                "keeper_over_lowdiff_b8": rows["lowdiff_b8_keeper"]["iteration_s"]
                / rows["lowdiff_b8"]["iteration_s"]
                - 1.0,
                "keeper_diff_time_added_s": rows["lowdiff_b8_keeper"]["diff_time_s"]
                - rows["lowdiff_b8"]["diff_time_s"],
            }
            if "lowdiff_b8_keeper" in rows
            else {}
        ),
        "lowdiff_b1_diff_time_share": rows["lowdiff_b1"]["diff_time_share"],
        "topk_run_spread": (max(per_run["topk"]) - min(per_run["topk"])) / base,
        **(
            {"stock_sync_over_lowdiff_b1": _ratio(rows["stock_sync"]["overhead_vs_topk"], ld)}
            if "stock_sync" in rows
            else {}
        ),
        "stock_async_over_lowdiff_b1": _ratio(rows["stock_async"]["overhead_vs_topk"], ld),
        "compression_cost_dense_vs_topk": -rows["dense"]["overhead_vs_topk"],
        "ratios_floor_lowdiff_overhead_at": NOISE_FLOOR,
    }
    return {"rows": rows, "summary": summary}


# Run-to-run noise on a shared 2-core machine is several percent: an overhead below this floor
# is reported as measured, but ratios divide by the floor instead of by a number near zero.
NOISE_FLOOR = 0.01


def _ratio(a: float, b: float) -> float:
    """How many times overhead ``a`` is overhead ``b`` (``b`` floored at NOISE_FLOOR)."""
    return a / max(b, NOISE_FLOOR)


def measure_recovery(work: Path, counts: list[int]) -> list[dict]:
    ckpt = work / "ckpt_recovery"
    shutil.rmtree(ckpt, ignore_errors=True)
    n_max = max(counts)
    common = [*MODEL, *TOPK, "--train-iters", str(n_max + 1)]
    # Base at iteration 1, then n_max differentials; the run's closing base is withdrawn.
    run([*common, "--save", str(ckpt), "--exit-interval", "1"], work / "recovery_base.log")
    lowdiff = ["--diffckpt-mode", "lowdiff", "--save", str(ckpt), "--load", str(ckpt)]
    lowdiff += ["--diffckpt-full-interval", NO_BASES]
    run([*common, *lowdiff], work / "recovery_train.log")
    shutil.rmtree(ckpt / f"iter_{n_max + 1:07d}")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1")
    results = []
    for n in counts:
        copy = work / f"ckpt_recovery_{n}"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(ckpt, copy)
        for rank_dir in (copy / "diffckpt").glob("rank_*"):
            for first, _, path in list_segments(str(rank_dir)):
                if first > 1 + n:
                    os.remove(path)
        args = [*common, *lowdiff[:2], "--save", str(copy), "--load", str(copy)]
        args += ["--diffckpt-full-interval", NO_BASES, "--train-iters", "1"]
        text, wall = run(args, work / f"recovery_{n}.log")
        load = float(re.search(r"loaded checkpoint from .* in ([\d.]+) s", text)[1])
        m = re.search(r"read the diff log in ([\d.]+) s, replayed (\d+) differential", text)
        replay = float(re.search(r"replayed \d+ differential\(s\) in ([\d.]+) s", text)[1])
        assert int(m[2]) == n, (n, m[0])
        results.append(
            {
                "diffs": n,
                "base_load_s": load,
                "log_read_s": float(m[1]),
                "replay_s": replay,
                "restart_wall_s": wall,
            }
        )
        print(f"recovery with {n:3d} diffs: load {load:.3f} s, replay {replay:.3f} s")
        shutil.rmtree(copy)
    return results


def measure_loss_curves(work: Path, iters: int) -> dict[str, dict[int, float]]:
    curves = {}
    ten = ["--diffckpt-compressor", "topk", "--diffckpt-topk-ratio", "0.1"]
    for name, flags in {"dense": [], "topk 0.1": ten, f"topk {RATIO}": TOPK}.items():
        text, _ = run([*DEMO_MODEL, "--train-iters", str(iters), *flags], work / "curve.log")
        curves[name] = losses(text)
        print(f"loss curve {name}: {curves[name][1]:.3f} -> {curves[name][iters]:.3f}")
    return curves


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = {"3M": result["overhead"], **result.get("sizes", {})}
    fig, axes = plt.subplots(1, 5 if len(sizes) > 1 else 4, figsize=(26, 4.5))
    rows = result["overhead"]["rows"]
    names = list(rows)
    ax = axes[0]
    ax.bar(names, [rows[n]["iteration_s"] * 1000 for n in names], color="tab:blue")
    for i, n in enumerate(names):
        ax.text(i, rows[n]["iteration_s"] * 1000, f"{rows[n]['overhead_vs_topk']:+.1%}",
                ha="center", va="bottom", fontsize=8)  # fmt: skip
    ax.set_ylabel("median iteration time (ms)")
    ax.set_title("checkpoint every iteration (overhead vs topk)")
    ax.tick_params(axis="x", rotation=30)
    ax = axes[1]
    bars = {
        "LowDiff payload": rows["lowdiff_b1"]["payload_per_iteration_per_rank"],
        "LowDiff B=1 on disk": rows["lowdiff_b1"]["bytes_per_iteration_per_rank"],
        "LowDiff B=8 on disk": rows["lowdiff_b8"]["bytes_per_iteration_per_rank"],
        "stock save": rows["stock_sync"]["bytes_per_iteration_per_rank"],
    }
    ax.bar(list(bars), [v / 2**20 for v in bars.values()], color="tab:green")
    ax.set_yscale("log")
    ax.set_ylabel("MiB per iteration and rank")
    ax.set_title("bytes written")
    ax.tick_params(axis="x", rotation=30)
    ax = axes[2]
    rec = result["recovery"]
    n = [r["diffs"] for r in rec]
    ax.plot(n, [r["replay_s"] for r in rec], "o-", label="replay")
    ax.plot(n, [r["base_load_s"] + r["log_read_s"] + r["replay_s"] for r in rec], "s-",
            label="base load + log read + replay")  # fmt: skip
    ax.set_xlabel("differentials replayed")
    ax.set_ylabel("seconds")
    ax.set_title("recovery time")
    ax.legend()
    ax = axes[3]
    for name, curve in result["loss_curves"].items():
        its = sorted(curve)
        ax.plot(its, [curve[i] for i in its], label=name)
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title("training loss, shipped corpus")
    ax.legend()
    if len(sizes) > 1:
        ax = axes[4]
        names = [s for s in SIZES if s in sizes]
        lines = {
            "lowdiff_b1": "LowDiff B=1",
            "lowdiff_b8": "LowDiff B=8",
            "lowdiff_b8_keeper": "LowDiff B=8 + node's keeper",
            "stock_async": "stock async save",
            "dense": "dense exchange",
        }
        for row, label in lines.items():
            have = [n for n in names if row in sizes[n]["rows"]]
            overhead = [100 * sizes[n]["rows"][row]["overhead_vs_topk"] for n in have]
            ax.plot(have, overhead, "o-", label=label)
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_xlabel("model size (parameters)")
        ax.set_ylabel("overhead vs topk, no checkpoint (%)")
        ax.set_title("checkpoint every iteration, by model size")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def measure_sizes(work: Path, sizes: list[str], args: argparse.Namespace) -> dict:
    """The overhead rows at each of ``sizes`` (``SWEEP_CONFIGS``), one interleaved run each."""
    out = {}
    for size in sizes:
        model, iters, runs = SIZES[size]
        runs = args.size_repeats or runs
        started = time.time()
        (work / size).mkdir(parents=True, exist_ok=True)
        print(f"size {size}: {runs} run(s) of {', '.join(SWEEP_CONFIGS)}")
        sweep = measure_overhead(work / size, runs, iters, model, list(SWEEP_CONFIGS))
        out[size] = {
            "command": "python benchmarks/lowdiff_overhead.py " + " ".join(sys.argv[1:]),
            "model": " ".join(model),
            "measured_iterations": iters,
            "runs": runs,
            "minutes": (time.time() - started) / 60,
            **sweep,
        }
        print(json.dumps(sweep["summary"], indent=2))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration")
    parser.add_argument("--iters", type=int, default=20, help="measured iterations per run")
    parser.add_argument("--recovery-diffs", type=int, nargs="+", default=[0, 10, 20, 40])
    parser.add_argument("--curve-iters", type=int, default=120)
    parser.add_argument("--work", type=str, default=None, help="scratch folder (default: temp)")
    parser.add_argument(
        "--curves-only", action="store_true", help="redo the loss curves, keep the rest of the JSON"
    )
    parser.add_argument(
        "--sizes",
        default="",
        help=f"also the overhead at these larger model sizes, of {[s for s in SIZES][1:]} "
        f"(configurations {', '.join(SWEEP_CONFIGS)}; runs and iterations per size from SIZES)",
    )
    parser.add_argument(
        "--sizes-only", action="store_true", help="only --sizes, keep the rest of the JSON"
    )
    parser.add_argument(
        "--size-repeats", type=int, default=None, help="runs per configuration at --sizes"
    )
    args = parser.parse_args()
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES or s == "3M"]
    if unknown or (args.sizes_only and not sizes):
        parser.error(f"--sizes takes some of {list(SIZES)[1:]} (3M is MODEL), got {args.sizes!r}")
    work = Path(args.work or tempfile.mkdtemp(prefix="lowdiff_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    out = RESULTS / "lowdiff_overhead.json"
    if args.curves_only or args.sizes_only:
        result = json.loads(out.read_text())
        if args.curves_only:
            result["loss_curves"] = measure_loss_curves(work, args.curve_iters)
            result["loss_curves_command"] = "python benchmarks/lowdiff_overhead.py --curves-only"
        if sizes:
            result.setdefault("sizes", {}).update(measure_sizes(work, sizes, args))
        out.write_text(json.dumps(result, indent=2) + "\n")
        result["loss_curves"] = {
            k: {int(i): v for i, v in c.items()} for k, c in result["loss_curves"].items()
        }
        plot(result, RESULTS / "lowdiff_overhead.png")
        return 0
    result = {
        "command": "python benchmarks/lowdiff_overhead.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "model": " ".join(MODEL),
        "processes": NPROC,
        "topk_ratio": float(RATIO),
        "repeats": args.repeats,
        "measured_iterations": args.iters,
        "overhead": measure_overhead(work, args.repeats, args.iters),
        "recovery": measure_recovery(work, args.recovery_diffs),
        "loss_curves": measure_loss_curves(work, args.curve_iters),
    }
    if sizes:
        result["sizes"] = measure_sizes(work, sizes, args)
    result["wall_s"] = time.time() - started
    RESULTS.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "lowdiff_overhead.png")
    print(json.dumps(result["overhead"]["summary"], indent=2))
    print(f"wrote {out} and {out.with_suffix('.png')} (logs in {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
