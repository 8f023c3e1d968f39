"""Hook point: the distributed optimizer's shard layout (read, never changed).

``DistributedOptimizer.gbuf_ranges[gbuf][dtype][bucket]["param_map"]`` says, for each model
parameter with a shard on this rank, where the shard sits in the rank's part of the gradient
bucket (``gbuf_local``) and which flat range of the parameter it is (``param``);
``model_param_group_index_map`` says which torch-optimizer parameter (group, index) holds the
shard's main copy (megatron's ``_get_main_param_and_optimizer_states`` reads it the same way).
LowDiff+'s snapshots and the offline merge's shard map are built from this one traversal.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from megatron_diffckpt.patches.base import MethodPatch, PatchSet
from megatron_diffckpt.patches.optimizer_step import inner_optimizers
from megatron_diffckpt.shard_map import MainParamSource

_DISTOPT = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"

# Drift check only: the traversal reads gbuf_ranges as these two methods of megatron do.
PATCHES = PatchSet(
    (
        MethodPatch(
            target=f"{_DISTOPT}._get_model_param_range_map",
            expected_signature="(self, param: torch.nn.parameter.Parameter)",
            make_wrapper=lambda original: original,
            purpose="read where each main parameter's shard sits (gbuf_ranges)",
            requires=((f"{_DISTOPT}._get_main_param_and_optimizer_states", "(self, model_param)"),),
        ),
    )
)
check_drift = PATCHES.check_drift


@dataclass(frozen=True)
class BucketParam:
    """One model parameter's shard on this rank, as the distributed optimizer lays it out."""

    gbuf_idx: int
    bucket_idx: int
    model_param: Any
    local_start: int  # the shard's range in this rank's part of the bucket
    local_end: int
    param_start: int  # the shard's range in model_param.view(-1)
    param_end: int
    group: int  # its torch-optimizer parameter: param_groups[group]["params"][index]
    index: int


def param_ranges_in_bucket(buffer: Any, bucket: Any) -> list[tuple[Any, int, int]]:
    """``(param, start, end)`` of every parameter of ``bucket`` (one bucket of megatron's
    ``_ParamAndGradBuffer`` ``buffer``), in the bucket's data. Any rank.

    From the buffer's ``param_index_map``, which holds where each parameter really sits,
    padding included (with the distributed optimizer, megatron-core pads parameter starts);
    ``bucket.param_to_index`` packs the parameters without that padding and is not the layout
    of the bucket's data."""
    out = []
    for param in bucket.params_list:
        start, end, _bucket_id = buffer.param_index_map[param]
        out.append((param, start - bucket.offset, end - bucket.offset))
    return out


def is_distributed(inner: Any) -> bool:
    return hasattr(inner, "gbuf_ranges") and hasattr(inner, "model_param_group_index_map")


def bucket_params(inner: Any) -> Iterator[BucketParam]:
    """Every shard of a megatron ``DistributedOptimizer`` (one inner optimizer). Any rank."""
    for gbuf_idx, ranges_by_dtype in enumerate(inner.gbuf_ranges):
        for _dtype, bucket_ranges in ranges_by_dtype.items():
            for bucket_idx, bucket_range in enumerate(bucket_ranges):
                for model_param, ranges in bucket_range["param_map"].items():
                    group, index = inner.model_param_group_index_map[model_param]
                    yield BucketParam(
                        gbuf_idx,
                        bucket_idx,
                        model_param,
                        ranges["gbuf_local"].start,
                        ranges["gbuf_local"].end,
                        ranges["param"].start,
                        ranges["param"].end,
                        group,
                        index,
                    )


def main_param_sources(optimizer: Any) -> list[list[list[MainParamSource]] | None]:
    """``sources[i][g][k]``: the model parameter (and flat range) of each main parameter of each
    inner optimizer; ``None`` for a stub. Any rank. Raises ``ValueError`` for an optimizer that is
    not megatron's distributed optimizer."""
    check_drift()
    sources: list[list[list[MainParamSource]] | None] = []
    for inner in inner_optimizers(optimizer):
        if getattr(inner, "is_stub_optimizer", False):
            sources.append(None)
            continue
        if not is_distributed(inner):
            raise ValueError(
                f"the shard map needs megatron's distributed optimizer, got {type(inner).__name__}"
            )
        groups = inner.optimizer.param_groups
        found: dict[tuple[int, int], MainParamSource] = {}
        for bp in bucket_params(inner):
            found[(bp.group, bp.index)] = MainParamSource(
                bp.model_param, bp.param_start, bp.param_end
            )
        sources.append(
            [[found[(g, k)] for k in range(len(group["params"]))] for g, group in enumerate(groups)]
        )
    return sources
