"""Sparse all-reduce of flat gradient buckets: the compressed data-parallel exchange of LowDiff.

Each rank compresses its bucket (top-k of gradient + error-feedback residual, see
:mod:`megatron_diffckpt.compression`), the ranks all-gather the kept values and their ``int32``
indices (every rank keeps the same ``k`` for a bucket of the same size, so the gathers are
fixed-size), and every rank writes the sum of the contributions, added in rank order, into its
bucket: the dense result a reduce-scatter or an all-reduce would have left there, restricted to
what the ranks sent. The distributed optimizer then takes its shard of it, as it would after a
reduce-scatter, so its optimizer input is sparse and its differential is small.

Determinism: contributions are added one rank at a time with ``index_add_`` over indices that
are unique within a contribution, so the result does not depend on scheduling, on any device.
With ``ratio=1.0`` every entry is kept; the result then differs from a reduce-scatter's only by
the order of the floating-point additions (identical for two ranks, where ``a + b == b + a``).

Collective rule: the ranks of ``group`` call :meth:`SparseAllReduce.start` for the same buckets
in the same order (megatron's bucket order, which is the same on every data-parallel rank), and
call ``wait()`` on what it returns before reading the buckets.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_diffckpt.compression import Compressor


class ErrorFeedbackResiduals:
    """This rank's error-feedback residual per bucket: local training state (invariant 6).

    Residuals are created as zeros the first time a bucket is compressed, in the bucket's dtype.
    :meth:`state_dict` / :meth:`load_state_dict` carry them into and out of a base checkpoint.
    """

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}

    def get(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """The residual of bucket ``key``, shaped and typed like the flat bucket ``like``."""
        residual = self._residuals.get(key)
        if residual is None:
            residual = torch.zeros(like.numel(), dtype=like.dtype, device=like.device)
            self._residuals[key] = residual
        elif residual.numel() != like.numel() or residual.dtype != like.dtype:
            raise ValueError(
                f"error-feedback residual {key!r} is {residual.numel()} x {residual.dtype}, "
                f"the bucket is {like.numel()} x {like.dtype}"
            )
        elif residual.device != like.device:  # loaded from a checkpoint onto the host
            residual = residual.to(like.device)
            self._residuals[key] = residual
        return residual

    def keys(self) -> list[str]:
        return sorted(self._residuals)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The residuals themselves (not copies: read them between steps)."""
        return dict(self._residuals)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of every residual on the CPU (safe to save while training goes on)."""
        return {k: self._residuals[k].detach().to("cpu", copy=True) for k in self.keys()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the residuals (copies; moved to the bucket's device on first use); a bucket
        absent from ``state`` starts from zero."""
        for key, value in state.items():
            if not torch.is_tensor(value) or value.dim() != 1:
                raise ValueError(f"error-feedback residual {key!r} is not a flat tensor")
        self._residuals = {k: v.detach().clone() for k, v in state.items()}

    def nbytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self._residuals.values())


class _BucketExchange:
    """One bucket's gathers in flight; ``finish()`` writes the summed result into the bucket."""

    def __init__(self, bucket: torch.Tensor, values, indices, k: int, world: int, average: bool):
        self.bucket, self.k, self.world, self.average = bucket, k, world, average
        self.values = torch.empty(world * k, dtype=values.dtype, device=values.device)
        self.indices = torch.empty(world * k, dtype=torch.int32, device=indices.device)
        self._sent = (values, indices)  # kept alive until the gathers complete

    def launch(self, group, async_op: bool) -> list:
        values, indices = self._sent
        works = [
            dist.all_gather_into_tensor(self.values, values, group=group, async_op=async_op),
            dist.all_gather_into_tensor(self.indices, indices, group=group, async_op=async_op),
        ]
        return [w for w in works if w is not None]

    def finish(self) -> None:
        self.bucket.zero_()
        for r in range(self.world):
            part = slice(r * self.k, (r + 1) * self.k)
            self.bucket.index_add_(0, self.indices[part].long(), self.values[part])
        if self.average:
            self.bucket.div_(self.world)
        self._sent = None


class PendingExchange:
    """The exchanges started by one :meth:`SparseAllReduce.start`; ``wait()`` completes them.

    It stands where megatron keeps the handle of an asynchronous reduce-scatter, so megatron's
    own ``finish_grad_sync`` calls ``wait()``.
    """

    def __init__(self, exchanges: list[_BucketExchange], works: list):
        self._exchanges = exchanges
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        for exchange in self._exchanges:
            exchange.finish()
        self._works, self._exchanges = [], []


class SparseAllReduce:
    """Compressed all-reduce of flat buckets with per-bucket error feedback.

    Args:
        compressor: a :class:`~megatron_diffckpt.compression.TopKCompressor` (error feedback on
            or off).
        residuals: where this rank's residuals live (saved with every base).
    """

    def __init__(self, compressor: Compressor, residuals: ErrorFeedbackResiduals | None = None):
        self.compressor = compressor
        self.residuals = residuals if residuals is not None else ErrorFeedbackResiduals()

    def start(
        self,
        buckets: list[tuple[str, torch.Tensor]],
        group: dist.ProcessGroup | None,
        average: bool,
        async_op: bool,
    ) -> PendingExchange:
        """Compress every ``(key, flat bucket)`` and start its exchange. All ranks of ``group``.

        ``average`` divides the sum by the group size (megatron's ``average_in_collective``;
        otherwise the caller has scaled the buckets already). With ``async_op=False`` the
        exchange has completed on return, but ``wait()`` must still be called to write the result.
        """
        world = dist.get_world_size(group)
        exchanges, works = [], []
        for key, bucket in buckets:
            if bucket.dim() != 1:
                raise ValueError(f"bucket {key!r} must be a flat view")
            residual = self.residuals.get(key, bucket) if _uses_residual(self.compressor) else None
            sent = self.compressor.compress(bucket, residual)
            if sent.indices is None:  # dense contribution: every entry, in order
                indices = torch.arange(sent.numel, dtype=torch.int32, device=bucket.device)
            else:
                indices = sent.indices
            values = sent.values.to(bucket.dtype)
            exchange = _BucketExchange(bucket, values, indices, values.numel(), world, average)
            works += exchange.launch(group, async_op)
            exchanges.append(exchange)
        return PendingExchange(exchanges, works)


def _uses_residual(compressor: Compressor) -> bool:
    return bool(getattr(compressor, "error_feedback", False))
