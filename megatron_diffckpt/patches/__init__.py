"""The patches to Megatron: every place where megatron-diffckpt touches megatron-core's code.

One module per hook point. Each exposes ``apply()`` (idempotent), ``revert()`` and
``check_drift()``; the last compares the hooked function with the signature the patch was written
for and raises :class:`~megatron_diffckpt.patches.base.MegatronDriftError` naming the expected and
found signatures and the megatron-core versions the patch was tested with.
"""

from megatron_diffckpt.patches.base import (
    TESTED_MEGATRON_CORE_VERSIONS,
    MegatronDriftError,
    MethodPatch,
)

__all__ = [
    "TESTED_MEGATRON_CORE_VERSIONS",
    "MegatronDriftError",
    "MethodPatch",
    "ALL_PATCHES",
    "MEGATRON_LM_PATCHES",
]

# Module names of every patch, for the drift test and for tools that list them.
ALL_PATCHES = (
    "megatron_diffckpt.patches.bucket_snapshot",
    "megatron_diffckpt.patches.grad_sync",
    "megatron_diffckpt.patches.optimizer_layout",
    "megatron_diffckpt.patches.optimizer_step",
    "megatron_diffckpt.patches.pipeline_bubbles",
    "megatron_diffckpt.patches.replica_state",
    "megatron_diffckpt.patches.torch_adam_state",
)

# Hook points in Megatron-LM's megatron.training (from a Megatron-LM checkout, not a package):
# drift-checked by tests/test_megatron_lm.py, which skips without a checkout.
MEGATRON_LM_PATCHES = ("megatron_diffckpt.patches.megatron_training",)
