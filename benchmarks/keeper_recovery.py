"""Recovery by tier at about 13M parameters: from the node keepers' memory against storage,
for LowDiff+ (the keepers' replicas against base + dense diff log) and LowDiff (the keepers'
newest base and differentials against base + diff log), and what the keepers add to a
training iteration.

Run (from the repository root)::

    .venv/bin/python benchmarks/keeper_recovery.py [--repeats N] [--size 13M]

One invocation; the configurations run interleaved round by round (the order rotated), each on
2 processes (the distributed optimizer with overlapped reduction) training the same GPT
(``SIZES`` of lowdiff_overhead.py), bases every ``BASE_INTERVAL`` iterations:

- ``none``: no checkpoints;
- ``plus_bases``: LowDiff+ in the ranks, bases only (no diff log): the merger's work without
  the keepers, the reference for what the keepers add;
- ``plus_log``: LowDiff+ in the ranks with the dense diff log (today's per-iteration
  recoverability from storage);
- ``plus_keeper``: LowDiff+ with its replica and merger in the node's keeper
  (``--diffckpt-keeper auto`` under ``megatron-diffckpt-launch``), which also writes the dense
  diff log from its merges (per-iteration recoverability from storage too, as ``plus_log``);
- ``plus_keeper_bases``: the same without the diff log (``--diffckpt-option diff_log=false``: the
  keepers' memory and the bases only);
- ``plus_keeper_f1``: ``plus_keeper_bases`` with a base every iteration, its files written by
  the keepers (``--diffckpt-option keeper_writes_bases=true``); ``plus_keeper_f1_ranks``: the same
  written by the ranks (the default): what moving the writing out of the ranks costs or saves;
- ``lowdiff``: LowDiff (top-k exchange) with storage only, as without a keeper;
- ``lowdiff_keeper``: LowDiff under the node launcher: every differential and every base also
  in the node's keeper (``keeper_replica=false,keeper_writes_log=false``);
- ``lowdiff_keeper_replica``: the same with the keeper's replica: the keeper also steps a copy
  of the newest kept base with every differential, one behind;
- ``lowdiff_keeper_log``: ``lowdiff_keeper`` with the keepers writing the diff log instead of
  the ranks;
- ``lowdiff_keeper_auto``: LowDiff under the node launcher with ``--diffckpt-keeper auto``
  alone (kept bases, the keepers' replicas, the keepers writing the log);
- ``lowdiff_dense_keeper`` and ``lowdiff_dense_keeper_log``: the same two with the dense
  exchange (no compression: every record is the rank's whole gradient shard), where writing
  the log costs what it costs LowDiff+;
- ``lowdiff_strict`` and ``plus_log_strict``: ``lowdiff`` and ``plus_log`` with
  ``--diffckpt-when-full strict`` (training never more than B iterations ahead of the durable
  log): what the bound costs against the default ``block``.

LowDiff+'s end-of-run CPU line (per iteration, by activity: with its replica in the keeper,
the keeper's checksums of the replica after each step among them) is kept per run
(``cpu_ms``).

In ``plus_log`` and ``plus_keeper``, rank 1 is SIGKILLed before it hands iteration ``KILL_AT``
over (fail point ``plus-hand-over``); torchrun restarts both ranks, which recover the newest
iteration every rank has, ``KILL_AT - 1``: ``plus_log`` from storage (the base of
``BASE_INTERVAL`` loaded, the differentials after it read and replayed; the files are those the
killed job just wrote, so the page cache holds them: storage at its fastest), ``plus_keeper``
from the keepers (nothing read from storage, nothing replayed). In ``lowdiff``,
``lowdiff_keeper`` and ``lowdiff_keeper_replica`` rank 1 is SIGKILLed once it handed iteration
``KILL_AT - 1`` over (fail point ``iteration-end``), so all recover the same iteration:
``lowdiff`` from storage (base ``BASE_INTERVAL`` loaded, its differentials read and replayed),
``lowdiff_keeper`` from the keepers (their base of ``BASE_INTERVAL``, their differentials
replayed; nothing read from storage), ``lowdiff_keeper_replica`` from the keepers' replicas
(nothing read, nothing replayed); ``lowdiff`` reaches ``KILL_AT - 1`` only if the writer had
made it durable, else one iteration less (the iteration the keepers save). The recovery time is
the example's own ``recovered to iteration T in X s``: from before loading to ready to train.

Per-iteration time: the median over the first attempt's iterations after ``WARMUP``, without
those that write a base (with a base every iteration: all of them, and their mean too); per
configuration, the median over rounds. Results go to
``benchmarks/results/keeper_recovery.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lowdiff_overhead import (  # noqa: E402
    RESULTS,
    SIZES,
    TOPK,
    WARMUP,
    interleaved,
    iteration_times,
    run,
)

BASE_INTERVAL = 10
KILL_AT = 19  # rank 1 dies before handing this iteration over: both tiers recover KILL_AT - 1
TOTAL = 24
RECOVERED = re.compile(r"recovered to iteration (\d+) in ([\d.]+) s")


def configs(ckpt: str) -> dict[str, tuple[list[str], bool]]:
    """name -> (pretrain_gpt flags, under the node launcher with a keeper)."""
    saved = ["--diffckpt-mode", "lowdiff-plus", "--save", ckpt, "--load", ckpt]
    plus = [*saved, "--diffckpt-full-interval", str(BASE_INTERVAL)]
    no_log = ["--diffckpt-option", "diff_log=false"]
    plus_f1 = [*saved, "--diffckpt-full-interval", "1", *no_log]
    dense = ["--diffckpt-mode", "lowdiff", "--save", ckpt, "--load", ckpt]
    dense += ["--diffckpt-full-interval", str(BASE_INTERVAL)]
    lowdiff = [*TOPK, *dense]
    # under a keeper, --diffckpt-keeper auto gives LowDiff kept bases, the keeper's replica
    # and its writing of the log, and LowDiff+ its replica: each configuration names its own
    only_base = ["--diffckpt-option", "keeper_replica=false,keeper_writes_log=false"]
    replica = ["--diffckpt-option", "keeper_writes_log=false"]
    log = ["--diffckpt-option", "keeper_replica=false"]
    return {
        "none": ([], False),
        "plus_bases": ([*plus, *no_log], False),
        "plus_log": (plus, False),
        "plus_keeper": (plus, True),
        "plus_keeper_bases": ([*plus, *no_log], True),
        # a base every iteration (no diff log): its files written by the keepers, or by the ranks
        "plus_keeper_f1": ([*plus_f1, "--diffckpt-option", "keeper_writes_bases=true"], True),
        "plus_keeper_f1_ranks": (plus_f1, True),
        "lowdiff": (lowdiff, False),
        "lowdiff_keeper": ([*lowdiff, *only_base], True),
        "lowdiff_keeper_replica": ([*lowdiff, *replica], True),
        "lowdiff_keeper_log": ([*lowdiff, *log], True),
        "lowdiff_keeper_auto": (lowdiff, True),
        "lowdiff_dense_keeper": ([*dense, *only_base], True),
        "lowdiff_dense_keeper_log": ([*dense, *log], True),
        # --diffckpt-when-full strict (at most B iterations lost whatever the storage does)
        "lowdiff_strict": ([*lowdiff, *STRICT], False),
        "plus_log_strict": ([*plus, *STRICT], False),
    }


STRICT = ["--diffckpt-when-full", "strict"]
CPU_LINE = re.compile(r"LowDiff\+: CPU per iteration \(ms\): ([^;]*);")


EVERY_ITERATION = ("plus_keeper_f1", "plus_keeper_f1_ranks")  # every iteration writes a base

KILLED = {  # configuration -> the fail point that kills rank 1
    "plus_log": f"plus-hand-over:{KILL_AT}@1",
    "plus_keeper": f"plus-hand-over:{KILL_AT}@1",
    "lowdiff": f"iteration-end:{KILL_AT - 1}@1",
    "lowdiff_keeper": f"iteration-end:{KILL_AT - 1}@1",
    "lowdiff_keeper_replica": f"iteration-end:{KILL_AT - 1}@1",
    "lowdiff_keeper_log": f"iteration-end:{KILL_AT - 1}@1",
    "lowdiff_keeper_auto": f"iteration-end:{KILL_AT - 1}@1",
    "lowdiff_dense_keeper": f"iteration-end:{KILL_AT - 1}@1",
    "lowdiff_dense_keeper_log": f"iteration-end:{KILL_AT - 1}@1",
}


def _first_attempt(text: str) -> str:
    """The log up to the restarted attempt's recovery (the whole log when nothing restarted)."""
    cut = text.find("failpoint ")
    return text if cut < 0 else text[:cut]


def _recovery(text: str) -> dict:
    m = RECOVERED.search(text)
    if m is None:
        raise SystemExit("no recovery in the restarted attempt's log")
    out = {"iteration": int(m[1]), "seconds": float(m[2])}
    load = re.search(r"loaded checkpoint from .* in ([\d.]+) s", text)
    kept = re.search(r"recovery: base of iteration \d+ from the node's keeper in ([\d.]+) s", text)
    replay = re.search(r"recovery: (?:read the diff log in ([\d.]+) s, )?replayed (\d+) "
                       r"differential\(s\) in ([\d.]+) s", text)  # fmt: skip
    if load is not None:
        out["base_load_s"] = float(load[1])
    if kept is not None:
        out["kept_base_s"] = float(kept[1])
    if replay is not None:
        if replay[1] is not None:
            out["log_read_s"] = float(replay[1])
        out.update(replayed=int(replay[2]), replay_s=float(replay[3]))
    return out


def measure(work: Path, size: str, repeats: int, only: list[str] | None = None) -> dict:
    model = SIZES[size][0]
    runs: dict[str, list[dict]] = {name: [] for name in configs("") if not only or name in only}
    for round_, name in interleaved(list(runs), repeats):
        ckpt = work / f"ckpt_{name}"
        shutil.rmtree(ckpt, ignore_errors=True)
        flags, keeper = configs(str(ckpt))[name]
        env = {"DIFFCKPT_FAILPOINT": KILLED[name]} if name in KILLED else {}
        text, wall = run(
            [*model, "--train-iters", str(TOTAL), *flags],
            work / f"{name}_{round_}.log",
            keeper=keeper,
            restarts=1 if name in KILLED else 0,
            env=env,
        )
        times = iteration_times(_first_attempt(text))
        every = name in EVERY_ITERATION
        window = [
            t
            for i, t in times.items()
            if WARMUP < i < (TOTAL if every else KILL_AT - 1) and (every or i % BASE_INTERVAL)
        ]
        row = {"iteration_s": statistics.median(window), "iterations": len(window), "wall_s": wall}
        if every:
            row["iteration_mean_s"] = statistics.mean(window)
        if name in KILLED:
            row["recovery"] = _recovery(text[text.find("failpoint ") :])
        cpu = CPU_LINE.findall(text)  # the last attempt's: a killed one prints none
        if cpu:  # LowDiff+'s CPU per iteration by activity (the keeper's checksums among them)
            pairs = re.findall(r"([a-z][a-z +]*) ([\d.]+)", cpu[-1])
            row["cpu_ms"] = {k.strip(): float(v) for k, v in pairs}
        runs[name].append(row)
        print(f"round {round_} {name}: {row}", flush=True)
    med = {n: statistics.median(r["iteration_s"] for r in rs) for n, rs in runs.items()}
    rec = {
        n: statistics.median(r["recovery"]["seconds"] for r in runs[n]) for n in KILLED if n in runs
    }  # fmt: skip
    if only:  # a subset (an A/B of a few configurations): no summary across all of them
        return {"runs": runs, "iteration_s": med, "recovery_s": rec}
    return {
        "runs": runs,
        "iteration_s": med,
        "recovery_s": rec,
        "summary": {
            "storage_over_keeper_recovery": rec["plus_log"] / rec["plus_keeper"],
            "keeper_over_plus_bases": med["plus_keeper"] / med["plus_bases"] - 1.0,
            "keeper_over_none": med["plus_keeper"] / med["none"] - 1.0,
            # the keepers writing the log against the ranks writing it (both per-iteration
            # recoverable from storage)
            "keeper_over_plus_log": med["plus_keeper"] / med["plus_log"] - 1.0,
            "keeper_bases_over_none": med["plus_keeper_bases"] / med["none"] - 1.0,
            "plus_log_over_none": med["plus_log"] / med["none"] - 1.0,
            "plus_bases_over_none": med["plus_bases"] / med["none"] - 1.0,
            "lowdiff_storage_over_keeper_recovery": rec["lowdiff"] / rec["lowdiff_keeper"],
            "lowdiff_keeper_over_lowdiff": med["lowdiff_keeper"] / med["lowdiff"] - 1.0,
            "lowdiff_storage_over_replica_recovery": (
                rec["lowdiff"] / rec["lowdiff_keeper_replica"]
            ),
            "lowdiff_replica_over_lowdiff": (med["lowdiff_keeper_replica"] / med["lowdiff"] - 1.0),
            "lowdiff_over_none": med["lowdiff"] / med["none"] - 1.0,
            # LowDiff+: the same state from both tiers; LowDiff from storage: the iteration
            # its writer had made durable (the keepers hold every one handed over)
            "same_state": all(
                r["recovery"]["iteration"] == KILL_AT - 1
                for n in ("plus_log", "plus_keeper", "lowdiff_keeper", "lowdiff_keeper_replica")
                for r in runs[n]
            ),
            "lowdiff_storage_recovered": [r["recovery"]["iteration"] for r in runs["lowdiff"]],
            # a base every iteration: the keepers writing its files against the ranks
            "keeper_writes_f1_over_none": med["plus_keeper_f1"] / med["none"] - 1.0,
            "ranks_write_f1_over_none": med["plus_keeper_f1_ranks"] / med["none"] - 1.0,
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="rounds (runs per configuration)")
    parser.add_argument("--size", default="13M", choices=list(SIZES), help="the model size")
    parser.add_argument("--work", default=None, help="scratch folder (default: temp)")
    parser.add_argument(
        "--configs",
        default=None,
        help="only these configurations, comma-separated (results go to "
        "keeper_recovery_<names>.json, without the summary)",
    )
    args = parser.parse_args()
    only = args.configs.split(",") if args.configs else None
    unknown = set(only or []) - set(configs(""))
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}; known: {sorted(configs(''))}")
    work = Path(args.work or tempfile.mkdtemp(prefix="keeper_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    result = measure(work, args.size, args.repeats, only)
    result["setup"] = {
        "command": " ".join(["python", "benchmarks/keeper_recovery.py", *sys.argv[1:]]),
        "size": args.size,
        "model": SIZES[args.size][0],
        "base_interval": BASE_INTERVAL,
        "kill_at": KILL_AT,
        "train_iters": TOTAL,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "minutes": (time.time() - started) / 60.0,
    }
    name = "keeper_recovery" + "".join(f"_{n}" for n in only or [])
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    if only:
        print(f"iteration (median of run medians): {result['iteration_s']}; wrote {out}")
        return 0
    s = result["summary"]
    rec = result["recovery_s"]
    print(
        f"LowDiff+ recovery: storage {rec['plus_log']:.3f} s, keepers {rec['plus_keeper']:.3f} s "
        f"({s['storage_over_keeper_recovery']:.1f}x); iteration: keepers "
        f"{100 * s['keeper_over_plus_log']:+.1f}% over LowDiff+ in the ranks (both with the "
        f"diff log), {100 * s['keeper_over_none']:+.1f}% over none (without the log "
        f"{100 * s['keeper_bases_over_none']:+.1f}%)\n"
        f"LowDiff recovery: storage {rec['lowdiff']:.3f} s, keepers {rec['lowdiff_keeper']:.3f} s "
        f"({s['lowdiff_storage_over_keeper_recovery']:.1f}x); iteration: keepers "
        f"{100 * s['lowdiff_keeper_over_lowdiff']:+.1f}% over LowDiff without them; with the "
        f"keepers' replicas {rec['lowdiff_keeper_replica']:.3f} s "
        f"({s['lowdiff_storage_over_replica_recovery']:.1f}x), iteration "
        f"{100 * s['lowdiff_replica_over_lowdiff']:+.1f}%; wrote {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
