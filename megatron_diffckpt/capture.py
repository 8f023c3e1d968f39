"""Capture and replay of the exact input of each optimizer step on one rank (invariant 1).

A differential is what this rank's torch optimizer consumed at one iteration: the gradient of
every main parameter of its shard (after reduction, unscaling and clipping) and the learning rate
and weight decay of every param group, plus what the next iteration needs to continue exactly:
the RNG states and the LR scheduler's step count. Replaying a chain of differentials onto the base
they follow, through the same optimizer code, reproduces parameters and optimizer state (Adam
moments, step) bit for bit on the same kind of device.

Gradients are stored sparse (``int32`` indices of the entries whose bits are not all zero, and
their values) when that is smaller, dense otherwise. Both are exact; with a compressed gradient
exchange the optimizer input is sparse and so is the differential.

Nothing here imports megatron or the patches: capture gets torch optimizers from the hook
(:mod:`megatron_diffckpt.patches.optimizer_step`), and replay gets :data:`ReplayTarget` s from it
(each inner optimizer's torch optimizer and the step that runs it without capturing).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from megatron_diffckpt.storage.format import DiffRecord

# (inner optimizer index, its torch optimizer, a call that runs its step without capturing it)
ReplayTarget = tuple[int, Any, Callable[[], Any]]

_INT_VIEW = {4: torch.int32, 2: torch.int16, 8: torch.int64}


def _name(inner: int, group: int, index: int) -> str:
    return f"o{inner}.g{group}.p{index}"


def step_hyperparameters(inner_index: int, torch_optimizer: Any) -> dict[str, list[float]]:
    """``"o<inner>.g<group>"`` -> ``[lr, weight_decay]`` of every param group, as the step uses
    them (what replay and the LowDiff+ merger set back)."""
    return {
        f"o{inner_index}.g{g}": [float(group["lr"]), float(group.get("weight_decay", 0.0))]
        for g, group in enumerate(torch_optimizer.param_groups)
    }


def encode_grad(grad: torch.Tensor, copy: bool = True) -> dict[str, torch.Tensor]:
    """``{"dense": flat}`` or ``{"values", "indices"}``, whichever is smaller; exact either way.

    Non-zero means "some bit set", so ``-0.0`` survives the round trip. ``copy=False``: the
    dense form is a view of ``grad`` (the sparse one is new tensors either way).
    """
    flat = grad.detach().reshape(-1)
    bits = flat.view(_INT_VIEW[flat.element_size()])
    nnz = int(torch.count_nonzero(bits))  # one pass, no mask: the dense case is the usual one
    if nnz * (flat.element_size() + 4) < flat.numel() * flat.element_size():
        idx = (bits != 0).nonzero().reshape(-1)
        return {"values": flat[idx], "indices": idx.to(torch.int32)}  # a gather: a copy
    return {"dense": flat.clone() if copy else flat}


def decode_grad(parts: dict[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The gradient :func:`encode_grad` stored, shaped and typed like ``like``."""
    if "dense" in parts:
        return parts["dense"].to(like.dtype).reshape(like.shape)
    out = torch.zeros(like.numel(), dtype=like.dtype, device=like.device)
    out[parts["indices"].long()] = parts["values"].to(like.dtype)
    return out.reshape(like.shape)


class GradShardCapture:
    """Collects one iteration's optimizer inputs on this rank and turns them into a record.

    The training loop's order of calls, on every rank::

        patches.optimizer_step.attach(optimizer, capture.on_ready_grads)
        ... optimizer.step() ...            # on_ready_grads runs inside, per inner optimizer
        scheduler.step(...)
        record = capture.take_record(iteration, scheduler_steps, consumed_samples, tracker)

    ``copy=False``: a record's dense gradients are views of the ones the optimizer stepped
    with, for a caller that serialises the record before those change (LowDiff+'s merger,
    whose diff log writer serialises at append, before the snapshot slot is given back).
    """

    def __init__(self, copy: bool = True) -> None:
        self.copy = copy
        self._pending: dict[str, torch.Tensor] = {}
        self._groups: dict[str, list[float]] = {}
        self._last_rng: dict[str, torch.Tensor] = {}

    def on_ready_grads(self, inner_index: int, torch_optimizer: torch.optim.Optimizer) -> None:
        """Take the gradients (copies, unless ``copy=False``) and hyper-parameters the torch
        optimizer is about to use."""
        grads = {
            (g, i): p.grad
            for g, group in enumerate(torch_optimizer.param_groups)
            for i, p in enumerate(group["params"])
            if p.grad is not None
        }
        self.on_grads(inner_index, step_hyperparameters(inner_index, torch_optimizer), grads)

    def on_grads(
        self,
        inner_index: int,
        hyperparameters: dict[str, list[float]],
        grads: dict[tuple[int, int], torch.Tensor],
    ) -> None:
        """As :meth:`on_ready_grads`, from the step's input without an optimizer holding it:
        the hyper-parameters (:func:`step_hyperparameters`; keys of other inner optimizers are
        left out) and ``(group, index) -> gradient``, in the optimizer's order."""
        mine = f"o{inner_index}.g"
        self._groups.update({k: v for k, v in hyperparameters.items() if k.startswith(mine)})
        for (g, i), grad in grads.items():
            grad = grad if grad.device.type == "cpu" else grad.to("cpu")
            for part, t in encode_grad(grad, self.copy).items():
                self._pending[f"{_name(inner_index, g, i)}:{part}"] = t

    def take_record(
        self, iteration: int, scheduler_steps: int, consumed_samples: int, rng_tracker: Any
    ) -> DiffRecord:
        """The record of ``iteration``, after its optimizer and scheduler steps.

        An iteration whose step was skipped (inf/nan gradients) yields a record with no tensors.
        """
        return self.build_record(
            iteration, scheduler_steps, consumed_samples, capture_rng(rng_tracker)
        )

    def build_record(
        self,
        iteration: int,
        scheduler_steps: int,
        consumed_samples: int,
        rng: tuple[dict[str, Any], dict[str, torch.Tensor]],
    ) -> DiffRecord:
        """As :meth:`take_record`, with the RNG states ``rng`` (:func:`capture_rng`) captured
        earlier, at the end of the iteration, by the training thread."""
        tensors, self._pending = self._pending, {}
        groups, self._groups = self._groups, {}
        scalars: dict[str, Any] = {
            "skipped": not tensors and not groups,
            "groups": groups,
            "scheduler_steps": int(scheduler_steps),
            "consumed_samples": int(consumed_samples),
        }
        rng_scalars, rng_tensors = rng
        scalars.update(rng_scalars)
        # A generator whose state did not change since the previous record is left out (on CPU
        # each state is ~5 KB; most do not move every iteration). The first record this capture
        # takes holds them all.
        for name, state in rng_tensors.items():
            last = self._last_rng.get(name)
            if last is None or not torch.equal(last, state):
                tensors[name] = state
                self._last_rng[name] = state
        return DiffRecord(iteration, scalars, tensors)


def capture_rng(rng_tracker: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Every RNG the next iteration may draw from, as plain data and uint8/int64 tensors."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    scalars = {
        "rng.python": [py_version, py_gauss],
        "rng.numpy": [np_name, int(np_pos), int(np_has_gauss), float(np_gauss)],
        "rng.tracker": sorted(rng_tracker.get_states()),
    }
    tensors = {
        "rng.python": torch.tensor(py_state, dtype=torch.int64),
        "rng.numpy": torch.from_numpy(np_keys.view(np.int32).copy()),  # uint32 bits
        "rng.torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    for name, state in rng_tracker.get_states().items():
        tensors[f"rng.tracker.{name}"] = state.cpu()
    return scalars, tensors


def rng_states_at(records: list[DiffRecord]) -> dict[str, Any]:
    """Every RNG state at the end of the last of ``records`` (a chain after a base), as the
    objects the generators take: ``python`` (``random.setstate``), ``numpy``, ``torch``, ``cuda``
    (each absent when the chain never recorded it: it has not moved since the base) and
    ``tracker`` (name -> state, the recorded ones only). Pure; any process."""
    s = records[-1].scalars
    t: dict[str, torch.Tensor] = {}
    for record in records:
        t.update({k: v for k, v in record.tensors.items() if k.startswith("rng.")})
    out: dict[str, Any] = {}
    if "rng.python" in t:
        py_version, py_gauss = s["rng.python"]
        out["python"] = (py_version, tuple(t["rng.python"].tolist()), py_gauss)
    if "rng.numpy" in t:
        np_name, np_pos, np_has_gauss, np_gauss = s["rng.numpy"]
        keys = t["rng.numpy"].numpy().astype(np.uint32)  # int32 bits (or int64) to uint32
        out["numpy"] = (np_name, keys, np_pos, np_has_gauss, np_gauss)
    for name in ("torch", "cuda"):
        if f"rng.{name}" in t:
            out[name] = t[f"rng.{name}"].clone()
    out["tracker"] = {
        n: t[f"rng.tracker.{n}"].clone() for n in s["rng.tracker"] if f"rng.tracker.{n}" in t
    }
    return out


def restore_rng(records: list[DiffRecord], rng_tracker: Any) -> None:
    """Set every RNG to its state at the end of the last of ``records`` (a replayed chain).

    A generator's state is the newest one the chain holds; one the chain never recorded has not
    moved since the base, whose state is already loaded, and is left alone.
    """
    states = rng_states_at(records)
    if "python" in states:
        random.setstate(states["python"])
    if "numpy" in states:
        np.random.set_state(states["numpy"])
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    if states["tracker"]:
        tracker = rng_tracker.get_states()
        tracker.update(states["tracker"])
        rng_tracker.set_states(tracker)


def record_grads(record: DiffRecord) -> dict[str, dict[str, torch.Tensor]]:
    """The encoded gradients of a record, by parameter name (``o<inner>.g<group>.p<index>``)."""
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in record.tensors.items():
        name, sep, part = key.partition(":")
        if sep:
            grads.setdefault(name, {})[part] = t
    return grads


def set_step_inputs(
    inner_index: int,
    torch_optimizer: Any,
    record: DiffRecord,
    grads: dict[str, dict[str, torch.Tensor]],
) -> None:
    """Give one torch optimizer the recorded input of a step: every group's lr and weight decay,
    every parameter's gradient (``None`` where none was recorded). ``optimizer.step()`` follows.
    """
    for g, group in enumerate(torch_optimizer.param_groups):
        lr, wd = record.scalars["groups"][f"o{inner_index}.g{g}"]
        group["lr"], group["weight_decay"] = lr, wd
        for i, p in enumerate(group["params"]):
            parts = grads.get(_name(inner_index, g, i))
            p.grad = decode_grad(parts, p) if parts else None


def replay_record(targets: list[ReplayTarget], record: DiffRecord) -> None:
    """Run one recorded optimizer step. All ranks of the data-parallel group, together.

    Each target's torch optimizer gets the recorded gradients and hyper-parameters, then its
    step runs (with megatron: ``step_with_ready_grads``: torch step, copy to the model,
    parameter all-gather).
    """
    if record.scalars["skipped"]:
        return
    grads = record_grads(record)
    for index, torch_optimizer, step in targets:
        set_step_inputs(index, torch_optimizer, record, grads)
        step()
