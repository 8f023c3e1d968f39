"""``megatron-diffckpt``: inspect, verify, merge, export, prune checkpoints; plan at scale.

Exit codes a script can rely on: 0 all good; 1 damage found (``verify``), nothing recoverable
(``inspect``), or a merge or export that cannot be done as asked; 2 bad usage or not a checkpoint
folder.

No megatron import: it reads the folder layout, the tracker, the diff log and, for ``merge`` and
``export``, the checkpoints' tensors (:mod:`megatron_diffckpt.dist_ckpt_io`). ``tune`` runs
the cost model (:mod:`megatron_diffckpt.tuning`) on a job description
(:mod:`megatron_diffckpt.scale_plan`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass, field, fields

from megatron_diffckpt import retention
from megatron_diffckpt.autotune import Decision, describe_decision, read_decision
from megatron_diffckpt.checkpoint_layout import (
    COMPLETE_MARKER,
    TRACKER_FILENAME,
    CheckpointNotFoundError,
    find_latest_iteration,
    list_checkpoints,
)
from megatron_diffckpt.config import field_docs
from megatron_diffckpt.export import ExportError, export_base
from megatron_diffckpt.keeper.client import ENV as KEEPER_ENV
from megatron_diffckpt.keeper.client import query as keeper_query
from megatron_diffckpt.offline_merge import MergeError, merge_base
from megatron_diffckpt.progress import Progress
from megatron_diffckpt.scale_plan import (
    MERGE_BYTES,
    JobSpec,
    compare,
    expected_loss_hours,
    host_merge_s,
)
from megatron_diffckpt.storage.format import SegmentIdentity
from megatron_diffckpt.storage.reader import (
    list_rank_dirs,
    list_segments,
    read_run_info,
    read_segment,
    read_segment_header,
    scan_rank_log,
)


@dataclass
class RankReport:
    name: str
    segments: int = 0
    bytes: int = 0
    first: int | None = None
    last: int | None = None
    chain_end: int | None = None
    problems: list[str] = field(default_factory=list)


def _diff_dir(root: str, diff_dir: str | None) -> str:
    return diff_dir or os.path.join(root, "diffckpt")


def _rank_identity(rank_dir: str) -> SegmentIdentity | None:
    """The identity this rank's folder is expected to hold: that of its first readable header."""
    for _, _, path in list_segments(rank_dir):
        header = read_segment_header(path)
        if header is not None:
            return header.identity
    return None


def _report_rank(rank_dir: str, base: int | None) -> RankReport:
    report = RankReport(os.path.basename(rank_dir))
    segments = list_segments(rank_dir)
    report.segments = len(segments)
    report.bytes = sum(os.path.getsize(p) for _, _, p in segments)
    if segments:
        report.first, report.last = segments[0][0], segments[-1][1]
    identity = _rank_identity(rank_dir)
    if base is not None and identity is not None:
        scan = scan_rank_log(rank_dir, identity, base)
        report.chain_end = scan.last_iteration
        report.problems = scan.problems
    return report


def _plus_traces(diff_dir: str) -> dict[str, dict]:
    """LowDiff+: each rank's summary of its last run's stage trace (copy time, bubbles)."""
    folder = os.path.join(diff_dir, "trace")
    traces = {}
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            try:
                with open(os.path.join(folder, name)) as f:
                    traces[name.removesuffix(".json")] = json.load(f)["summary"]
            except (OSError, ValueError, KeyError):
                continue
    return traces


def inspect_dir(root: str, diff_dir: str | None = None) -> dict:
    """Bases, per-rank diff ranges and bytes, and the recoverable iteration T. Any process."""
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"{root}: no such directory")
    try:
        latest = find_latest_iteration(root)
    except CheckpointNotFoundError:
        latest = None
    ddir = _diff_dir(root, diff_dir)
    ranks = [_report_rank(os.path.join(ddir, name), latest) for name in list_rank_dirs(ddir)]
    ends = [r.chain_end for r in ranks if r.chain_end is not None]
    recoverable = min(ends) if ends and len(ends) == len(ranks) else latest
    decision = read_decision(ddir)  # --diffckpt-auto-tune's newest, for a restart
    return {
        "root": root,
        "mode": read_run_info(ddir).get("mode"),
        "lowdiff_plus_traces": _plus_traces(ddir),
        "latest_base": latest,
        "bases": [{"iteration": i, "complete": c} for i, c in list_checkpoints(root)],
        "diff_log": ddir if os.path.isdir(ddir) else None,
        "ranks": [r.__dict__ for r in ranks],
        "recoverable_iteration": recoverable,
        "diff_bytes": sum(r.bytes for r in ranks),
        "auto_tune": None if decision is None else asdict(decision),
    }


def verify_dir(root: str, diff_dir: str | None = None) -> tuple[list[str], list[str]]:
    """``(problems, notes)``: damaged or foreign segments, a tracker naming an incomplete base;
    and incomplete bases that nothing points at (left by an interrupted save). Any process."""
    problems, notes = [], []
    try:
        find_latest_iteration(root)
    except CheckpointNotFoundError as exc:
        problems.append(str(exc))
    for iteration, complete in list_checkpoints(root):
        if not complete:
            notes.append(
                f"iter_{iteration:07d}: incomplete (no {COMPLETE_MARKER}), left by an interrupted "
                "save; never loaded"
            )
    ddir = _diff_dir(root, diff_dir)
    if not os.path.isdir(ddir):
        return problems, notes
    for name in list_rank_dirs(ddir):
        rank_dir = os.path.join(ddir, name)
        identity = _rank_identity(rank_dir)
        for _, _, path in list_segments(rank_dir):
            scan = read_segment(path, identity)
            if scan.error is not None:
                problems.append(f"{name}/{os.path.basename(path)}: {scan.error}")
    return problems, notes


def _keeper_info(path: str) -> dict:
    """What the keeper at ``path`` holds, or why it could not be asked."""
    try:
        return {"socket": path, **keeper_query(path)}
    except (OSError, ConnectionError, ValueError) as exc:
        return {"socket": path, "error": str(exc)}


def _print_keeper(k: dict) -> None:
    if "error" in k:
        print(f"keeper {k['socket']}: not reachable ({k['error']})")
        return
    held = (k["bytes"] + k.get("reserved", 0)) / 2**20
    print(
        f"keeper {k['socket']}: {k['records']} record(s) of {k['ranks']} rank(s), "
        f"{len(k.get('replicas', []))} replica(s), {len(k.get('bases', []))} "
        f"LowDiff base(s), {held:.1f} of "
        f"{k['memory'] / 2**20:.1f} MiB, {k['evicted']} evicted"
    )
    ring = k.get("peer")
    if ring is not None:  # --keeper-peers
        print(
            f"  ring: copies to the keeper of node {ring['successor']}; waiting "
            f"{ring['waiting']} message(s), {ring['waiting_heap'] / 2**20:.1f} MiB in memory and "
            f"{ring['waiting_files'] / 2**20:.1f} MiB in shared memory; {ring['dropped']} dropped"
        )
    for c in k["chains"]:
        print(
            f"  rank_{c['tp_rank']}_{c['pp_rank']}_{c['dp_rank']}: iterations "
            f"{c['first']}-{c['last']}, {c['bytes']} bytes (run {c['run_id'][:8]})"
        )
    for r in k.get("replicas", []):
        also = f", holds the input of {r['held']}" if r["held"] is not None else ""
        if r.get("logged_only") is not None:  # max_merge_wait_ms: merges skipped to the next base
            also += f", merges paused until the next base (logged to {r['logged_only']})"
        if r.get("durable") is not None:  # the diff log the keeper writes for the rank
            also += f", its diff log durable to {r['durable']}"
        print(
            f"  rank_{r['tp_rank']}_{r['pp_rank']}_{r['dp_rank']}: {r['system']} replica at "
            f"iteration {r['merged']}{also}, {r['bytes'] / 2**20:.1f} MiB (run {r['run_id'][:8]})"
        )

    for b in k.get("bases", []):
        kind = "copy of the previous node's LowDiff base" if b.get("copy") else "LowDiff base"
        print(
            f"  rank_{b['tp_rank']}_{b['pp_rank']}_{b['dp_rank']}: {kind} of iteration "
            f"{b['iteration']}, {b['bytes'] / 2**20:.1f} MiB (run {b['run_id'][:8]})"
        )
    for g in k.get("logs", []):  # LowDiff's logs the keeper writes (option keeper_writes_log)
        print(
            f"  rank_{g['tp_rank']}_{g['pp_rank']}_{g['dp_rank']}: diff log written here, "
            f"durable to {g['durable']}, {g['segments']} segment(s), "
            f"{g['bytes_written'] / 2**20:.1f} MiB (run {g['run_id'][:8]})"
        )
    for w in k.get("writes", []):  # LowDiff+ bases whose files the keeper wrote for the rank
        print(
            f"  rank_{w['tp_rank']}_{w['pp_rank']}_{w['dp_rank']}: {w['writes']} base(s) written "
            f"here, the last in {w['last_s']:.3f} s, from {w['files_mib']:.1f} MiB of the "
            f"rank's files (run {w['run_id'][:8]})"
        )


def _print_inspect(info: dict) -> None:
    print(f"checkpoint folder: {info['root']}")
    if info["mode"]:
        print(f"written with --diffckpt-mode {info['mode']}")
    print(f"latest base (tracker {TRACKER_FILENAME}): {info['latest_base']}")
    for b in info["bases"]:
        state = "complete" if b["complete"] else "INCOMPLETE"
        print(f"  base iter_{b['iteration']:07d}: {state}")
    print(f"diff log: {info['diff_log'] or 'none'} ({info['diff_bytes']} bytes)")
    for r in info["ranks"]:
        span = f"{r['first']}-{r['last']}" if r["segments"] else "empty"
        print(
            f"  {r['name']}: {r['segments']} segment(s), iterations {span}, {r['bytes']} bytes, "
            f"chain from the latest base reaches {r['chain_end']}"
        )
        for p in r["problems"]:
            print(f"    ! {p}")
    for name, t in info["lowdiff_plus_traces"].items():
        print(
            f"  LowDiff+ {name}: last {t['iterations']} iteration(s) traced, snapshot copies "
            f"{t['copy_seconds'] * 1000:.1f} ms, {100 * t['share_in_bubbles']:.0f}% inside "
            "pipeline bubbles"
        )
    print(f"recoverable iteration T: {info['recoverable_iteration']}")
    if info["auto_tune"] is not None:
        print(f"auto-tune decision: {describe_decision(Decision(**info['auto_tune']))}")
    if "keeper" in info:
        _print_keeper(info["keeper"])


def _export(args: argparse.Namespace) -> int:
    iteration = args.iteration
    if iteration is None:
        try:
            iteration = find_latest_iteration(args.dir)
        except CheckpointNotFoundError as exc:
            print(f"megatron-diffckpt export: {exc}", file=sys.stderr)
            return 1
    try:
        summary = export_base(args.dir, iteration, args.out, progress=not args.quiet)
    except ExportError as exc:
        print(f"megatron-diffckpt export: {exc}", file=sys.stderr)
        return 1
    print(
        f"exported base {summary['iteration']} ({summary['entries']} entries, "
        f"{summary['tensor_bytes'] / 1e6:.1f} MB of tensors) to {summary['out']} "
        f"in {summary['seconds']:.1f} s"
    )
    return 0


def _merge(args: argparse.Namespace) -> int:
    try:
        summary = merge_base(
            args.dir,
            args.out,
            args.iteration,
            args.diff_dir,
            progress=not args.quiet,
            reshardable=args.reshardable,
        )
    except MergeError as exc:
        print(f"megatron-diffckpt merge: {exc}", file=sys.stderr)
        return 1
    for problem in summary["problems"]:
        print(f"note: {problem}")
    print(
        f"merged base {summary['base']} and {summary['differentials']} differential(s) of "
        f"{summary['ranks']} rank(s) into {summary['out']} (iteration {summary['iteration']}, "
        f"optimizer format {summary['format']}"
        + (": loads under any TP / PP / DP)" if args.reshardable else ")")
    )
    return 0


def _prune(args: argparse.Namespace) -> int:
    if args.keep < 1:
        print("megatron-diffckpt prune: --keep must be >= 1", file=sys.stderr)
        return 2
    ddir = _diff_dir(args.dir, args.diff_dir)
    rank_dirs = [os.path.join(ddir, n) for n in list_rank_dirs(ddir)]
    bases = retention.bases_to_prune(args.dir, args.keep)
    segments = [s for d in rank_dirs for s in retention.segments_to_prune(args.dir, d, args.keep)]
    freed = sum(_tree_bytes(p) for p in bases + segments)
    verb = "would remove" if args.dry_run else "removed"
    if not args.dry_run:
        bar = Progress("prune", len(bases) + len(segments), "paths", stream=sys.stderr)
        for path in bases:
            shutil.rmtree(path)
            bar.update()
        for path in segments:
            os.remove(path)
            bar.update()
        bar.close()
    for path in bases + segments:
        print(f"{verb} {os.path.relpath(path, args.dir)}")
    print(
        f"{verb} {len(bases)} base(s) and {len(segments)} segment(s), {freed / 1e6:.1f} MB; "
        f"keeping the newest {args.keep} complete base(s)"
    )
    return 0


def _tree_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


GPU_SWEEP = (8, 32, 128, 512, 2048, 8192, 16384)


def _add_tune_parser(sub) -> None:
    p = sub.add_parser("tune", help="at-scale plan: F, B and overhead of LowDiff, LowDiff+, full")
    docs = field_docs(JobSpec)
    for f in fields(JobSpec):
        p.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=type(f.default),
            default=f.default,
            help=f"{docs.get(f.name, '')} (default {f.default:g})",
        )
    p.add_argument("--train-days", type=float, default=54.0, help="failure-free training time")
    p.add_argument("--sweep", action="store_true", help=f"also plan for {GPU_SWEEP} GPUs")
    p.add_argument("--plot", default=None, help="write the sweep's plot to this PNG")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _tune(args: argparse.Namespace) -> int:
    spec = {f.name: getattr(args, f.name) for f in fields(JobSpec)}
    try:
        jobs = [JobSpec(**spec)]
        if args.sweep or args.plot:
            jobs += [
                JobSpec(**{**spec, "gpus": g})
                for g in GPU_SWEEP
                if g != args.gpus and g % (args.tensor_parallel * args.pipeline_parallel) == 0
            ]
    except ValueError as exc:
        print(f"megatron-diffckpt tune: {exc}", file=sys.stderr)
        return 2
    jobs.sort(key=lambda j: j.gpus)
    hours = args.train_days * 24.0
    rows = []
    for job in jobs:
        for strategy, plan in compare(job).items():
            rows.append(
                {
                    "gpus": job.gpus,
                    "mtbf_hours": job.mtbf_s / 3600.0,
                    "strategy": strategy,
                    "full_interval": plan.full_interval,
                    "batch_size": plan.batch_size,
                    "overhead": plan.overhead,
                    "lost_hours": expected_loss_hours(plan, hours),
                    "host_merge_s": host_merge_s(job),
                    "host_merge_bandwidth": job.host_merge_bandwidth,
                }
            )
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(
            f"{args.params / 1e9:g}B parameters, TP={args.tensor_parallel} "
            f"PP={args.pipeline_parallel}, {args.iteration_s:g} s per iteration, "
            f"{args.train_days:g} days of training; failures: one per "
            f"{args.gpu_hours_per_failure:,.0f} GPU-hours"
        )
        print(
            f"host s: a node's replica steps per iteration (LowDiff+, LowDiff's keeper replicas), "
            f"{MERGE_BYTES:g} bytes per shard parameter at {args.host_merge_bandwidth / 1e9:g} "
            "GB/s (--host-merge-bandwidth; benchmarks/host_merge.py measures a host's); training "
            "waits for what exceeds an iteration, or with LowDiff+ (bounded wait) "
            f"{args.max_merge_wait_s:g} s once per base (--max-merge-wait-s)"
        )
        print(f"{'GPUs':>6} {'MTBF h':>7} {'host s':>7}  {'strategy':25} {'F':>7} {'B':>4} "
              f"{'overhead':>9} {'lost h':>8}")  # fmt: skip
        for r in rows:
            print(
                f"{r['gpus']:>6} {r['mtbf_hours']:>7.2f} {r['host_merge_s']:>7.2f}  "
                f"{r['strategy']:25} {r['full_interval']:>7} {r['batch_size']:>4} "
                f"{r['overhead']:>9.2%} {r['lost_hours']:>8.1f}"
            )
    if args.plot:
        _plot_sweep(rows, args.plot)
    return 0


def _plot_sweep(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == strategy]
        gpus = [r["gpus"] for r in mine]
        axes[0].plot(gpus, [100 * r["overhead"] for r in mine], "o-", label=strategy)
        axes[1].plot(gpus, [r["full_interval"] for r in mine], "o-", label=strategy)
    for ax, label in zip(axes, ("expected overhead (%)", "base interval F"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel(label)
        ax.legend()
    axes[1].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    """The ``megatron-diffckpt`` command line (its subcommands and their flags)."""
    parser = argparse.ArgumentParser(
        prog="megatron-diffckpt", description=__doc__.split("\n")[0].replace("``", "")
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (
        ("inspect", "bases, diff ranges, recoverable iteration, bytes"),
        ("verify", "check every checksum; exit 1 on damage"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("dir", help="the checkpoint folder (--save)")
        p.add_argument("--diff-dir", default=None, help="the diff log (default DIR/diffckpt)")
        if name == "inspect":
            p.add_argument("--json", action="store_true", help="machine-readable output")
            p.add_argument(
                "--keeper",
                default=os.environ.get(KEEPER_ENV),
                help="also what this node's keeper holds: its socket (default: "
                f"${KEEPER_ENV}, which the node launcher sets for the ranks)",
            )
    p = sub.add_parser("merge", help="a base plus its differentials into a new stock base")
    p.add_argument("dir", help="the checkpoint folder (--save); only read")
    p.add_argument(
        "--iteration",
        type=int,
        default=None,
        help="the iteration to merge to (default: the newest every rank's diff log reaches)",
    )
    p.add_argument("--out", required=True, help="the checkpoint folder to write iter_T into")
    p.add_argument("--diff-dir", default=None, help="the diff log (default DIR/diffckpt)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument(
        "--reshardable",
        action="store_true",
        help="write the optimizer state in model space (megatron's fully_reshardable format, "
        "without padding): the result loads under any TP / PP / DP; T may be a base",
    )
    p = sub.add_parser("export", help="one base as a single torch file")
    p.add_argument("dir", help="the checkpoint folder (--save)")
    p.add_argument("--iteration", type=int, default=None, help="the base (default: the newest)")
    p.add_argument("--out", required=True, help="the file to write")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p = sub.add_parser("prune", help="retention: keep the newest K bases and what they replay")
    p.add_argument("dir", help="the checkpoint folder (--save)")
    p.add_argument("--keep", type=int, required=True, help="complete bases to keep (>= 1)")
    p.add_argument("--diff-dir", default=None, help="the diff log (default DIR/diffckpt)")
    p.add_argument("--dry-run", action="store_true", help="list what would go; remove nothing")
    _add_tune_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "tune":
        return _tune(args)
    if not os.path.isdir(args.dir):
        print(f"megatron-diffckpt: {args.dir}: no such directory", file=sys.stderr)
        return 2
    if args.command == "export":
        return _export(args)
    if args.command == "merge":
        return _merge(args)
    if args.command == "prune":
        return _prune(args)
    if args.command == "inspect":
        info = inspect_dir(args.dir, args.diff_dir)
        if args.keeper:
            info["keeper"] = _keeper_info(args.keeper)
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            _print_inspect(info)
        return 0 if info["recoverable_iteration"] is not None else 1
    problems, notes = verify_dir(args.dir, args.diff_dir)
    for n in notes:
        print(f"note: {n}")
    for p in problems:
        print(f"DAMAGED {p}")
    print("ok" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
