"""Hook points of LowDiff+'s snapshots: DDP bucket reductions, gradient clipping, shard layout.

1. ``_ParamAndGradBucketGroup.start_grad_sync`` (per bucket-group instance): after megatron has
   started a group's reduction (asynchronously from the backward hooks with
   ``--overlap-grad-reduce``, or synchronously from ``finish_grad_sync``), each bucket's shard that
   this rank owns is handed to the :class:`~megatron_diffckpt.snapshot.BucketSnapshotter` with the
   reduction's handle; the copy happens once the reduction completes.
2. ``clip_grad_by_total_norm_fp32`` as ``megatron.core.optimizer.optimizer`` calls it (a module
   global, used by both the single and the chained optimizer): before megatron scales the
   gradients in place, the snapshot copies are flushed and the coefficient is recorded (the same
   expression, ``max_norm / (total_norm + 1.0e-6)``, checked against the source).
3. The distributed optimizer's shard layout (``gbuf_ranges``): where each main parameter's
   gradient sits in this rank's shard of a bucket.

Waiting on a reduction's handle is not idempotent everywhere: with gloo, every ``wait()`` copies
the reduction's result into the bucket again. Once megatron's ``finish_grad_sync`` has waited, the
bucket may change (the shared-embedding all-reduce, clipping), so a late ``wait()`` would undo
those changes. The snapshot's handle (:class:`_GuardedReduction`) therefore waits only while
megatron has not, under a per-group lock that megatron's ``finish_grad_sync`` (wrapped per
instance) also holds.

Gradients that megatron changes *after* the DP reduction (the word-embedding gradient shared by
the first and last pipeline stages, and the tensor-parallel-replicated ones of
``_allreduce_non_tensor_model_parallel_grads``) are copied again at the flush, from their final
values.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch

from megatron_diffckpt.patches.base import MegatronDriftError, MethodPatch, PatchSet
from megatron_diffckpt.patches.grad_sync import bucket_groups
from megatron_diffckpt.patches.optimizer_layout import bucket_params, param_ranges_in_bucket
from megatron_diffckpt.patches.optimizer_step import inner_optimizers
from megatron_diffckpt.replica_merger import ParamSlice, ShardLayout
from megatron_diffckpt.snapshot import BucketSnapshotter

_BUCKETS = "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup"
_CLIP = "megatron.core.optimizer.optimizer:clip_grad_by_total_norm_fp32"
_CLIP_SIGNATURE = (
    "(parameters: Union[List[torch.Tensor], torch.Tensor], max_norm: Union[int, float], "
    "total_norm: float, use_decoupled_grad: bool = False)"
)
_CLIP_EXPRESSION = "clip_coeff = max_norm / (total_norm + 1.0e-6)"

# on_clip(parameters, coefficient): called before megatron clips ``parameters``' gradients.
ClipObserver = Callable[[list[torch.Tensor], float | None], None]
_observers: list[ClipObserver] = []


def _clip_wrapper(original: Callable) -> Callable:
    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if _observers:
            params = list(parameters) if not torch.is_tensor(parameters) else [parameters]
            coeff = max_norm / (total_norm + 1.0e-6)  # megatron's expression, checked below
            for observer in list(_observers):
                observer(params, coeff if coeff < 1.0 else None)
            parameters = params
        return original(parameters, max_norm, total_norm, use_decoupled_grad)

    return clip_grad_by_total_norm_fp32


PATCHES = PatchSet(
    (
        MethodPatch(
            target=_CLIP,
            expected_signature=_CLIP_SIGNATURE,
            make_wrapper=_clip_wrapper,
            purpose="record the gradient-clipping coefficient of every step (LowDiff+)",
        ),
        # Drift check only: attach() wraps instances.
        MethodPatch(
            target=f"{_BUCKETS}.start_grad_sync",
            expected_signature="(self, force_all_reduce: Optional[bool] = False)",
            make_wrapper=lambda original: original,
            purpose="snapshot each reduced gradient bucket to host memory (LowDiff+)",
            requires=(
                (
                    f"{_BUCKETS}.finish_grad_sync",
                    "(self, force_all_reduce: Optional[bool] = False)",
                ),
            ),
        ),
    )
)


def check_drift() -> None:
    """Signatures, and the clipping expression the recorded coefficient reproduces."""
    PATCHES.check_drift()
    clip = PATCHES.patches[0]
    source = inspect.getsource(inspect.unwrap(clip.current()))
    if _CLIP_EXPRESSION not in source or "if clip_coeff < 1.0" not in source:
        raise MegatronDriftError(
            f"megatron-core drift at {_CLIP}: LowDiff+ reproduces the clipping coefficient as "
            f"'{_CLIP_EXPRESSION}' applied when < 1.0, and the installed source differs; "
            "update patches/bucket_snapshot.py after checking the new code"
        )


def apply() -> None:
    check_drift()
    PATCHES.apply()


def revert() -> None:
    PATCHES.revert()


def add_clip_observer(observer: ClipObserver) -> None:
    """Call ``observer`` before every gradient clipping. Any rank; applies the patch."""
    apply()
    if observer not in _observers:
        _observers.append(observer)


def remove_clip_observer(observer: ClipObserver) -> None:
    if observer in _observers:
        _observers.remove(observer)


def _distributed_optimizers(optimizer: Any) -> list[Any]:
    found = []
    for inner in inner_optimizers(optimizer):
        if getattr(inner, "is_stub_optimizer", False):
            found.append(None)
            continue
        if not hasattr(inner, "gbuf_ranges"):
            raise ValueError(
                "--diffckpt-mode lowdiff-plus needs megatron's distributed optimizer "
                "(--use-distributed-optimizer): its replica follows the optimizer's bucket "
                f"shards; got {type(inner).__name__}"
            )
        if getattr(inner.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
            raise ValueError(
                "--diffckpt-mode lowdiff-plus does not support the precision-aware "
                "optimizer (--use-precision-aware-optimizer)"
            )
        if getattr(inner, "grad_scaler", None) is not None:
            raise ValueError(
                "--diffckpt-mode lowdiff-plus does not support fp16 loss scaling yet; "
                "train with --bf16 or fp32"
            )
        found.append(inner)
    return found


def bucket_key(inner: int, gbuf: int, bucket: int) -> str:
    return f"o{inner}.gbuf{gbuf}.b{bucket}"


def shard_layout(optimizer: Any) -> tuple[ShardLayout, dict[str, tuple[int, torch.dtype]], dict]:
    """This rank's shard layout. Any rank.

    Returns ``(layout, shards, keys)``: ``layout[inner][group][index]`` is the
    :class:`~megatron_diffckpt.replica_merger.ParamSlice` of each torch-optimizer parameter;
    ``shards`` maps every bucket key to ``(numel, dtype)`` of this rank's shard; ``keys`` maps
    ``id(bucket)`` (megatron's bucket objects) to its key.
    """
    layout: ShardLayout = []
    shards: dict[str, tuple[int, torch.dtype]] = {}
    keys: dict[int, str] = {}
    for i, inner in enumerate(_distributed_optimizers(optimizer)):
        if inner is None:
            layout.append([])
            continue
        slices: dict[tuple[int, int], ParamSlice] = {}
        dp_size = inner.data_parallel_group.size()
        for gbuf_idx, buffer in enumerate(inner.buffers):
            for bucket_idx, bucket in enumerate(buffer.buckets):
                key = bucket_key(i, gbuf_idx, bucket_idx)
                keys[id(bucket)] = key
                shards[key] = (bucket.grad_data.numel() // dp_size, bucket.grad_data.dtype)
        for bp in bucket_params(inner):
            key = bucket_key(i, bp.gbuf_idx, bp.bucket_idx)
            slices[(bp.group, bp.index)] = ParamSlice(key, bp.local_start, bp.local_end)
        layout.append(
            [
                [slices[(g, k)] for k in range(len(group["params"]))]
                for g, group in enumerate(inner.optimizer.param_groups)
            ]
        )
    return layout, shards, keys


def _local_shard(bucket_group: Any, bucket: Any) -> torch.Tensor:
    """This rank's part of ``bucket.grad_data`` after the group's reduction."""
    data = bucket.grad_data
    if not bucket_group.ddp_config.use_distributed_optimizer:
        return data
    size = bucket_group.intra_distributed_optimizer_instance_size
    rank = bucket_group.intra_distributed_optimizer_instance_rank
    n = data.numel() // size
    return data[rank * n : (rank + 1) * n]


def _changed_after_reduction(param: Any, sequence_parallel: bool) -> bool:
    """Gradients megatron's ``finalize_model_grads`` all-reduces again after the DP reduction."""
    return (
        getattr(param, "shared_embedding", False)
        or getattr(param, "average_gradients_across_tp_domain", False)
        or (sequence_parallel and getattr(param, "sequence_parallel", False))
    )


_ATTACHED = "_diffckpt_snapshot_start_grad_sync"


class _GuardedReduction:
    """A bucket group's reduction handle that the snapshot worker may wait on only until
    megatron's ``finish_grad_sync`` has (see the module docstring)."""

    def __init__(self, handle: Any, lock: threading.Lock):
        self.handle = handle
        self.lock = lock
        self.finished = False  # megatron's finish_grad_sync has returned

    def wait(self) -> None:
        with self.lock:
            if not self.finished and self.handle is not None:
                self.handle.wait()


def attach(model_chunks: list[Any], optimizer: Any, snapshotter: BucketSnapshotter) -> None:
    """Snapshot every bucket of ``model_chunks`` when its reduction starts. Any rank.

    Also registers, with the snapshotter, the gradient ranges to copy again at the flush.
    """
    check_drift()
    _, _, keys = shard_layout(optimizer)
    refresh = []
    for ddp in model_chunks:
        sequence_parallel = bool(getattr(ddp.config, "sequence_parallel", False))
        buffer_of = {
            id(bucket): buffer
            for buffer in list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))
            for bucket in buffer.buckets
        }
        for bucket_group in bucket_groups(ddp):
            if hasattr(bucket_group, _ATTACHED):
                raise RuntimeError("LowDiff+ snapshots are already attached to this model")
            for bucket in bucket_group.buckets:
                shard = _local_shard(bucket_group, bucket)
                start_of_shard = shard.data_ptr() - bucket.grad_data.data_ptr()
                offset = start_of_shard // bucket.grad_data.element_size()
                for param, p_start, p_end in param_ranges_in_bucket(buffer_of[id(bucket)], bucket):
                    if not _changed_after_reduction(param, sequence_parallel):
                        continue
                    lo, hi = max(p_start, offset), min(p_end, offset + shard.numel())
                    if lo < hi:
                        start, end = lo - offset, hi - offset
                        refresh.append((keys[id(bucket)], start, end, shard[start:end]))
            original = bucket_group.start_grad_sync
            original_finish = bucket_group.finish_grad_sync
            lock = threading.Lock()
            current: list[_GuardedReduction] = []

            def start_grad_sync(
                force_all_reduce=False, _original=original, _group=bucket_group, _lock=lock,
                _current=current,
            ):  # fmt: skip
                snapshotter.before_reduction()
                _original(force_all_reduce=force_all_reduce)
                handle = _group.grad_reduce_handle
                if handle is not None and any(r.handle is handle for r in _current):
                    return  # megatron's no-op restart of an already dispatched reduction
                reduction = _GuardedReduction(handle, _lock)
                _current.append(reduction)
                for b in _group.buckets:
                    snapshotter.on_bucket_ready(keys[id(b)], _local_shard(_group, b), reduction)

            def finish_grad_sync(
                force_all_reduce=False, _original=original_finish, _lock=lock, _current=current
            ):
                with _lock:
                    result = _original(force_all_reduce=force_all_reduce)
                    for reduction in _current:
                        reduction.finished = True
                    _current.clear()
                return result

            setattr(bucket_group, _ATTACHED, original)
            bucket_group.start_grad_sync = start_grad_sync
            bucket_group.finish_grad_sync = finish_grad_sync
    snapshotter.refresh_at_flush = refresh


def detach(model_chunks: list[Any]) -> None:
    """Remove the snapshot hooks. Any rank; idempotent."""
    for ddp in model_chunks:
        for bucket_group in bucket_groups(ddp):
            if hasattr(bucket_group, _ATTACHED):
                del bucket_group.start_grad_sync
                del bucket_group.finish_grad_sync
                delattr(bucket_group, _ATTACHED)
