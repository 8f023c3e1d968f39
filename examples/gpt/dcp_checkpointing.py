"""PyTorch DCP (``torch.distributed.checkpoint``) checkpoints for the GPT example (``--ckpt-format
torch_dcp``): the PyTorch-native baseline that LowDiff and LowDiff+ are measured against.

Same directory layout and tracker as the torch_dist checkpoints; the same content: model
parameters (one entry per (PP, TP) rank and name; the data-parallel replicas are deduplicated by
DCP's planner), this rank's optimizer shard (main parameters, Adam moments and step), and per
rank the scheduler, counters and RNG states. ``--async-save`` uses ``dcp.async_save``: the state is
staged to host memory on the training thread, then planned and written by DCP's background thread
over a gloo process group of its own (so its collectives never interleave with training's). A
checkpoint is complete when every rank's write has finished: rank 0 then writes ``metadata.json``
(the layout's completion marker) and moves the tracker. Not a differential-checkpointing base
(those are torch_dist): the flags refuse the combination.

Collective rule: every method of :class:`DcpCheckpointer` is called by all ranks together.
"""

from __future__ import annotations

import json
import logging
import os
import time

import torch
import torch.distributed.checkpoint as dcp
from checkpointing import _rng_state, _set_rng_state
from megatron.core import parallel_state

from megatron_diffckpt.checkpoint_layout import (
    COMPLETE_MARKER,
    checkpoint_dir,
    find_latest_iteration,
    publish_iteration,
)
from megatron_diffckpt.durable_io import publish_file
from megatron_diffckpt.patches.optimizer_step import inner_optimizers
from megatron_diffckpt.recovery import all_reduce_min

logger = logging.getLogger("pretrain_gpt")

FORMAT = "torch_dcp"


def _coords() -> tuple[str, str]:
    pp = parallel_state.get_pipeline_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_rank()
    dp = parallel_state.get_data_parallel_rank()
    return f"pp{pp}.tp{tp}", f"pp{pp}.tp{tp}.dp{dp}"


def _init_adam_state(torch_opt: torch.optim.Optimizer) -> None:
    """Create the Adam state torch would create at the first step (so that load has targets)."""
    for group in torch_opt.param_groups:
        for p in group["params"]:
            if not torch_opt.state.get(p):
                torch_opt.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }


def _state_dict(model, optimizer, scheduler, iteration: int, consumed: int, loading: bool):
    model_key, rank_key = _coords()
    state = {f"model.{model_key}.{name}": p for name, p in model.module.named_parameters()}
    for i, inner in enumerate(inner_optimizers(optimizer)):
        if getattr(inner, "is_stub_optimizer", False):
            continue
        torch_opt = inner.optimizer
        if loading:
            _init_adam_state(torch_opt)
        for g, group in enumerate(torch_opt.param_groups):
            for k, p in enumerate(group["params"]):
                prefix = f"optimizer.{rank_key}.o{i}.g{g}.p{k}"
                state[f"{prefix}.param"] = p
                for name, value in torch_opt.state.get(p, {}).items():
                    state[f"{prefix}.{name}"] = value
    state[f"extra.{rank_key}"] = {
        "scheduler": scheduler.state_dict(),
        "iteration": iteration,
        "consumed_train_samples": consumed,
        "rng_state": _rng_state(),
    }
    return state


class DcpCheckpointer:
    """Saves and loads the example's state with PyTorch DCP; one async save in flight."""

    def __init__(self, save_dir: str | None, async_save: bool):
        self.save_dir = save_dir
        self.async_save = async_save
        self._group = torch.distributed.new_group(backend="gloo")
        self._pending: tuple[int, object] | None = None  # (iteration, future)

    def save(self, model, optimizer, scheduler, iteration: int, consumed: int) -> float:
        """Save ``iteration``; returns the seconds training was blocked. All ranks."""
        start = time.perf_counter()
        if self._pending is not None:
            self.finalize(blocking=True)  # DCP async_save: one save in flight
        ckpt = checkpoint_dir(self.save_dir, iteration)
        state = _state_dict(model, optimizer, scheduler, iteration, consumed, loading=False)
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=ckpt, process_group=self._group)
            self._pending = (iteration, future)
        else:
            dcp.save(state, checkpoint_id=ckpt, process_group=self._group)
            self._publish(iteration)
        blocked = time.perf_counter() - start
        logger.info(
            "%s DCP checkpoint of iteration %d: training blocked %.1f ms",
            "async" if self.async_save else "sync",
            iteration,
            blocked * 1000.0,
        )
        return blocked

    def _publish(self, iteration: int) -> None:
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            marker = json.dumps({"sharded_backend": FORMAT}).encode()
            path = os.path.join(checkpoint_dir(self.save_dir, iteration), COMPLETE_MARKER)
            publish_file(path, lambda f: f.write(marker))
            publish_iteration(self.save_dir, iteration)
        logger.info("saved checkpoint from iteration %d to %s", iteration, self.save_dir)

    def finalize(self, blocking: bool = False) -> None:
        """Publish the async save once every rank's write has finished. All ranks."""
        if self._pending is None:
            return
        iteration, future = self._pending
        if blocking:
            future.result()
        if not all_reduce_min([int(future.done())])[0]:
            return
        future.result()  # raises the writer's error
        self._pending = None
        self._publish(iteration)

    def close(self) -> None:
        self.finalize(blocking=True)

    @staticmethod
    def load(load_dir: str, model, optimizer, scheduler) -> tuple[int, int]:
        """Load the newest complete DCP checkpoint of ``load_dir`` (same layout). All ranks."""
        iteration = find_latest_iteration(load_dir)
        ckpt = checkpoint_dir(load_dir, iteration)
        with open(os.path.join(ckpt, COMPLETE_MARKER)) as f:
            backend = json.load(f).get("sharded_backend")
        if backend != FORMAT:
            raise RuntimeError(f"{ckpt} is a {backend} checkpoint; load it with --ckpt-format")
        start = time.perf_counter()
        state = _state_dict(model, optimizer, scheduler, 0, 0, loading=True)
        with torch.no_grad():
            dcp.load(state, checkpoint_id=ckpt)
        _, rank_key = _coords()
        extra = state[f"extra.{rank_key}"]
        scheduler.load_state_dict(extra["scheduler"])
        _set_rng_state(extra["rng_state"])
        logger.info(
            "loaded DCP checkpoint from %s at iteration %d in %.3f s",
            load_dir,
            iteration,
            time.perf_counter() - start,
        )
        return int(extra["iteration"]), int(extra["consumed_train_samples"])
