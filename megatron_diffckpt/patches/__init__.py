"""The patches to Megatron: every place where megatron-diffckpt touches megatron-core's code.

One module per hook point, all with one lifecycle:

- ``PATCHES`` (a :class:`~megatron_diffckpt.patches.base.PatchSet`) names every megatron-core
  function the module wraps or relies on, with the signature it was written for, and
  ``check_drift()`` raises :class:`~megatron_diffckpt.patches.base.MegatronDriftError` naming
  the expected and found signatures and the tested megatron-core versions;
- a hook on a module global or a class (every instance) is installed by ``apply()`` and removed
  by ``revert()``, both idempotent;
- a hook on one training run's objects (a DDP module's bucket groups, an optimizer) is installed
  by ``attach(...)`` and removed by ``detach(...)``; ``attach`` checks drift first and refuses a
  second attach;
- read-only helpers (``replica_view``, ``split_async_request``, ...) check drift before use.

Integrations with whole training loops (Megatron-LM's ``megatron.training``) are not hook points:
they live in :mod:`megatron_diffckpt.integrations`, and use these modules and the manager.
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
    "megatron_diffckpt.patches.base_checkpoint",
    "megatron_diffckpt.patches.bucket_snapshot",
    "megatron_diffckpt.patches.grad_sync",
    "megatron_diffckpt.patches.optimizer_layout",
    "megatron_diffckpt.patches.optimizer_step",
    "megatron_diffckpt.patches.pipeline_bubbles",
    "megatron_diffckpt.patches.replica_state",
    "megatron_diffckpt.patches.torch_adam_state",
)

# Hook points in Megatron-LM's megatron.training (from a Megatron-LM checkout, not a package),
# held by the integration: drift-checked by tests/test_megatron_lm.py.
MEGATRON_LM_PATCHES = ("megatron_diffckpt.integrations.megatron_lm",)
