"""A merged state as a checkpoint that loads under any tensor, pipeline or data-parallel layout.

Training writes bases in the distributed optimizer's ``dp_reshardable`` format: the optimizer
state is the flat buckets of each (TP, PP) rank, so it loads under another data-parallel size
only. megatron-core's own ``fully_reshardable`` format stores it in *model space*: for every model
tensor ``K``, ``optimizer.state.param.K``, ``optimizer.state.exp_avg.K`` and
``optimizer.state.exp_avg_sq.K``, each of ``K``'s global shape and chunked as ``K`` is, and the
optimizer's param groups in ``common.pt``; its loader
(``load_parameter_state_from_fully_reshardable``) flattens each tensor and takes the rank's
range, under any layout. Its *save* in megatron-core
0.16.1 zero-pads ranges past the end of a bucket behind a warning ("can lead to data
corruption"); here nothing is gathered from a live optimizer: each rank's main parameters and
moments are placed into the model tensors' shapes from its shard map, every element of every
tensor must be placed exactly once (or, for copies megatron keeps in step, with the same value),
and no padding can enter.

What does not carry over to another layout: the error-feedback residuals of the top-k exchange
(per-rank state of the old layout: dropped, with a note) and the RNG states (kept; they are
keyed by the (PP, TP) sizes, and the loaders keep them only under the same sizes).

One process, no megatron import.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_diffckpt.dist_ckpt_io import load_object
from megatron_diffckpt.errors import DiffCkptUsageError
from megatron_diffckpt.shard_map import STATE_NAMES, ShardMap

PREFIX = "optimizer.state"
"""megatron's prefix of the optimizer state in model space."""
FORMAT = "fully_reshardable"
_RESIDUALS = "diffckpt_error_feedback"


class ReshardError(DiffCkptUsageError, RuntimeError):
    """The state cannot be written in the layout-independent format (the message says why)."""


def to_reshardable(
    entries: dict[str, Any], shard_maps: list[ShardMap], common: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """``entries`` and ``common`` of a merged ``dp_reshardable`` checkpoint (whole global tensors
    and raw bytes objects, see :mod:`megatron_diffckpt.dist_ckpt_io`) in the ``fully_reshardable``
    layout: ``(entries, common, notes)``. ``entries`` is not changed."""
    inner = {len(m.inner) for m in shard_maps}
    if inner != {1} or any(m.inner[0] is None for m in shard_maps):
        counts = " or ".join(map(str, sorted(inner)))
        raise ReshardError(
            "--reshardable writes one distributed optimizer per rank; this run's ranks have "
            f"{counts} inner optimizers (a chained optimizer, e.g. a mixture of experts' dense "
            "and expert parameters): merge without --reshardable and resume it under its own "
            "parallel layout instead"
        )
    notes: list[str] = []
    out: dict[str, Any] = {}
    for key, value in entries.items():
        if key.startswith("optimizer.distributed."):
            continue  # the flat buckets and their per-rank objects: replaced below
        if key.startswith(_RESIDUALS):
            if not any(n.startswith("dropped the error-feedback") for n in notes):
                notes.append(
                    "dropped the error-feedback residuals of the top-k exchange: they are "
                    "per-rank state of this layout (training goes on with zero residuals)"
                )
            continue
        out[key] = value

    placed: dict[str, torch.Tensor] = {}  # how many times each element was written
    for smap in shard_maps:
        for group in smap.inner[0].groups:
            for e in group:
                sources = [("param", e.main_key)] + [(n, e.state_key(n)) for n in STATE_NAMES]
                for m in e.model:
                    if not m.saved_by_data_parallel_ranks():
                        continue  # a tied or tensor-parallel copy: its main replica is placed
                    shape = entries[m.key].shape
                    count = placed.setdefault(m.key, torch.zeros(shape, dtype=torch.int32))
                    _place(count, m.index(), m.local_shape, e.model_range, None)
                    for name, flat_key in sources:
                        flat = entries[flat_key]
                        key = f"{PREFIX}.{name}.{m.key}"
                        if key not in out:
                            out[key] = torch.zeros(shape, dtype=flat.dtype)
                        values = flat[e.main_offset : e.main_offset + e.numel]
                        _place(out[key], m.index(), m.local_shape, e.model_range, values)
    _check_coverage(placed, entries)

    groups = _param_groups(entries, shard_maps)
    common = dict(common)
    common["optimizer"] = {"optimizer": groups, "param_state_sharding_type": FORMAT}
    content = dict(common.get("content_metadata") or {})
    content["distrib_optim_sharding_type"] = FORMAT
    common["content_metadata"] = content
    return out, common, notes


def _place(
    target: torch.Tensor,
    index: tuple[Any, ...],
    local_shape: tuple[int, ...],
    flat_range: tuple[int, int],
    values: torch.Tensor | None,
) -> None:
    """``target[index].view(-1)[start:end] = values`` (``values`` None: count the elements)."""
    start, end = flat_range
    local = target[index].reshape(-1)  # a copy where the slice is not contiguous
    if values is None:
        local[start:end] += 1
    else:
        local[start:end] = values.to(target.dtype)
    target[index] = local.view(local_shape)


def _check_coverage(placed: dict[str, torch.Tensor], entries: dict[str, Any]) -> None:
    """Every element of every model tensor's optimizer state came from exactly one rank."""
    for key, count in placed.items():
        if bool((count == 1).all()):
            continue
        missing, twice = int((count == 0).sum()), int((count > 1).sum())
        raise ReshardError(
            f"{key}: the ranks' shard maps leave {missing} element(s) without optimizer state and "
            f"place {twice} more than once (of {count.numel()}); the diff log does not describe "
            "one complete model"
        )
    optimizer_keys = ("optimizer.", _RESIDUALS)
    untouched = [
        k
        for k, v in entries.items()
        if torch.is_tensor(v) and not k.startswith(optimizer_keys) and k not in placed
    ]
    if untouched:
        raise ReshardError(
            f"model tensors no rank's optimizer holds: {untouched[:5]}"
            + (" ..." if len(untouched) > 5 else "")
        )


def _param_groups(entries: dict[str, Any], shard_maps: list[ShardMap]) -> dict:
    """The optimizer's param groups after the merge (one object per (TP, PP) rank in the base;
    they must agree to be the one object of a layout-independent checkpoint)."""
    objects = {m.inner[0].param_groups_key for m in shard_maps}
    loaded = {key: load_object(entries[key]) for key in sorted(objects)}
    first_key, first = next(iter(loaded.items()))
    for key, obj in loaded.items():
        if obj != first:
            raise ReshardError(
                f"the param groups of {key} and {first_key} differ: the model-parallel ranks "
                "were not stepped alike, so no single set of param groups describes the state"
            )
    return first
