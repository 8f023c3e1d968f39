"""The per-iteration strategy: how one rank leaves a recoverable state after every iteration.

Two implementations, one per system of the paper:

- :class:`~megatron_diffckpt.strategies.lowdiff.LowDiffStrategy` (LowDiff): the optimizer step's
  input is captured inside the step and written as this rank's differential; bases are the training
  loop's own stock saves of the training state.
- :class:`~megatron_diffckpt.strategies.lowdiff_plus.LowDiffPlusStrategy` (LowDiff+): reduced
  gradient buckets are snapshotted to host memory during the backward pass and merged into a
  host replica of the optimizer shard; bases are written from the replica in the background.

The :class:`~megatron_diffckpt.manager.DiffCheckpointManager` owns one and does what both share
(recovery, the diff log, bases' bookkeeping, retention, auto-tuning); a training loop talks to
the manager only.

How a base is written is the training loop's business (its save path, its folder layout, its
tracker), what it is written *from* is the strategy's. The loop hands
:meth:`PerIterationStrategy.save_base` a :data:`SaveBase` function; the strategy calls it with a
:class:`BaseSource`. The protocol of that function:

- ``source.optimizer`` is the megatron optimizer whose ``sharded_state_dict`` the base holds (the
  training optimizer, or a read-only view of the LowDiff+ replica), ``source.model_params`` is
  ``None`` (save the model's own tensors) or an object whose ``substitute(model_sharded_sd)``
  swaps the model's tensors for host copies (the replica's);
- ``source.background`` False: save as the loop always does (synchronous, or asynchronous on its
  own queue) and make the save call :meth:`DiffCheckpointManager.on_base_published` once the
  tracker moved; the return value is ignored;
- ``source.background`` True: plan an *asynchronous* ``dist_checkpointing`` save and return its
  ``AsyncRequest`` without scheduling it; its finalize functions must move the tracker and call
  ``on_base_published`` (the strategy runs the write on its own thread and the finalize functions
  on all ranks together, once every rank has written).

Collective rule: every method below is called by all ranks together.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class BaseSource:
    """What a base is saved from; handed to the training loop's :data:`SaveBase` function."""

    optimizer: Any
    """The megatron optimizer whose ``sharded_state_dict`` the base holds."""
    model_params: Any = None
    """``None``, or an object whose ``substitute(model_sharded_state_dict)`` replaces the model's
    tensors by the ones to save."""
    background: bool = False
    """Return the unscheduled ``AsyncRequest`` of an asynchronous save (see the module doc)."""


SaveBase = Callable[[BaseSource], Any]


@dataclass(frozen=True)
class IterationCost:
    """What one iteration's checkpoint work cost the training thread, in seconds."""

    path_s: float
    """All of it: capture or snapshot issue, slot waits, hand-off to the background."""
    inside_step_s: float = 0.0
    """The part spent inside the optimizer step (already counted in the step's time)."""
    since_step_s: float = 0.0
    """From the optimizer step's start to the end of the iteration (LowDiff+: the optimizer
    step itself); the auto-tuner's estimate of one replay."""
    merge_wait_s: float = 0.0
    """The part of ``path_s`` spent waiting for LowDiff+'s merger (a snapshot slot): the host's
    pace, paid with a replica whether differentials are logged or not."""


class PerIterationStrategy(ABC):
    """One rank's way of making every iteration recoverable. Built by the manager."""

    name: ClassVar[str]
    """The ``--diffckpt-mode`` this strategy implements."""

    @abstractmethod
    def start(self, iteration: int) -> None:
        """Hook megatron and begin after ``iteration`` (the state the run starts from)."""

    @abstractmethod
    def end_iteration(self, iteration: int, scheduler_steps: int, consumed: int) -> IterationCost:
        """``iteration`` ended (optimizer and scheduler stepped): hand its differential off."""

    @abstractmethod
    def save_base(self, iteration: int, save: SaveBase) -> float:
        """Write a base of ``iteration`` through ``save``; returns the seconds training waited."""

    def finish_bases(self) -> None:  # noqa: B027 (optional: only background bases need it)
        """Publish the bases this strategy writes in the background (none by default)."""

    def metrics(self) -> dict[str, float]:
        """Strategy-specific values for the manager's metrics (local, any rank)."""
        return {}

    def replica_view(self) -> Any | None:
        """A read-only optimizer view of a host replica, when the strategy keeps one."""
        return None

    def durable_elsewhere(self) -> int | None:
        """The newest iteration a diff log written outside this process made durable (the
        node's keeper's), when the strategy has one written there; else ``None``."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Finish what is in flight (a pending base included) and unhook megatron."""
