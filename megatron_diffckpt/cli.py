"""``megatron-diffckpt``: inspect and verify a checkpoint folder with its diff log.

Exit codes a script can rely on: 0 all good; 1 damage found (``verify``) or nothing recoverable
(``inspect``); 2 bad usage or not a checkpoint folder.

No megatron import: it reads the folder layout, the tracker and the diff log only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field

from megatron_diffckpt.checkpoint_layout import (
    COMPLETE_MARKER,
    TRACKER_FILENAME,
    CheckpointNotFoundError,
    find_latest_iteration,
    list_checkpoints,
)
from megatron_diffckpt.storage.format import SegmentIdentity
from megatron_diffckpt.storage.reader import (
    list_segments,
    read_segment,
    read_segment_header,
    scan_rank_log,
)

_RANK_RE = re.compile(r"^rank_(\d+)_(\d+)_(\d+)$")


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


def inspect_dir(root: str, diff_dir: str | None = None) -> dict:
    """Bases, per-rank diff ranges and bytes, and the recoverable iteration T. Any process."""
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"{root}: no such directory")
    try:
        latest = find_latest_iteration(root)
    except CheckpointNotFoundError:
        latest = None
    ddir = _diff_dir(root, diff_dir)
    ranks = []
    if os.path.isdir(ddir):
        for name in sorted(os.listdir(ddir)):
            if _RANK_RE.match(name):
                ranks.append(_report_rank(os.path.join(ddir, name), latest))
    ends = [r.chain_end for r in ranks if r.chain_end is not None]
    recoverable = min(ends) if ends and len(ends) == len(ranks) else latest
    return {
        "root": root,
        "latest_base": latest,
        "bases": [{"iteration": i, "complete": c} for i, c in list_checkpoints(root)],
        "diff_log": ddir if os.path.isdir(ddir) else None,
        "ranks": [r.__dict__ for r in ranks],
        "recoverable_iteration": recoverable,
        "diff_bytes": sum(r.bytes for r in ranks),
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
    for name in sorted(os.listdir(ddir)):
        rank_dir = os.path.join(ddir, name)
        if not _RANK_RE.match(name):
            continue
        identity = _rank_identity(rank_dir)
        for _, _, path in list_segments(rank_dir):
            scan = read_segment(path, identity)
            if scan.error is not None:
                problems.append(f"{name}/{os.path.basename(path)}: {scan.error}")
    return problems, notes


def _print_inspect(info: dict) -> None:
    print(f"checkpoint folder: {info['root']}")
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
    print(f"recoverable iteration T: {info['recoverable_iteration']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-diffckpt", description=__doc__.split("\n")[0])
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
    args = parser.parse_args(argv)
    if not os.path.isdir(args.dir):
        print(f"megatron-diffckpt: {args.dir}: no such directory", file=sys.stderr)
        return 2
    if args.command == "inspect":
        info = inspect_dir(args.dir, args.diff_dir)
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
