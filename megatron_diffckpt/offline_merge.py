"""Offline merge: a base plus the differentials after it, into a new stock base. One process.

``megatron-diffckpt merge DIR --iteration T --out DIR2`` writes ``DIR2/iter_T``, a ``torch_dist``
checkpoint that stock megatron loads as if training had saved it at T, and points ``DIR2``'s
tracker at it. ``DIR`` is only read. Steps:

1. Pick the newest complete base B <= T of ``DIR``; read every rank's shard map
   (:mod:`megatron_diffckpt.shard_map`) and its diff-log chain after B, which must reach T on every
   rank (the same rule as recovery: gaps, damaged or foreign segments end a chain).
2. Read the base's entries (whole global tensors; sharded objects as bytes).
3. For every rank, rebuild its torch optimizer over its slices of the base's flat
   ``dp_reshardable`` buckets (main parameters, Adam moments, step, hyper-parameters from the
   base's param groups) and feed it the recorded inputs of B+1..T, exactly as recovery replays
   them; write the results back, and cast the main parameters into the model tensors they shard.
4. Update the scheduler's step count, the iteration, the consumed samples, the optimizer's step
   and the RNG states (those at the end of T, per (PP, TP) rank, from the chains) and write
   ``DIR2/iter_T`` under a temporary name, ``common.pt`` and ``metadata.json`` last, then rename it
   and move the tracker. With ``--reshardable``, the optimizer state is first rewritten in model
   space (:mod:`megatron_diffckpt.reshardable`), so that the result loads under any layout.

The optimizer step is torch's ``Adam``/``AdamW`` on CPU, the one megatron-core uses without
TransformerEngine or apex: a run trained on CPU merges bit-exactly; a run trained on GPUs (another
kernel) merges to within floating-point rounding of its training state, and a run whose
optimizer was TE's or apex's fused Adam is refused (resume it with ``--load`` to replay instead).
The error-feedback residuals of ``--diffckpt-compressor topk`` stay the base's, as after a
recovery. Reading ``common.pt`` and the sharded objects unpickles (megatron's own format): merge
only checkpoints you trust.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from typing import Any

import torch

from megatron_diffckpt import blocked_adam
from megatron_diffckpt.capture import record_grads, rng_states_at, set_step_inputs
from megatron_diffckpt.checkpoint_layout import (
    COMPLETE_MARKER,
    CheckpointNotFoundError,
    checkpoint_dir,
    find_latest_iteration,
    list_checkpoints,
    publish_iteration,
)
from megatron_diffckpt.dist_ckpt_io import (
    COMMON_FILE,
    dump_object,
    entry_bytes,
    load_common,
    load_object,
    read_entries,
    read_metadata,
    store_common,
    write_entries,
)
from megatron_diffckpt.durable_io import fsync_dir, publish_file
from megatron_diffckpt.errors import DiffCkptUsageError
from megatron_diffckpt.progress import Progress
from megatron_diffckpt.reshardable import ReshardError, to_reshardable
from megatron_diffckpt.shard_map import STATE_NAMES, ParamEntry, ShardMap, read_shard_map
from megatron_diffckpt.storage.format import DiffRecord, SegmentIdentity
from megatron_diffckpt.storage.reader import (
    RUN_ID_FILE,
    list_rank_dirs,
    read_run_info,
    scan_rank_log,
)

_OPTIMIZERS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MergeError(DiffCkptUsageError, RuntimeError):
    """The merge cannot be done as asked (the message says why and what to do)."""


@dataclass
class RankChain:
    """One rank's shard map and its records after the base, up to the target."""

    name: str
    shard_map: ShardMap
    records: list[DiffRecord]


def _rank_chains(
    diff_dir: str, base: int, target: int | None
) -> tuple[int, list[RankChain], list[str]]:
    """Every rank's chain after ``base``; the target (default: the newest iteration all reach)."""
    run_id = read_run_info(diff_dir).get("run_id")
    if run_id is None:
        raise MergeError(f"{diff_dir} holds no readable {RUN_ID_FILE}: not a diff log")
    names = list_rank_dirs(diff_dir)
    if not names:
        raise MergeError(f"{diff_dir} has no rank folders: nothing to merge")
    maps: dict[str, ShardMap] = {}
    for name in names:
        try:
            maps[name] = read_shard_map(os.path.join(diff_dir, name))
        except ValueError as e:
            raise MergeError(
                f"{name}: {e}; merge needs the shard map that training writes after its first "
                "step (megatron's distributed optimizer, torch_dist bases): resume the run with "
                "--load to replay its differentials instead"
            ) from e
    tp, pp, dp = next(iter(maps.values())).parallel
    expected = {f"rank_{t}_{p}_{d}" for t in range(tp) for p in range(pp) for d in range(dp)}
    if set(maps) != expected:
        raise MergeError(
            f"the run has TP={tp} PP={pp} DP={dp}, so ranks {sorted(expected)}; the diff log "
            f"holds {sorted(maps)}"
        )
    problems: list[str] = []
    chains = []
    for name, smap in maps.items():
        t, p, d = smap.rank
        identity = SegmentIdentity(run_id, t, p, d, smap.layout_hash)
        scan = scan_rank_log(os.path.join(diff_dir, name), identity, base)
        problems += [f"{name}: {x}" for x in scan.problems]
        chains.append(RankChain(name, smap, scan.records))
    reach = min(c.records[-1].iteration if c.records else base for c in chains)
    if target is None:
        target = reach
    if target > reach:
        ends = ", ".join(
            f"{c.name} {c.records[-1].iteration if c.records else base}" for c in chains
        )
        raise MergeError(
            f"not every rank's differentials after base {base} reach iteration {target}: the "
            f"chains end at {ends}" + (f" ({'; '.join(problems)})" if problems else "")
        )
    for c in chains:
        c.records = [r for r in c.records if r.iteration <= target]
    return target, chains, problems


def _optimizer_for(
    inner_index: int, entry: Any, tensors: dict[str, Any], groups: list[dict]
) -> tuple[torch.optim.Optimizer, list[list[torch.Tensor]]]:
    """A torch optimizer over this rank's slices of the base, in its training param groups."""
    cls = _OPTIMIZERS.get(entry.optimizer_class)
    if cls is None:
        raise MergeError(
            f"the run's optimizer is {entry.optimizer_class}; merge replays with torch's "
            f"{' or '.join(_OPTIMIZERS)} only: resume the run with --load to replay instead"
        )
    if len(groups) != len(entry.groups):
        raise MergeError(
            f"optimizer {inner_index}: the base has {len(groups)} param groups, the shard map "
            f"{len(entry.groups)}"
        )
    params = [
        [_slice(tensors, e.main_key, e).clone() for e in group_entries]
        for group_entries in entry.groups
    ]
    optimizer = cls(
        [
            {**{k: v for k, v in saved.items() if k not in ("params", "step")}, "params": ps}
            for saved, ps in zip(groups, params, strict=True)
        ]
    )
    for g, group_entries in enumerate(entry.groups):
        step = groups[g].get("step")
        for p, e in zip(params[g], group_entries, strict=True):
            state = {n: _slice(tensors, e.state_key(n), e).clone() for n in STATE_NAMES}
            optimizer.state[p] = {"step": torch.tensor(float(step)), **state}
    return optimizer, params


def _slice(tensors: dict[str, Any], key: str, e: ParamEntry) -> torch.Tensor:
    try:
        flat = tensors[key]
    except KeyError:
        raise MergeError(f"the base has no tensor {key!r} that the shard map names") from None
    if e.main_offset + e.numel > flat.numel():
        raise MergeError(f"{key} holds {flat.numel()} elements, the shard map wants more")
    return flat[e.main_offset : e.main_offset + e.numel]


def _write_back(tensors: dict[str, Any], e: ParamEntry, p: torch.Tensor, state: dict) -> None:
    _slice(tensors, e.main_key, e).copy_(p.detach())
    for n in STATE_NAMES:
        _slice(tensors, e.state_key(n), e).copy_(state[n])
    start, end = e.model_range
    for m in e.model:
        if not m.saved_by_data_parallel_ranks():
            continue
        index = m.index()
        local = tensors[m.key][index].reshape(-1)  # a copy where the slice is not contiguous
        local[start:end] = p.detach().to(_DTYPES[e.model_dtype])
        tensors[m.key][index] = local.view(m.local_shape)


def _replay_rank(
    chain: RankChain, tensors: dict[str, Any], objects: dict[str, Any], bar: Progress
) -> dict[str, tuple[float, list[list[float]]]]:
    """Replay one rank's chain into ``tensors``. Returns, per param-groups object, the optimizer
    step and every group's [lr, weight decay] after the chain (``objects`` is not changed: the
    rank's data-parallel peers read the same base values)."""
    after = {}
    if not chain.records:  # a base converted as it is (--reshardable)
        return after
    for i, entry in enumerate(chain.shard_map.inner):
        if entry is None:
            continue
        groups = objects[entry.param_groups_key]["param_groups"]
        optimizer, params = _optimizer_for(i, entry, tensors, groups)
        for record in chain.records:
            if not record.scalars["skipped"]:
                set_step_inputs(i, optimizer, record, record_grads(record))
                blocked_adam.step(optimizer)
            bar.update(1)
        for g, group_entries in enumerate(entry.groups):
            for p, e in zip(params[g], group_entries, strict=True):
                _write_back(tensors, e, p, optimizer.state[p])
        steps = {float(s["step"]) for s in optimizer.state.values()}
        if len(steps) != 1:
            raise MergeError(f"{chain.name}: the replayed parameters disagree on the step {steps}")
        last = chain.records[-1].scalars["groups"]
        after[entry.param_groups_key] = (
            steps.pop(),
            [last[f"o{i}.g{g}"] for g in range(len(groups))],
        )
    return after


def _with_step(obj: dict, step: float, groups: list[list[float]]) -> dict:
    """A param-groups object after the replay: its step, and the last step's lr and decay."""
    out = {**obj, "param_groups": [dict(g) for g in obj["param_groups"]]}
    for saved, (lr, wd) in zip(out["param_groups"], groups, strict=True):
        if "step" in saved:
            saved["step"] = type(saved["step"])(step)
        saved["lr"], saved["weight_decay"] = lr, wd
    return out


def _same_tensor(a: Any, b: Any) -> bool:
    return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)


def _update_rng(obj: Any, states: dict[str, Any]) -> Any:
    """A saved RNG-state object (a dict of Megatron-LM's keys, or a list of them) at ``states``."""
    if isinstance(obj, list):
        return [_update_rng(o, states) for o in obj]
    if not isinstance(obj, dict):
        return obj
    out = dict(obj)
    cpu_mode_device = _same_tensor(out.get("cuda_rng_state"), out.get("torch_rng_state"))
    for key, name in (
        ("random_rng_state", "python"),
        ("np_rng_state", "numpy"),
        ("torch_rng_state", "torch"),
        ("cuda_rng_state", "cuda"),
    ):
        if key in out and name in states:
            out[key] = states[name]
    if cpu_mode_device and "torch" in states:
        # Saved in CPU mode, where the device generator is the CPU one (a CUDA state never
        # equals a CPU state): it follows the CPU state, or loading would set the stale one last.
        out["cuda_rng_state"] = states["torch"]
    if isinstance(out.get("rng_tracker_states"), dict):
        out["rng_tracker_states"] = {**out["rng_tracker_states"], **states["tracker"]}
    return out


def _rng_entries(entries: dict[str, Any], chains: list[RankChain], problems: list[str]) -> None:
    """Move the ``rng_state`` entries to the target: one per (PP, TP) rank, holding its DP rank
    0's states (or, as a list with one entry per DP rank, each rank's own: Megatron-LM's
    ``--data-parallel-random-init``); with expert parallelism, Megatron-LM keeps one per
    (PP, TP, DP) rank, each its own. Where the base has no such entry, ``problems`` says so."""
    by_model_rank: dict[tuple[int, int], dict[int, RankChain]] = {}
    for chain in chains:
        tp, pp, dp = chain.shard_map.rank
        by_model_rank.setdefault((tp, pp), {})[dp] = chain
    for (tp, pp), per_dp in sorted(by_model_rank.items()):
        tp_size, pp_size, dp_size = per_dp[0].shard_map.parallel
        states = {dp: rng_states_at(c.records) for dp, c in per_dp.items()}
        per_rank = {
            dp: f"rng_state/shard_{pp}.{tp}.{dp}_{pp_size}.{tp_size}.{dp_size}" for dp in states
        }
        if all(k in entries for k in per_rank.values()):  # expert parallelism: per DP rank
            for dp, k in per_rank.items():
                entries[k] = dump_object(_update_rng(load_object(entries[k]), states[dp]))
            continue
        key = f"rng_state/shard_{pp}.{tp}_{pp_size}.{tp_size}"
        if key not in entries:
            problems.append(
                f"no {key} in the base: the RNG states of TP rank {tp}, PP rank {pp} stay the "
                "base's"
            )
            continue
        obj = load_object(entries[key])
        if isinstance(obj, list) and len(obj) == dp_size > 1:
            obj = [_update_rng(o, states[dp]) for dp, o in enumerate(obj)]
        else:
            obj = _update_rng(obj, states[0])
        entries[key] = dump_object(obj)


def merge_base(
    root: str,
    out: str,
    iteration: int | None = None,
    diff_dir: str | None = None,
    progress: bool = True,
    reshardable: bool = False,
) -> dict[str, Any]:
    """Merge ``root``'s newest base at or before ``iteration`` (default: the newest iteration
    every rank's diff log reaches) with the differentials up to it into ``out``. Returns a
    summary. One process; ``root`` is only read; ``out/iter_T`` and the tracker are durable on
    return.

    ``reshardable``: write the state in the layout-independent ``fully_reshardable`` format
    (:mod:`megatron_diffckpt.reshardable`), which loads under any TP / PP / DP; then ``iteration``
    may also be a base (converted as it is)."""
    stream = sys.stderr if progress else None
    if os.path.realpath(out) == os.path.realpath(root):
        raise MergeError("--out must be another folder: merge never writes into DIR")
    diff_dir = diff_dir or os.path.join(root, "diffckpt")
    complete = [i for i, ok in list_checkpoints(root) if ok] if os.path.isdir(root) else []
    if not complete:
        raise MergeError(f"{root} holds no complete base")
    candidates = [b for b in complete if iteration is None or b <= iteration]
    if not candidates:
        raise MergeError(f"{root} has no complete base at or before {iteration} ({complete})")
    base = max(candidates)
    target, chains, problems = _rank_chains(diff_dir, base, iteration)
    if target == base and not reshardable:
        raise MergeError(
            f"iteration {target} is a base already ({checkpoint_dir(root, base)}): nothing to "
            "merge; copy it, or `megatron-diffckpt export` it"
        )
    final = checkpoint_dir(out, target)
    if os.path.exists(final):
        raise MergeError(f"{final} exists; merge never overwrites a checkpoint")
    src = checkpoint_dir(root, base)
    metadata = read_metadata(src)
    total = sum(entry_bytes(m) for m in metadata.state_dict_metadata.values())
    bar = Progress(f"read iter_{base:07d}", len(metadata.state_dict_metadata), "entries", total,
                   stream=stream)  # fmt: skip
    entries = read_entries(src, on_group=bar.update, metadata=metadata)
    bar.close()

    objects: dict[str, Any] = {}
    for chain in chains:
        for entry in chain.shard_map.inner:
            if entry is not None and entry.param_groups_key not in objects:
                objects[entry.param_groups_key] = load_object(entries[entry.param_groups_key])
    steps = sum(len(c.records) * sum(e is not None for e in c.shard_map.inner) for c in chains)
    bar = Progress(f"replay {base + 1}-{target} on {len(chains)} ranks", steps, "steps",
                   stream=stream)  # fmt: skip
    after: dict[str, tuple[float, list[list[float]]]] = {}
    for chain in chains:
        for key, state in _replay_rank(chain, entries, objects, bar).items():
            if after.setdefault(key, state) != state:
                raise MergeError(
                    f"{chain.name}: its step or learning rates after the replay differ from its "
                    f"data-parallel peers' ({state} vs {after[key]})"
                )
    bar.close()
    for key, (step, groups) in after.items():
        entries[key] = dump_object(_with_step(objects[key], step, groups))
    if chains[0].records:
        _rng_entries(entries, chains, problems)

    common = load_common(src, entries)
    if chains[0].records:
        last = chains[0].records[-1]
        common["iteration"] = target
        common["consumed_train_samples"] = last.scalars["consumed_samples"]
        if isinstance(common.get("opt_param_scheduler"), dict):
            common["opt_param_scheduler"]["num_steps"] = last.scalars["scheduler_steps"]
        if hasattr(common.get("args"), "consumed_train_samples"):  # Megatron-LM's arguments
            common["args"].consumed_train_samples = last.scalars["consumed_samples"]
            common["args"].iteration = target

    if reshardable:
        try:
            entries, common, notes = to_reshardable(entries, [c.shard_map for c in chains], common)
        except ReshardError as e:
            raise MergeError(str(e)) from e
        problems += notes

    os.makedirs(out, exist_ok=True)
    staging = final + ".merging"
    if os.path.exists(staging):
        shutil.rmtree(staging)  # an interrupted merge's leftovers: never published
    bar = Progress(f"write iter_{target:07d}", 1, "checkpoints", stream=stream)
    in_entries = store_common(common, entries)
    write_entries(staging, entries)  # DCP fsyncs its files; .metadata last
    if not in_entries:
        publish_file(os.path.join(staging, COMMON_FILE), lambda f: torch.save(common, f))
    with open(os.path.join(src, COMPLETE_MARKER), "rb") as f:
        marker = f.read()
    publish_file(os.path.join(staging, COMPLETE_MARKER), lambda f: f.write(marker))
    os.replace(staging, final)
    fsync_dir(out)
    try:
        newer = find_latest_iteration(out)
    except CheckpointNotFoundError:
        newer = None
    if newer is not None and newer > target:  # the tracker only ever moves forward
        problems.append(f"{out}'s tracker names iteration {newer}; left there")
    else:
        publish_iteration(out, target)
    bar.update(1)
    seconds = bar.close()
    return {
        "base": base,
        "iteration": target,
        "ranks": len(chains),
        "differentials": sum(len(c.records) for c in chains),
        "out": final,
        "problems": problems,
        "write_seconds": seconds,
        "format": "fully_reshardable" if reshardable else "dp_reshardable",
    }
