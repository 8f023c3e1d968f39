"""Hook point: the DistributedOptimizer's state (de)serialisation with ``torch.optim.AdamW``.

Without transformer-engine or apex (CPU machines, or GPU machines without them), megatron's
inner optimizer is ``torch.optim.AdamW``, which creates its per-parameter state (``step``,
``exp_avg``, ``exp_avg_sq``) lazily at the first step and keeps ``step`` per parameter. Two places
of megatron-core 0.16's ``DistributedOptimizer`` do not expect that:

- ``state_dict()`` asserts that every parameter holds one common ``step``, so building the
  sharded state dict of a fresh optimizer (to load a checkpoint into it) fails. The wrapper first
  gives every parameter without state exactly the state AdamW's lazy initialisation would create
  (``step = 0``, zero moments), which changes no later update.
- ``_set_main_param_and_optimizer_states()`` copies every per-parameter state key from the loaded
  tensors. ``step`` is restored from the param groups first; the loaded tensors either carry no
  ``step`` (``KeyError``) or, in the ``dp_reshardable`` format, the *template's* unloaded
  ``step`` (a ``LocalNonpersistentObject``), which would silently reset the step count to 0 and
  change every later Adam update. The wrapper makes the already-restored ``step`` its own source.
- ``load_state_dict()`` gives every parameter's state the *same* ``step`` tensor object; AdamW
  increments ``step`` in place once per parameter, so after one step the count is off by the
  number of parameters, and every later bias correction is wrong. The wrapper gives each
  parameter its own copy after loading.
- In fp32 training a main parameter is a view of its model parameter (a leaf that requires
  grad), so the copy into it fails outside ``torch.no_grad()`` (Megatron-LM's
  ``load_checkpoint`` calls it without); the wrapper copies under ``no_grad``, which changes
  nothing where the copy worked.

With TE's or apex's FusedAdam (one ``step`` per param group) the wrappers do nothing.
"""

from __future__ import annotations

import functools

import torch

from megatron_diffckpt.patches.base import MethodPatch, PatchSet

_DISTRIB_OPTIMIZER = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"


def _is_torch_adam(optimizer) -> bool:
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


def init_lazy_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give each parameter without state the state torch Adam's first step would create."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if len(optimizer.state[p]) == 0:
                optimizer.state[p]["step"] = torch.tensor(0.0, dtype=torch.float32)
                optimizer.state[p]["exp_avg"] = torch.zeros_like(
                    p, memory_format=torch.preserve_format
                )
                optimizer.state[p]["exp_avg_sq"] = torch.zeros_like(
                    p, memory_format=torch.preserve_format
                )


def _wrap_state_dict(original):
    @functools.wraps(original)
    def state_dict(self):
        if _is_torch_adam(self.optimizer):
            init_lazy_adam_state(self.optimizer)
        return original(self)

    return state_dict


def _wrap_set_states(original):
    @functools.wraps(original)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if _is_torch_adam(self.optimizer):
            current = self._get_main_param_and_optimizer_states(model_param)
            tensors = {**tensors, "step": current["step"]}
        with torch.no_grad():
            return original(self, model_param, tensors)

    return _set_main_param_and_optimizer_states


def _wrap_load_state_dict(original):
    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        result = original(self, state_dict)
        if _is_torch_adam(self.optimizer):
            for state in self.optimizer.state.values():
                if "step" in state:
                    state["step"] = state["step"].clone()
        return result

    return load_state_dict


PATCHES = PatchSet(
    (
        MethodPatch(
            target=f"{_DISTRIB_OPTIMIZER}.state_dict",
            expected_signature="(self)",
            make_wrapper=_wrap_state_dict,
            purpose="build the state dict of a fresh torch-AdamW distributed optimizer",
        ),
        MethodPatch(
            target=f"{_DISTRIB_OPTIMIZER}._set_main_param_and_optimizer_states",
            expected_signature="(self, model_param, tensors)",
            make_wrapper=_wrap_set_states,
            purpose="load torch AdamW state (per-parameter 'step') into the distributed optimizer",
            requires=(
                (
                    f"{_DISTRIB_OPTIMIZER}._get_main_param_and_optimizer_states",
                    "(self, model_param)",
                ),
            ),
        ),
        MethodPatch(
            target=f"{_DISTRIB_OPTIMIZER}.load_state_dict",
            expected_signature="(self, state_dict)",
            make_wrapper=_wrap_load_state_dict,
            purpose="give each parameter its own torch AdamW 'step' after loading",
        ),
    )
)

apply = PATCHES.apply
revert = PATCHES.revert
check_drift = PATCHES.check_drift
