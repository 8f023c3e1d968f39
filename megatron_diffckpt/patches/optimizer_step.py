"""Hook point: each inner megatron optimizer's ``step_with_ready_grads``.

``MegatronOptimizer.step()`` (and ``ChainedOptimizer.step()``) first prepares the gradients (copy
to the main-parameter shard, unscale, inf check, clipping) and then calls
``step_with_ready_grads()`` on every inner optimizer, which runs the torch optimizer on the main
shard and copies the result to the model (the distributed optimizer also all-gathers it). At the
entry of ``step_with_ready_grads`` the main shard's ``.grad`` tensors are therefore *exactly* the
input of this rank's optimizer step: that is where differentials are captured, and where replay
feeds recorded inputs back through the very same code.

The hook is per instance (the optimizer object of one training run), not a class-wide patch:
:func:`attach` wraps the bound method of each inner optimizer, :func:`detach` restores it, and
:func:`step_without_hook` runs the original for replay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_diffckpt.patches.base import MethodPatch, PatchSet

_OPT = "megatron.core.optimizer"

# Drift check only: attach() relies on these signatures, but wraps instances, not classes.
PATCHES = PatchSet(
    tuple(
        MethodPatch(
            target=target,
            expected_signature="(self) -> bool",
            make_wrapper=lambda original: original,
            purpose="capture and replay the exact input of each optimizer step",
        )
        for target in (
            f"{_OPT}.optimizer:MixedPrecisionOptimizer.step_with_ready_grads",
            f"{_OPT}.optimizer:FP32Optimizer.step_with_ready_grads",
            f"{_OPT}.optimizer:ChainedOptimizer.step_with_ready_grads",
            f"{_OPT}.distrib_optimizer:DistributedOptimizer.step_with_ready_grads",
        )
    )
)
check_drift = PATCHES.check_drift

_ORIGINAL = "_diffckpt_step_with_ready_grads"

# on_ready_grads(inner_index, torch_optimizer): called before each inner optimizer's step.
ReadyGradsHook = Callable[[int, Any], None]


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The megatron optimizers that own a torch optimizer, in ChainedOptimizer order."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def attach(optimizer: Any, on_ready_grads: ReadyGradsHook) -> None:
    """Call ``on_ready_grads`` before every inner optimizer step. Any rank; idempotent per hook."""
    check_drift()
    for index, inner in enumerate(inner_optimizers(optimizer)):
        if hasattr(inner, _ORIGINAL):
            raise RuntimeError("a differential-checkpoint hook is already attached")
        original = inner.step_with_ready_grads

        def step_with_ready_grads(_original=original, _index=index, _inner=inner) -> bool:
            if not getattr(_inner, "is_stub_optimizer", False):
                on_ready_grads(_index, _inner.optimizer)
            return _original()

        setattr(inner, _ORIGINAL, original)
        inner.step_with_ready_grads = step_with_ready_grads


def detach(optimizer: Any) -> None:
    """Remove the hook. Any rank; idempotent."""
    for inner in inner_optimizers(optimizer):
        if hasattr(inner, _ORIGINAL):
            del inner.step_with_ready_grads  # the instance attribute; the class method remains
            delattr(inner, _ORIGINAL)


def replay_targets(optimizer: Any) -> list[tuple[int, Any, Callable[[], bool]]]:
    """``(index, torch optimizer, step)`` of every inner optimizer that owns state, where
    ``step`` runs its ``step_with_ready_grads`` without capturing it: what replay feeds
    (:func:`megatron_diffckpt.capture.replay_record`). Any rank."""
    return [
        (index, inner.optimizer, lambda inner=inner: step_without_hook(inner))
        for index, inner in enumerate(inner_optimizers(optimizer))
        if not getattr(inner, "is_stub_optimizer", False)
    ]


def step_without_hook(inner: Any) -> bool:
    """Run one inner optimizer's ``step_with_ready_grads`` without capturing it (replay).

    With the distributed optimizer this all-gathers parameters: all data-parallel ranks call it
    together.
    """
    return getattr(inner, _ORIGINAL, inner.step_with_ready_grads)()


def publish_main_params(optimizer: Any) -> None:
    """Make the model's parameters follow the main parameters, as after a step, without
    stepping: each inner optimizer's ``step_with_ready_grads`` with its torch optimizer's
    ``step`` a no-op (megatron copies main to model parameters and, with the distributed
    optimizer, all-gathers them). All data-parallel ranks together."""
    for _, torch_optimizer, step in replay_targets(optimizer):
        before = torch_optimizer.__dict__.get("step")
        torch_optimizer.step = lambda *args, **kwargs: None
        try:
            step()
        finally:
            if before is None:
                del torch_optimizer.step
            else:
                torch_optimizer.step = before
