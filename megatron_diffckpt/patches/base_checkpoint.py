"""Hook point: megatron ``dist_checkpointing`` bases (what differential checkpointing adds to them,
and how a LowDiff+ base is written from its ``AsyncRequest``).

Both training entries (the GPT example on megatron-core, and Megatron-LM's ``megatron.training``
through :mod:`megatron_diffckpt.integrations.megatron_lm`) save bases with their own save path;
this module holds what they share, so that no training loop copies it:

- :func:`residuals_state` / :func:`load_residuals`: the compressed exchange's error-feedback
  residuals (local training state no gradient can rebuild, invariant 6) as one
  ``ShardedObject`` per (PP, TP, DP) rank under a key that names the layout. A checkpoint
  without them (dense training, another layout) loads with a warning and zero residuals.
- :func:`split_async_request`: an unscheduled megatron ``AsyncRequest`` as the two halves the
  LowDiff+ strategy runs itself: ``write`` (stage, then write this rank's files: the persister
  thread) and ``finalize`` (metadata last, then the loop's own finalize functions, e.g. the
  tracker: all ranks together, once every rank has written). The request's fields are
  drift-checked (``AsyncRequest`` is a ``NamedTuple`` in the tested releases).

Collective rule: :func:`load_residuals` is called by all ranks together; ``finalize`` of
:func:`split_async_request` too; the rest by any rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from megatron_diffckpt.patches.base import MethodPatch, PatchSet

logger = logging.getLogger(__name__)

_ASYNC = "megatron.core.dist_checkpointing.strategies.async_utils"

# Drift check only: split_async_request reads these fields and runs them as megatron's own
# AsyncRequest.execute_sync does (stage with preload_fn, then async_fn), minus its barrier.
PATCHES = PatchSet(
    (
        MethodPatch(
            target=f"{_ASYNC}:AsyncRequest",
            expected_signature="(async_fn: Optional[Callable], async_fn_args: Tuple, "
            "finalize_fns: List[Callable], async_fn_kwargs: Dict = {}, preload_fn: Callable = "
            "None, is_frozen: bool = False, call_idx: int = 0)",
            make_wrapper=lambda original: original,
            purpose="write a LowDiff+ base from the replica on the persister thread",
            requires=((f"{_ASYNC}:AsyncRequest.execute_sync", "(self) -> None"),),
        ),
    )
)
check_drift = PATCHES.check_drift

RESIDUALS_KEY = "diffckpt_error_feedback"
"""Prefix of the residuals' key; the full key names the (PP, TP, DP) sizes."""


def _layout() -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    from megatron.core import parallel_state as mpu

    coords = (
        mpu.get_pipeline_model_parallel_rank(),
        mpu.get_tensor_model_parallel_rank(),
        mpu.get_data_parallel_rank(),
    )
    sizes = (
        mpu.get_pipeline_model_parallel_world_size(),
        mpu.get_tensor_model_parallel_world_size(),
        mpu.get_data_parallel_world_size(),
    )
    return coords, sizes


def residuals_key() -> str:
    """The residuals' key for this run's layout: residuals of another layout cannot be mapped to
    this one's buckets, and a key a checkpoint lacks is simply not loaded."""
    pp, tp, dp = _layout()[1]
    return f"{RESIDUALS_KEY}.pp{pp}.tp{tp}.dp{dp}"


def residuals_state(residuals: Any) -> dict[str, Any]:
    """``{key: ShardedObject}`` of this rank's error-feedback residuals, to add to a base's
    sharded state dict (one object per rank, no replicas). Any rank."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    coords, sizes = _layout()
    return {
        residuals_key(): ShardedObject(
            residuals_key(), residuals.state_dict(), sizes, coords, replica_id=0
        )
    }


def load_residuals(checkpoint: str, residuals: Any) -> bool:
    """Load this rank's residuals from the base in ``checkpoint`` (an ``iter_N`` folder) when it
    holds them for this layout; otherwise they stay zero, with a warning (training goes on, the
    gradient mass they held is lost). All ranks, collectively. Returns whether they loaded."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    template = residuals_state(residuals)
    state, _missing, unexpected = dist_checkpointing.load(
        template, checkpoint, strict=StrictHandling.RETURN_UNEXPECTED
    )
    key = residuals_key()
    if key in unexpected or key not in state:
        logger.warning(
            "%s holds no error-feedback residuals for this layout: they start from zero",
            checkpoint,
        )
        return False
    residuals.load_state_dict(state[key])
    return True


def split_async_request(request: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """``(write, finalize)`` of an unscheduled megatron ``AsyncRequest`` (see the module doc)."""
    check_drift()
    if request is None or not hasattr(request, "finalize_fns"):
        raise TypeError(
            "a LowDiff+ base needs the save function to return the AsyncRequest of an "
            f"asynchronous dist_checkpointing save, got {type(request).__name__}"
        )

    def write() -> None:
        args = list(request.async_fn_args)
        if request.preload_fn is not None:  # stage (a no-op copy for host tensors)
            args[1] = request.preload_fn()
        if request.async_fn is not None:
            request.async_fn(*args, **request.async_fn_kwargs)

    def finalize() -> None:
        for fn in request.finalize_fns:
            fn()

    return write, finalize
