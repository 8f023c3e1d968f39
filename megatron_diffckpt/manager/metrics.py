"""What a training log line shows of differential checkpointing (every ``--log-interval``):
:func:`collect_metrics` gathers a rank's values, :func:`format_metrics` writes them as fields of a
Megatron-style line."""

from __future__ import annotations

from typing import Any


def format_metrics(metrics: dict[str, float]) -> str:
    """:func:`collect_metrics` as fields of a Megatron-style log line."""
    text = f" recoverable lag: {int(metrics['recoverable_lag'])} |"
    if "bytes_per_iteration" in metrics:
        text += (
            f" diff bytes per iteration: {metrics['bytes_per_iteration'] / 1e3:.1f} KB |"
            f" writer backlog: {int(metrics['writer_backlog'])} |"
        )
    if metrics.get("replica") == 0.0:
        text += " merge backlog: none (no replica) |"
    elif "merge_backlog" in metrics:
        paused = " (not merged until the next base)" if metrics.get("merge_paused") else ""
        text += f" merge backlog: {int(metrics['merge_backlog'])}{paused} |"
    if "keeper_lag" in metrics:
        text += (
            f" keeper lag: {int(metrics['keeper_lag'])} |"
            f" keeper memory (MiB): {metrics['keeper_mib']:.1f}/{metrics['keeper_cap_mib']:.0f} |"
        )
    return text


def collect_metrics(
    iteration: int,
    diff_seconds: float,
    durable_iteration: int,
    writer: Any,
    keeper: Any,
    strategy: Any,
) -> dict[str, float]:
    """A rank's values after ``iteration`` (local; any rank): ``diff_ms``, the last
    differential's (or LowDiff+ hand-off's) time on the training path; ``recoverable_lag``,
    iterations between now and the newest durable state; with the rank's diff-log ``writer``,
    ``bytes_per_iteration`` (per record written so far) and ``writer_backlog`` (segments
    waiting); with the node's ``keeper`` (where it holds this rank's chain), ``keeper_lag``
    (iterations between now and the newest it holds), ``keeper_mib`` and ``keeper_cap_mib``
    (what it holds, of all ranks of the node, and its cap); and the ``strategy``'s own
    (LowDiff+: ``merge_backlog``, ``slot_wait_ms``, ``copies_in_bubbles``)."""
    out = {
        "diff_ms": diff_seconds * 1000.0,
        "durable_iteration": float(durable_iteration),
        "recoverable_lag": float(iteration - durable_iteration),
    }
    if writer is not None:
        stats = writer.stats
        out["bytes_per_iteration"] = stats.bytes_written / max(stats.records, 1)
        out["writer_backlog"] = float(writer.backlog)
    kept = keeper.stats() if keeper is not None else {}
    if kept:  # the iteration the keeper holds: the diff log's records, or the replica's input
        out["keeper_lag"] = float(iteration - keeper.held_iteration)
        out["keeper_mib"] = (kept["bytes"] + kept.get("reserved", 0)) / 2**20
        out["keeper_cap_mib"] = kept["memory"] / 2**20
    if strategy is not None:
        out.update(strategy.metrics())
    return out
