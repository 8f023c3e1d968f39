"""Hook point: the distributed optimizer's checkpoint state, served from the LowDiff+ replica.

A LowDiff+ base is a stock megatron ``dist_checkpointing`` checkpoint whose tensors come from the
host replica instead of the training device:

- the optimizer part is what megatron's own ``DistributedOptimizer.sharded_state_dict`` builds
  (same keys, same ``dp_reshardable`` bucket layout, the same common state), called on a *view* of
  the training optimizer whose torch optimizer is the replica's (:func:`replica_view`); megatron
  reads the main parameters and the Adam state through ``self.optimizer`` and
  ``model_param_group_index_map`` (``_get_main_param_and_optimizer_states``), so the state dict
  it returns references the replica's host tensors;
- the model part is the model's own ``sharded_state_dict`` with each parameter replaced by a host
  tensor (:class:`ReplicaModelParams`), filled from the replica's main-parameter shards by an
  all-gather over the data-parallel ranks (on a host group of the persister thread) and a cast
  to the parameter's dtype (megatron's ``_copy_main_params_to_model_params`` does the same cast).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from megatron_diffckpt.patches.base import MethodPatch, PatchSet
from megatron_diffckpt.patches.bucket_snapshot import bucket_key
from megatron_diffckpt.patches.optimizer_layout import param_ranges_in_bucket
from megatron_diffckpt.patches.optimizer_step import inner_optimizers
from megatron_diffckpt.replica_merger import ShardLayout

_DISTOPT = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"

# Drift check only: replica_view() relies on these reading the state through self.optimizer.
PATCHES = PatchSet(
    (
        MethodPatch(
            target=f"{_DISTOPT}._get_main_param_and_optimizer_states",
            expected_signature="(self, model_param)",
            make_wrapper=lambda original: original,
            purpose="build a stock optimizer checkpoint from the LowDiff+ host replica",
            requires=(
                (
                    f"{_DISTOPT}.sharded_state_dict",
                    "(self, model_sharded_state_dict: Dict[str, Any] = {}, is_loading: bool = "
                    "False, sharding_type: Optional[str] = None, metadata: Optional[dict] = None)",
                ),
                (f"{_DISTOPT}.state_dict", "(self)"),
            ),
        ),
    )
)
check_drift = PATCHES.check_drift


def replica_view(optimizer: Any, replicas: list[torch.optim.Optimizer | None]) -> Any:
    """A shallow copy of the megatron ``optimizer`` whose inner torch optimizers are
    ``replicas``: its ``sharded_state_dict()`` and ``state_dict()`` describe the replica. Read
    only; never step it. Any rank."""
    check_drift()
    views = []
    for inner, replica in zip(inner_optimizers(optimizer), replicas, strict=True):
        if replica is None:
            views.append(inner)
            continue
        view = copy.copy(inner)
        view.optimizer = replica
        views.append(view)
    if hasattr(optimizer, "chained_optimizers"):
        chained = copy.copy(optimizer)
        chained.chained_optimizers = views
        return chained
    return views[0]


class ReplicaModelParams:
    """Host copies of this rank's model parameters, rebuilt from the replica's shards.

    Built on the training thread; :meth:`fill` runs on the persister thread, collectively over
    ``host_groups`` (per inner optimizer, a gloo group of the same ranks as its data-parallel
    group: the dense one, and with mixture of experts the expert-data-parallel one).
    """

    def __init__(self, optimizer: Any, layout: ShardLayout, host_groups: list[Any]):
        self.host_groups = host_groups
        self.params: dict[int, torch.Tensor] = {}  # id(model param) -> host tensor
        self._by_ptr: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        self._buckets = []  # (key, inner optimizer, world numel, [(start, end, host)])
        for i, inner in enumerate(inner_optimizers(optimizer)):
            if getattr(inner, "is_stub_optimizer", False):
                continue
            for gbuf_idx, buffer in enumerate(inner.buffers):
                for bucket_idx, bucket in enumerate(buffer.buckets):
                    entries = []
                    for param, start, end in param_ranges_in_bucket(buffer, bucket):
                        host = torch.empty(param.shape, dtype=param.dtype, device="cpu")
                        self.params[id(param)] = host
                        self._by_ptr[(param.data_ptr(), param.numel(), param.dtype)] = host
                        entries.append((start, end, host))
                    self._buckets.append(
                        (bucket_key(i, gbuf_idx, bucket_idx), i, bucket.grad_data.numel(), entries)
                    )
        self._layout = layout
        self.nbytes = sum(host.nbytes for host in self.params.values())
        """Host memory of the parameters (each base's gather allocates one bucket at a time on
        top)."""

    def substitute(self, model_sharded_state_dict: dict) -> dict:
        """``model_sharded_state_dict`` with every parameter's data replaced by its host copy
        (other tensors, e.g. buffers, copied to host now). Any rank."""
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        def swap(x):
            if isinstance(x, ShardedTensor | ShardedTensorFactory) and torch.is_tensor(x.data):
                data = x.data
                host = self._by_ptr.get((data.data_ptr(), data.numel(), data.dtype))
                x.data = host if host is not None else data.detach().to("cpu", copy=True)
            return x

        return dict_list_map_inplace(swap, model_sharded_state_dict)

    @torch.no_grad()
    def fill(self, replicas: list[torch.optim.Optimizer | None]) -> None:
        """Gather the replica's main-parameter shards of every bucket over the data-parallel
        ranks that shard it and cast them into the host parameters. The persister thread,
        collectively over ``host_groups``."""
        flat_shards: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
        for i, replica in enumerate(replicas):
            if replica is None:
                continue
            for g, group in enumerate(replica.param_groups):
                for k, p in enumerate(group["params"]):
                    where = self._layout[i][g][k]
                    flat_shards.setdefault(where.bucket, []).append((where.start, where.end, p))
        for key, inner, world_numel, entries in self._buckets:
            group = self.host_groups[inner]
            world = torch.distributed.get_world_size(group)
            local = torch.zeros(world_numel // world, dtype=torch.float32)
            for start, end, p in flat_shards.get(key, []):
                local[start:end] = p.detach().reshape(-1)
            if world > 1:
                full = torch.empty(world_numel, dtype=torch.float32)
                torch.distributed.all_gather_into_tensor(full, local, group=group)
            else:
                full = local
            for start, end, host in entries:
                host.copy_(full[start:end].view(host.shape))
