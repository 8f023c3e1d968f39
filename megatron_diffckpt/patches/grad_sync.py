"""Hook point: the gradient reduction of megatron DDP's bucket groups (compressed exchange).

``_ParamAndGradBucketGroup.start_grad_sync`` reduces every bucket of a group across the
data-parallel ranks (a reduce-scatter with the distributed optimizer, an all-reduce without),
synchronously or, with ``--overlap-grad-reduce``, asynchronously from the backward hooks as soon
as the group's gradients are ready; ``finish_grad_sync`` waits on the handle it left in
``grad_reduce_handle`` (or, without overlap, calls ``start_grad_sync`` itself).

:func:`attach` replaces ``start_grad_sync`` of each bucket group of the given DDP modules (per
instance, not class-wide) with the compressed exchange of :mod:`megatron_diffckpt.exchange`:
same bookkeeping (first-batch rule, one outstanding handle, gradient checks, the bucket's
``gradient_scaling_factor``, ``average_in_collective``), same process group, and a
:class:`~megatron_diffckpt.exchange.PendingExchange` as the handle, so megatron's own
``finish_grad_sync`` and ``register_grad_ready`` drive it unchanged, with and without overlap.

Written for megatron-core 0.16.1; what 0.17 to 0.19 added at the top of ``start_grad_sync``
(waiting on CUDA-graph gradient events, copying a separately accumulated fp32 ``.main_grad``
into the buffer) is done too, and is a no-op where those do not exist.

Not supported (refused at attach): several distributed-optimizer instances
(``num_distributed_optimizer_instances > 1``) and ``reduce_scatter_with_fp32_accumulation``.
"""

from __future__ import annotations

from typing import Any

from megatron_diffckpt.compression import TopKCompressor
from megatron_diffckpt.exchange import SparseAllReduce
from megatron_diffckpt.patches.base import MethodPatch, PatchSet

_BUCKETS = "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup"

# Drift check only: attach() wraps instances. finish_grad_sync and register_grad_ready are the
# callers of start_grad_sync whose protocol (call it, then wait() on grad_reduce_handle) the
# replacement keeps.
PATCHES = PatchSet(
    (
        MethodPatch(
            target=f"{_BUCKETS}.start_grad_sync",
            expected_signature="(self, force_all_reduce: Optional[bool] = False)",
            make_wrapper=lambda original: original,
            purpose="exchange top-k compressed gradients instead of reducing dense buckets",
            requires=(
                (
                    f"{_BUCKETS}.finish_grad_sync",
                    "(self, force_all_reduce: Optional[bool] = False)",
                ),
                (
                    f"{_BUCKETS}.register_grad_ready",
                    "(self, param: torch.nn.parameter.Parameter, "
                    "force_all_reduce: Optional[bool] = False)",
                ),
                (f"{_BUCKETS}.check_grads", "(self, check_for_nan_or_inf, check_for_large)"),
            ),
        ),
    )
)
check_drift = PATCHES.check_drift

_ATTACHED = "_diffckpt_sparse_all_reduce"


def bucket_groups(ddp: Any) -> list[Any]:
    """The bucket groups of one megatron DDP module, dense then expert-parallel (megatron order)."""
    return list(ddp.bucket_groups) + list(getattr(ddp, "expert_parallel_bucket_groups", []))


def attach(model_chunks: list[Any], exchange: SparseAllReduce) -> None:
    """Reduce the gradients of every DDP module in ``model_chunks`` with ``exchange``. Any rank.

    Bucket ``j`` of group ``g`` of chunk ``c`` keeps its residual under ``"c{c}.g{g}.b{j}"``.
    """
    check_drift()
    for c, ddp in enumerate(model_chunks):
        config = ddp.ddp_config
        if config.num_distributed_optimizer_instances > 1:
            raise ValueError(
                "compressed gradient exchange supports one distributed-optimizer instance; "
                "got num_distributed_optimizer_instances="
                f"{config.num_distributed_optimizer_instances}"
            )
        if config.reduce_scatter_with_fp32_accumulation:
            raise ValueError(
                "compressed gradient exchange replaces the reduce-scatter; "
                "turn off reduce_scatter_with_fp32_accumulation"
            )
        for g, group in enumerate(bucket_groups(ddp)):
            if hasattr(group, _ATTACHED):
                raise RuntimeError("a compressed gradient exchange is already attached")
            keys = [f"c{c}.g{g}.b{j}" for j in range(len(group.buckets))]
            setattr(group, _ATTACHED, exchange)
            group.start_grad_sync = _make_start_grad_sync(group, exchange, keys)


def attach_compressor(
    model_chunks: list[Any], compressor: str, topk_ratio: float
) -> SparseAllReduce | None:
    """The exchange ``--diffckpt-compressor`` asks for, attached to ``model_chunks``; ``None``
    (megatron's dense reduction) for ``none``. Any rank; both training entries use it."""
    if compressor == "none":
        return None
    exchange = SparseAllReduce(TopKCompressor(topk_ratio))
    attach(model_chunks, exchange)
    return exchange


def detach(model_chunks: list[Any]) -> None:
    """Restore megatron's dense reduction. Any rank; idempotent."""
    for ddp in model_chunks:
        for group in bucket_groups(ddp):
            if hasattr(group, _ATTACHED):
                del group.start_grad_sync  # the instance attribute; the class method remains
                delattr(group, _ATTACHED)


def _make_start_grad_sync(group: Any, exchange: SparseAllReduce, keys: list[str]):
    config = group.ddp_config
    process_group = (
        group.intra_distributed_optimizer_instance_group
        if config.use_distributed_optimizer
        else group.data_parallel_group
    )

    def start_grad_sync(force_all_reduce: bool | None = False) -> None:
        # The exchange leaves the whole bucket reduced, as an all-reduce would: force_all_reduce
        # needs nothing more.
        if group.is_first_batch and group.grad_reduce_handle is not None:
            return  # already dispatched in the first batch (megatron's rule)
        assert group.grad_reduce_handle is None, "one gradient exchange at a time per bucket group"
        _wait_for_cuda_graph_gradients(group)
        _copy_in_extra_main_grads(group)
        if config.check_for_nan_in_grad or config.check_for_large_grads:
            group.check_grads(
                check_for_nan_or_inf=config.check_for_nan_in_grad,
                check_for_large=config.check_for_large_grads,
            )
        for bucket in group.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
        pending = exchange.start(
            [
                (key, bucket.grad_data.view(-1))
                for key, bucket in zip(keys, group.buckets, strict=True)
            ],
            process_group,
            average=config.average_in_collective,
            async_op=config.overlap_grad_reduce,
        )
        if config.overlap_grad_reduce:
            group.grad_reduce_handle = pending  # finish_grad_sync waits on it
        else:
            pending.wait()
            group.grad_reduce_handle = None

    return start_grad_sync


def _wait_for_cuda_graph_gradients(group: Any) -> None:
    """What megatron-core 0.19 does first in ``start_grad_sync``: a local CUDA graph replay
    accumulates gradients asynchronously and marks a parameter's with an event; the current
    stream waits on each before the buckets are read. A no-op without CUDA graphs."""
    events = {
        id(event): event
        for bucket in group.buckets
        for param in bucket.params_list
        if (event := getattr(param, "_cudagraph_wgrad_ready_event", None)) is not None
    }
    if events:
        import torch

        stream = torch.cuda.current_stream()
        for event in events.values():
            stream.wait_event(event)


def _copy_in_extra_main_grads(group: Any) -> None:
    """What megatron-core 0.17 and later do first in ``start_grad_sync``: a parameter whose
    gradient is accumulated locally in a separate fp32 ``.main_grad`` has it copied into the
    communication buffer before the collective (megatron's ``finish_grad_sync`` copies the
    reduced result back). A no-op in 0.16, whose buckets have no such parameters."""
    for bucket in group.buckets:
        for param in getattr(bucket, "params_with_extra_main_grads", ()):
            copy_in = getattr(param, "main_grad_copy_in_grad_buffer", None)
            if copy_in is not None:
                copy_in.copy_(param.main_grad)
