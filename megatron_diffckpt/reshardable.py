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

import re
from typing import Any

import torch

from megatron_diffckpt.dist_ckpt_io import load_object
from megatron_diffckpt.errors import DiffCkptUsageError
from megatron_diffckpt.shard_map import STATE_NAMES, InnerEntry, ShardMap

PREFIX = "optimizer.state"
"""megatron's prefix of the optimizer state in model space."""
FORMAT = "fully_reshardable"
_RESIDUALS = "diffckpt_error_feedback"
_FLAT_BUCKETS = re.compile(r"(chained_\d+\.)?optimizer\.distributed\.")
"""The ``dp_reshardable`` keys (flat buckets, per-rank objects) of a plain or chained optimizer."""
_OPTIMIZER = re.compile(rf"(chained_\d+\.)?optimizer\.|{_RESIDUALS}")


class ReshardError(DiffCkptUsageError, RuntimeError):
    """The state cannot be written in the layout-independent format (the message says why)."""


def to_reshardable(
    entries: dict[str, Any], shard_maps: list[ShardMap], common: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """``entries`` and ``common`` of a merged ``dp_reshardable`` checkpoint (whole global tensors
    and raw bytes objects, see :mod:`megatron_diffckpt.dist_ckpt_io`) in the ``fully_reshardable``
    layout: ``(entries, common, notes)``. ``entries`` is not changed.

    A chained optimizer (a mixture of experts' dense and expert optimizers, each over its own
    data-parallel group) is written with its model-space keys unprefixed and
    ``chained_optim_avoid_prefix`` in the content metadata, as Megatron-LM saves them: the inner
    optimizers hold disjoint model tensors, so the keys do not depend on how the optimizers of
    the layout that loads them are chained (at EP=1 megatron steps experts and dense parameters
    in one optimizer). ``common["optimizer"]`` has one entry per inner optimizer, as megatron's
    ``ChainedOptimizer`` saves it; :func:`fit_loaded_optimizer_state` fits it to another
    chaining at load."""
    counts = {len(m.inner) for m in shard_maps}
    if len(counts) != 1:
        raise ReshardError(
            f"the ranks' shard maps have {' and '.join(map(str, sorted(counts)))} inner "
            "optimizers: they are not one run's"
        )
    (count,) = counts
    content = dict(common.get("content_metadata") or {})
    chained = count > 1
    notes: list[str] = []
    out: dict[str, Any] = {}
    for key, value in entries.items():
        if _FLAT_BUCKETS.match(key):
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
    for i in range(count):
        for smap in shard_maps:
            if smap.inner[i] is None:
                continue  # a stub optimizer: no parameters on this rank
            _place_inner(smap.inner[i], entries, out, placed)
    _check_coverage(placed, entries)
    _both_rng_forms(out, shard_maps)

    states = [
        {"optimizer": _param_groups(entries, shard_maps, i), "param_state_sharding_type": FORMAT}
        for i in range(count)
    ]
    common = dict(common)
    common["optimizer"] = dict(enumerate(states)) if chained else states[0]
    content["distrib_optim_sharding_type"] = FORMAT
    content["chained_optim_avoid_prefix"] = True
    common["content_metadata"] = content
    return out, common, notes


def _place_inner(
    inner: InnerEntry,
    entries: dict[str, Any],
    out: dict[str, Any],
    placed: dict[str, torch.Tensor],
) -> None:
    """Place one rank's inner optimizer's main parameters and moments into ``out``'s model-space
    tensors (``optimizer.state.<name>.<model key>``), counting each element placed in
    ``placed``."""
    for group in inner.groups:
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


def _both_rng_forms(out: dict[str, Any], shard_maps: list[ShardMap]) -> None:
    """Megatron-LM keeps its RNG states per (PP, TP) rank, or per (PP, TP, DP) rank under expert
    parallelism; which one a run asks for follows its EP size, not the checkpoint's. Both are
    written: DP rank 0's states as the (PP, TP) rank's (what every DP rank of a run without
    expert parallelism holds), and the (PP, TP) rank's states for each DP rank of this DP
    size."""
    tp_size, pp_size, dp_size = shard_maps[0].parallel
    for tp, pp in sorted({(m.rank[0], m.rank[1]) for m in shard_maps}):
        shared = f"rng_state/shard_{pp}.{tp}_{pp_size}.{tp_size}"
        per_dp = [
            f"rng_state/shard_{pp}.{tp}.{d}_{pp_size}.{tp_size}.{dp_size}" for d in range(dp_size)
        ]
        if shared in out:
            for key in per_dp:
                out.setdefault(key, out[shared])
        elif all(key in out for key in per_dp):
            out[shared] = out[per_dp[0]]


def fit_loaded_optimizer_state(state: Any, inner_count: int) -> Any:
    """The optimizer part of a loaded ``fully_reshardable`` checkpoint (megatron's ``common.pt``
    entries merged with the tensors loaded for this run's template) in the form of an optimizer
    of ``inner_count`` inner distributed optimizers; ``state`` itself where the checkpoint's
    chaining is already this run's, or where it is not ``fully_reshardable``.

    The chaining changes with the layout (a mixture of experts trains one optimizer at EP=1 and
    two at EP>1), the model-space tensors do not; what differs is only ``common.pt``'s
    structure. megatron's distributed optimizer takes the param groups it needs from the
    saved ones by their identifiers (``wd_mult``, ``lr_mult``, ``is_expert_parallel``,
    ``is_decoupled_lr``), so every inner optimizer is given all saved groups, and for each group
    its twin with ``is_expert_parallel`` flipped where the checkpoint has none (the same
    hyperparameters and step: the chained optimizers step together)."""
    if not isinstance(state, dict):
        return state
    if "param_state_sharding_type" in state:
        saved = [state]
    else:
        saved = [state[k] for k in sorted(k for k in state if isinstance(k, int))]
    fmts = {s.get("param_state_sharding_type") for s in saved if isinstance(s, dict)}
    if not saved or fmts != {FORMAT} or len(saved) == inner_count:
        return state
    groups: dict[tuple, dict] = {}
    for entry in saved:
        for g in entry["optimizer"]["param_groups"]:
            groups.setdefault(_group_identity(g), g)
    for g in list(groups.values()):
        twin = {**g, "is_expert_parallel": not g.get("is_expert_parallel", False)}
        groups.setdefault(_group_identity(twin), twin)
    common = {k: v for k, v in saved[0].items() if k != "param_state"}
    common["optimizer"] = {**saved[0]["optimizer"], "param_groups": list(groups.values())}
    if inner_count == 1:
        return {**common, "param_state": state.get("param_state")}
    return {i: {**common, "param_state": state[i].get("param_state")} for i in range(inner_count)}


def _group_identity(group: dict) -> tuple:
    """megatron's identity of a param group (``param_group_identifier_keys``)."""
    return tuple(
        group.get(k, group.get(f"pre_{k}"))
        for k in ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
    )


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
    untouched = [
        k
        for k, v in entries.items()
        if torch.is_tensor(v) and not _OPTIMIZER.match(k) and k not in placed
    ]
    if untouched:
        raise ReshardError(
            f"model tensors no rank's optimizer holds: {untouched[:5]}"
            + (" ..." if len(untouched) > 5 else "")
        )


def _param_groups(entries: dict[str, Any], shard_maps: list[ShardMap], i: int) -> dict:
    """Inner optimizer ``i``'s param groups after the merge (one object per data-parallel group
    in the base; they must agree to be the one object of a layout-independent checkpoint)."""
    objects = {m.inner[i].param_groups_key for m in shard_maps if m.inner[i] is not None}
    if not objects:
        raise ReshardError(f"inner optimizer {i} has no parameters on any rank")
    loaded = {key: load_object(entries[key]) for key in sorted(objects)}
    first_key, first = next(iter(loaded.items()))
    for key, obj in loaded.items():
        if obj != first:
            raise ReshardError(
                f"the param groups of {key} and {first_key} differ: the model-parallel ranks "
                "were not stepped alike, so no single set of param groups describes the state"
            )
    return first
