"""Stock megatron ``dist_checkpointing`` (torch_dist) save and load for the GPT example.

The directory layout is Megatron-LM's (:mod:`megatron_diffckpt.checkpoint_layout`).
A checkpoint holds the model, the optimizer (``dp_reshardable`` for the distributed optimizer),
the LR scheduler, the iteration, the consumed samples, and the RNG states (Python, NumPy, torch
CPU, the device generator and megatron's tensor-parallel tracker), per (PP, TP) rank. The data
parallel ranks hold identical RNG states (their seeds do not depend on the DP rank), so DP rank 0
saves them for all: that keeps the checkpoint loadable under another DP size.

Collective rule: every method of :class:`Checkpointer` is called by all ranks together.
"""

from __future__ import annotations

import inspect
import logging
import os
import random
import time
from collections import deque

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

from megatron_diffckpt.checkpoint_layout import (
    checkpoint_dir,
    find_latest_iteration,
    publish_iteration,
)
from megatron_diffckpt.patches.base_checkpoint import (
    check_base_layout,
    check_base_shapes,
    finalize_async_bases,
    load_residuals,
    residuals_state,
)
from megatron_diffckpt.patches.optimizer_step import inner_optimizers
from megatron_diffckpt.reshardable import fit_loaded_optimizer_state
from megatron_diffckpt.strategies.base import BaseSource, SaveBase

logger = logging.getLogger("pretrain_gpt")

# The distributed optimizer's format: fully parallel save and load, reshardable along DP.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
# From megatron-core 0.19 on, an asynchronous save goes through NVIDIA's resiliency extension
# unless megatron-core's own strategy is named: the queue and finalize steps here are its own.
MCORE_ASYNC = (
    {"async_strategy": "mcore"}
    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters
    else {}
)


def _rng_state() -> dict:
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if state["cuda_rng_state"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _sharded_rng_state() -> ShardedObject:
    pp = parallel_state.get_pipeline_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_rank()
    return ShardedObject(
        "rng_state",
        _rng_state(),
        (
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
        ),
        (pp, tp),
        replica_id=parallel_state.get_data_parallel_rank(),
    )


def base_layout(
    model, optimizer, is_loading: bool = False, model_params=None, metadata=OPTIMIZER_METADATA
) -> dict:
    """The model and optimizer part of a checkpoint: ``{"model": ..., "optimizer": ...}``.

    Also what the diff log's shard map is built from (``megatron-diffckpt merge``). ``metadata``
    names the optimizer's format (a load follows the checkpoint's).
    """
    # DDP.sharded_state_dict() prefixes keys with "module." while DDP.load_state_dict() expects
    # them without: save and load through the wrapped module.
    model_sd = model.module.sharded_state_dict()
    if model_params is not None:  # LowDiff+: the replica's host parameters, not the model's
        model_sd = model_params.substitute(model_sd)
    return {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=metadata
        ),
    }


def _sharded_state_dict(
    model,
    optimizer,
    scheduler,
    iteration: int,
    consumed: int,
    is_loading: bool,
    residuals=None,
    model_params=None,
    metadata=OPTIMIZER_METADATA,
    rng: bool = True,
) -> dict:
    extra = {} if residuals is None else residuals_state(residuals)
    return {
        **extra,
        **base_layout(model, optimizer, is_loading, model_params, metadata),
        "opt_param_scheduler": scheduler.state_dict(),
        **({"rng_state": _sharded_rng_state()} if rng else {}),
        "iteration": iteration,
        "consumed_train_samples": consumed,
        "checkpoint_version": 3.0,
    }


class Checkpointer:
    """Saves and loads the example's state; owns the async-save queue."""

    def __init__(
        self,
        save_dir: str | None,
        async_save: bool,
        on_published=None,
        residuals=None,
        on_failed=None,
    ):
        """``on_published(iteration)`` runs on all ranks once a save is published; ``residuals``
        (:class:`~megatron_diffckpt.exchange.ErrorFeedbackResiduals`) are saved with every
        checkpoint when given; ``on_failed(iteration, exc)`` runs on all ranks when an
        asynchronous save's finalize step raised (megatron raises a failed write on every rank;
        it re-raises what it does not handle), else the error propagates."""
        self.save_dir = save_dir
        self.async_save = async_save
        self.on_published = on_published
        self.on_failed = on_failed
        self.residuals = residuals
        self._queue = AsyncCallsQueue() if async_save else None
        self._scheduled: deque[int] = deque()  # iterations of the async saves in flight, in order

    def save(self, model, optimizer, scheduler, iteration: int, consumed: int) -> float:
        """Save a checkpoint of ``iteration``. All ranks, collectively.

        Returns the seconds training was blocked. Synchronous: the checkpoint is complete and the
        tracker points at it on return. Asynchronous: the tensors are staged on return; the
        tracker moves forward in :meth:`finalize` once every rank has written its part.
        """
        start = time.perf_counter()
        request = self._save(
            BaseSource(optimizer), model, scheduler, iteration, consumed, self.async_save
        )
        if request is not None:
            self._queue.schedule_async_request(request)
            self._scheduled.append(iteration)
        blocked = time.perf_counter() - start
        logger.info(
            "%s checkpoint of iteration %d: training blocked %.1f ms",
            "async" if request is not None else "sync",
            iteration,
            blocked * 1000.0,
        )
        return blocked

    def base_saver(self, model, scheduler, iteration: int, consumed: int) -> SaveBase:
        """The ``save`` function :meth:`DiffCheckpointManager.save_base` calls (its protocol:
        :mod:`megatron_diffckpt.strategies.base`): a checkpoint of ``iteration`` with the same keys
        and layout as :meth:`save`, from the source the strategy gives (the training optimizer, or
        the LowDiff+ replica's view and host model parameters); scheduler, RNG states and
        counters are the training loop's, now."""

        def save(source: BaseSource):
            if not source.background:
                self.save(model, source.optimizer, scheduler, iteration, consumed)
                return None
            return self._save(source, model, scheduler, iteration, consumed, True)

        return save

    def _save(self, source: BaseSource, model, scheduler, iteration, consumed, in_background):
        """Plan (and, synchronously, write and publish) a checkpoint; returns the unscheduled
        request of an asynchronous one, whose finalize step publishes it."""
        state = _sharded_state_dict(
            model,
            source.optimizer,
            scheduler,
            iteration,
            consumed,
            False,
            self.residuals,
            source.model_params,
        )
        request = dist_checkpointing.save(
            state,
            self._make_dir(iteration),
            async_sharded_save=in_background,
            content_metadata=OPTIMIZER_METADATA,
            **MCORE_ASYNC,
        )

        def publish():
            self._publish(iteration)

        if request is None:
            torch.distributed.barrier()
            publish()
        else:
            request.add_finalize_fn(publish)
        return request

    def _make_dir(self, iteration: int) -> str:
        ckpt = checkpoint_dir(self.save_dir, iteration)
        if torch.distributed.get_rank() == 0:
            os.makedirs(ckpt, exist_ok=True)
        torch.distributed.barrier()
        return ckpt

    def _publish(self, iteration: int) -> None:
        """Move the tracker to ``iteration`` (complete on every rank). All ranks."""
        if torch.distributed.get_rank() == 0:
            publish_iteration(self.save_dir, iteration)
        logger.info("saved checkpoint from iteration %d to %s", iteration, self.save_dir)
        if self.on_published is not None:
            torch.distributed.barrier()  # every rank sees the new tracker
            self.on_published(iteration)

    def finalize(self, blocking: bool = False) -> None:
        """Publish finished async saves. All ranks, collectively (each call is a collective)."""
        if self._queue is not None:
            finalize_async_bases(
                lambda: self._queue.maybe_finalize_async_calls(blocking=blocking),
                self._queue.get_num_unfinalized_calls,
                self._scheduled,
                self.on_failed,
            )

    def close(self) -> None:
        """Wait for every pending save and publish it. All ranks, collectively."""
        if self._queue is not None:
            self.finalize(blocking=True)
            self._queue.close()
            self._queue = None

    @staticmethod
    def load(load_dir: str, model, optimizer, scheduler, residuals=None) -> tuple[int, int]:
        """Load the newest complete checkpoint of ``load_dir``. All ranks, collectively.

        Returns ``(iteration, consumed_train_samples)``. ``residuals`` are loaded when the
        checkpoint holds this rank's (same layout, saved with the compressed exchange); otherwise
        they start from zero, with a warning: training goes on, but the gradient mass they held
        is lost.
        """
        iteration = find_latest_iteration(load_dir)
        ckpt = checkpoint_dir(load_dir, iteration)
        start = time.perf_counter()
        layout = check_base_layout(
            ckpt,
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
        template = _sharded_state_dict(
            model, optimizer, scheduler, 0, 0, True, metadata=layout.load_metadata,
            rng=layout.same_model_parallel,
        )  # fmt: skip
        check_base_shapes(template, ckpt)
        state = dist_checkpointing.load(template, ckpt)
        if residuals is not None:
            load_residuals(ckpt, residuals)
        model.module.load_state_dict(state["model"])
        with torch.no_grad():  # the fp32 dp_reshardable optimizer state is copied in place
            optimizer.load_state_dict(
                fit_loaded_optimizer_state(state["optimizer"], len(inner_optimizers(optimizer)))
            )
        scheduler.load_state_dict(state["opt_param_scheduler"])
        if layout.same_model_parallel:
            _set_rng_state(state["rng_state"])
        else:  # as Megatron-LM: RNG states of another TP/PP layout mean nothing here
            logger.warning(
                "%s was saved under another tensor or pipeline-parallel size: its RNG states are "
                "not loaded (they start from --seed)",
                ckpt,
            )
        if state["iteration"] != iteration:
            raise RuntimeError(f"{ckpt} holds iteration {state['iteration']}, not {iteration}")
        logger.info(
            "loaded checkpoint from %s at iteration %d in %.3f s",
            load_dir,
            iteration,
            time.perf_counter() - start,
        )
        return iteration, int(state["consumed_train_samples"])
