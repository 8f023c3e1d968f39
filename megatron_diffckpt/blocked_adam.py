"""torch's own CPU Adam step, run a cache-sized block at a time: the same bits, less memory traffic.

torch's default CPU ``Adam``/``AdamW`` step (its single-tensor kernel: what training on the CPU
runs, and so what a host replica must run to stay bit-identical with training) updates each
parameter with about nine elementwise passes (the weight decay, both moments, the square root,
the division, the update), and every pass streams the whole tensor through memory: a replica's
step moves three to four times the 28 bytes per parameter Adam needs. :func:`step` runs the
same kernel over slices of :data:`BLOCK` elements instead, so that every pass after a slice's
first finds it in cache. Each element goes through the same operations, with the same operands,
in the same order, as in the whole-tensor step, so the result is the same bit for bit
(``tests/test_blocked_adam.py`` asserts ``torch.equal`` against the optimizer's own step);
``benchmarks/host_merge.py`` measures the gain: 1.56-1.59x on one tensor of 25M parameters
here, none where the tensors fit in cache anyway.

How: a *shadow* optimizer of the same class and options holds, for every slice, a view of the
parameter and views of its state (the moments), and a step count of its own (torch steps each
parameter's count in place, so slices cannot share one); its step is the optimizer's
single-tensor kernel over the slices. The shadow is built once per optimizer and rebuilt when the
optimizer's parameters or state tensors change (a replica anchored into new tensors). The
optimizer's own step counts are set from the slices' after every step, so that what it saves
(a base) is what its own step would have left.

Anything the shadow cannot mirror exactly steps with the optimizer's own ``step()``: another
optimizer class, ``foreach``, ``fused``, ``capturable`` or ``differentiable`` set, parameters off
the CPU or not contiguous, complex parameters, gradients of another dtype or layout, a parameter
without state yet (torch creates it in its first step).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

BLOCK = 131072
"""Elements per slice: 512 KiB of fp32, so that a slice's parameter, gradient, both moments and
the step's temporary (2.5 MiB) stay within a server core's L2 and L3 share. Measured here on one
tensor of 25M parameters: 32K-1M elements all beat the whole-tensor step, 128K best on 1 and 2
threads."""

_ADAM = (torch.optim.Adam, torch.optim.AdamW)
_STATE_TENSORS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _state_tensors(state: dict) -> tuple[torch.Tensor, ...]:
    """The per-element state tensors ``state`` holds (the moments; amsgrad's maximum)."""
    return tuple(state[k] for k in _STATE_TENSORS if k in state)


@dataclass
class _Param:
    """One parameter of the optimizer, as the shadow mirrors it."""

    param: torch.Tensor
    state: dict
    tensors: tuple[torch.Tensor, ...]  # the state tensors the views were made of
    slices: list[torch.Tensor]  # the shadow's parameters: views of ``param``
    steps: list[torch.Tensor]  # their step counts


class _Shadow:
    def __init__(self, opt: torch.optim.Optimizer, block: int):
        self.block = block
        self.params: list[_Param] = []
        groups = []
        for group in opt.param_groups:
            slices = []
            for p in group["params"]:
                mirrored = _mirror(p, opt.state[p], block)
                self.params.append(mirrored)
                slices.extend(mirrored.slices)
            groups.append({**_options(group), "params": slices})
        self.optimizer = type(opt)(groups)
        for mirrored in self.params:
            for piece, step in zip(mirrored.slices, mirrored.steps, strict=True):
                self.optimizer.state[piece] = {"step": step, **_views(mirrored, piece)}

    def mirrors(self, opt: torch.optim.Optimizer) -> bool:
        """Whether this shadow still mirrors ``opt``: the same parameters, state dictionaries and
        state tensors (an anchor copying into them in place keeps it; new tensors do not)."""
        params = [p for group in opt.param_groups for p in group["params"]]
        if len(params) != len(self.params):
            return False
        for p, mirrored in zip(params, self.params, strict=True):
            state = opt.state.get(p)
            if p is not mirrored.param or state is not mirrored.state:
                return False
            tensors = _state_tensors(state)
            if len(tensors) != len(mirrored.tensors) or any(
                a is not b for a, b in zip(tensors, mirrored.tensors, strict=True)
            ):
                return False
        return True

    def step(self, opt: torch.optim.Optimizer) -> None:
        for group, shadow_group in zip(opt.param_groups, self.optimizer.param_groups, strict=True):
            shadow_group.update(_options(group))  # the step's learning rate and weight decay
        stepped = []
        for mirrored in self.params:
            grad = mirrored.param.grad
            if grad is None:
                continue
            flat = grad.view(-1)
            start = 0
            for piece, step in zip(mirrored.slices, mirrored.steps, strict=True):
                piece.grad = flat[start : start + piece.numel()]
                start += piece.numel()
                step.copy_(mirrored.state["step"])
            stepped.append(mirrored)
        try:
            self.optimizer.step()
        finally:
            for mirrored in stepped:
                mirrored.state["step"].copy_(mirrored.steps[0])
                for piece in mirrored.slices:
                    piece.grad = None


def _options(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def _mirror(p: torch.Tensor, state: dict, block: int) -> _Param:
    flat = p.view(-1)
    slices = [flat[s : s + block] for s in range(0, flat.numel(), block)]
    steps = [state["step"].clone() for _ in slices]
    return _Param(param=p, state=state, tensors=_state_tensors(state), slices=slices, steps=steps)


def _views(mirrored: _Param, piece: torch.Tensor) -> dict[str, torch.Tensor]:
    """The state of slice ``piece``: views of the parameter's state tensors at its offset."""
    offset = piece.storage_offset() - mirrored.param.storage_offset()
    return {
        k: mirrored.state[k].view(-1)[offset : offset + piece.numel()]
        for k in _STATE_TENSORS
        if k in mirrored.state
    }


def _supported(opt: torch.optim.Optimizer) -> bool:
    """Whether the shadow mirrors ``opt``'s step exactly (see the module's docstring)."""
    if type(opt) not in _ADAM:
        return False
    for group in opt.param_groups:
        if any(group.get(k) for k in ("foreach", "fused", "capturable", "differentiable")):
            return False
        for p in group["params"]:
            state = opt.state.get(p)
            if not state or not torch.is_tensor(state.get("step")):
                return False
            if p.device.type != "cpu" or p.is_complex() or not p.is_contiguous():
                return False
            if any(
                not (t.shape == p.shape and t.dtype == p.dtype and t.is_contiguous())
                for t in _state_tensors(state)
            ):
                return False
            g = p.grad
            if g is not None and not (
                g.shape == p.shape and g.dtype == p.dtype and g.is_contiguous() and not g.is_sparse
            ):
                return False
    return True


_SHADOWS: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Shadow] = weakref.WeakKeyDictionary()
_SHADOWS_LOCK = threading.Lock()  # a keeper steps its ranks' replicas on several threads


@torch.no_grad()
def step(opt: torch.optim.Optimizer, block: int = BLOCK) -> None:
    """``opt.step()`` (its gradients set), computed a block of ``block`` elements at a time
    where the result is the same bit for bit (torch's single-tensor CPU Adam/AdamW), else
    ``opt.step()`` itself. ``opt``'s step hooks do not run in the first case."""
    if not _supported(opt):
        opt.step()
        return
    with _SHADOWS_LOCK:
        shadow = _SHADOWS.get(opt)
    if shadow is None or shadow.block != block or not shadow.mirrors(opt):
        shadow = _Shadow(opt, block)
        with _SHADOWS_LOCK:
            _SHADOWS[opt] = shadow
    shadow.step(opt)
