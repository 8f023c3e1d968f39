"""One Megatron-LM run with differential checkpointing (:class:`MegatronLMRun`): what the hooks of
:mod:`~megatron_diffckpt.integrations.megatron_lm` call at each point of ``pretrain()`` (after
the model and optimizer are set up, after each training step, at each save, at the end), and
what it holds between them: the manager, the compressed exchange, the recovered RNG states.
"""

from __future__ import annotations

import inspect
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from megatron_diffckpt.capture import capture_rng, restore_rng
from megatron_diffckpt.checkpoint_layout import (
    checkpoint_dir,
    has_tracker,
)
from megatron_diffckpt.config import DiffCkptConfig
from megatron_diffckpt.errors import DiffCkptUsageError
from megatron_diffckpt.patches import base_checkpoint, grad_sync
from megatron_diffckpt.storage.format import DiffRecord
from megatron_diffckpt.strategies.base import BaseSource

logger = logging.getLogger(__name__)


class MegatronLMIntegrationError(DiffCkptUsageError):
    """A Megatron-LM run asks for something the integration does not support (says what to do)."""


class ReplicaModule:
    """A model chunk whose ``sharded_state_dict`` holds the LowDiff+ replica's host parameters
    (``model_params.substitute``); everything else is the chunk's own. Read only: what
    Megatron-LM's save path builds a base from."""

    def __init__(self, module: Any, model_params: Any):
        self._module = module
        self._model_params = model_params

    def sharded_state_dict(self, *args: Any, **kwargs: Any) -> dict:
        return self._model_params.substitute(self._module.sharded_state_dict(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class MegatronLMRun:
    """The one training run of this process: what the hooks share."""

    def __init__(self) -> None:
        self.config: DiffCkptConfig | None = None
        self.manager: Any = None
        self.exchange: Any = None  # the compressed exchange (--diffckpt-compressor topk)
        self.model: list[Any] = []
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.saving: int | None = None  # the iteration of the base being saved
        self.scheduled: deque[int] = deque()  # bases in Megatron-LM's async queue, in order
        self.capture_request = False  # LowDiff+: hand the AsyncRequest back, do not queue it
        self.captured: Any = None
        self.recovered_rng: Any = None  # RNG states at the recovered iteration, until step 1
        self.base_loaded: int | None = None  # the iteration of the base --load loaded
        # Megatron-LM 0.19's configuration (pretrain's cfg_container.checkpoint): its end of
        # training reads the save interval there, its loop from the arguments.
        self.checkpoint_config: Any = None

    def set_save_interval(self, interval: int) -> None:
        """Megatron-LM's ``--save-interval`` from now on, wherever its loop reads it."""
        from megatron.training import get_args

        get_args().save_interval = interval
        if self.checkpoint_config is not None:
            self.checkpoint_config.save_interval = interval

    def begin(self, model: list[Any], optimizer: Any, scheduler: Any, setup_s: float) -> None:
        """After setup_model_and_optimizer: exchange, manager, recovery, start. All ranks."""
        from megatron.core import parallel_state as mpu
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        from megatron.training import get_args
        from megatron.training.training import num_floating_point_operations

        from megatron_diffckpt.manager import DiffCheckpointManager

        args = get_args()
        self.config = DiffCkptConfig.from_args(args)
        try:
            self.config.check_launch(args)
        except DiffCkptUsageError as exc:
            raise MegatronLMIntegrationError(str(exc)) from None
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.exchange = grad_sync.attach_compressor(
            model, self.config.compressor, self.config.topk_ratio
        )
        # Megatron-LM loaded the base its tracker names (iteration 0 included: a job's start).
        loaded = (
            args.load is not None
            and has_tracker(args.load)
            and not getattr(args, "finetune", False)
            and getattr(args, "ckpt_step", None) is None
        )
        if self.exchange is not None and loaded:
            base_checkpoint.load_residuals(
                checkpoint_dir(args.load, args.iteration), self.exchange.residuals
            )
        if not self.config.enabled:
            return
        coords = (
            mpu.get_tensor_model_parallel_rank(),
            mpu.get_pipeline_model_parallel_rank(),
            mpu.get_data_parallel_rank(),
        )
        self.manager = DiffCheckpointManager(
            self.config,
            args.save,
            optimizer,
            get_cuda_rng_tracker(),
            coords,
            model,
            self.exchange.residuals if self.exchange is not None else None,
        )
        if loaded:
            base = self.base_loaded = args.iteration
            # With the node keepers: LowDiff+'s replicas, or LowDiff's newest base when it is
            # newer than the one Megatron-LM loaded, replace its state; else the differentials
            # are replayed onto it.
            got = self.manager.recover(base, base_load_s=setup_s)
            iteration, steps, consumed = got.iteration, got.scheduler_steps, got.consumed_samples
            if steps is not None:
                scheduler.num_steps = steps
                scheduler.step(increment=0)  # the learning rate the next iteration uses
                args.consumed_train_samples = consumed
                args.num_floating_point_operations_so_far += (
                    iteration - base
                ) * num_floating_point_operations(args, args.global_batch_size)
                args.iteration = iteration
                # pretrain() builds the data iterators next, and a DataLoader iterator draws its
                # seed from torch's generator: the RNG states go back at the first train_step.
                self.recovered_rng = DiffRecord(iteration, *capture_rng(get_cuda_rng_tracker()))
            logger.info("recovered to iteration %d (base %d)", iteration, base)
        if self.config.full_interval:  # Megatron-LM saves at multiples of --save-interval
            self.set_save_interval(self.config.full_interval)
        self.manager.start(args.iteration, args.save_interval or 0)
        if loaded and args.ckpt_format == "torch_dist":  # the loaded optimizer state: the map now
            self._record_shard_map(args.iteration)

    def restore_recovered_rng(self, keep: bool = False) -> None:
        """Set the RNG states of the recovered iteration: at the first ``train_step`` (then they
        are done with), and at a save before it (``keep``: the data iterators built after it
        draw from torch's generator again)."""
        if self.recovered_rng is not None:
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            restore_rng([self.recovered_rng], get_cuda_rng_tracker())
            if not keep:
                self.recovered_rng = None

    def base_now(self) -> int | None:
        """The iteration training starts from, when a base is due there before the first
        iteration: a job from scratch (its starting point, so that every iteration is
        recoverable from the first on), or a recovered iteration where Megatron-LM's loop would
        have saved a base (a multiple of ``--save-interval``) and the crash kept it from being
        published (Megatron-LM saves at the end of training only off those multiples, so a job
        recovered onto its last iteration would end without its final base)."""
        from megatron.training import get_args

        iteration = get_args().iteration
        if self.manager is None or iteration == self.base_loaded:
            return None
        return iteration if self.manager.base_due(iteration) else None

    def after_step(self, train_s: float) -> None:
        """After each train_step: the iteration's differential, the shard map. All ranks."""
        from megatron.core import parallel_state as mpu
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.training import get_args, get_timers

        args = get_args()
        iteration = args.curr_iteration + 1
        batch = mpu.get_data_parallel_world_size() * args.micro_batch_size * get_num_microbatches()
        timers = get_timers()
        timers("diffckpt-diff", log_level=0).start()
        self.manager.end_iteration(
            iteration, self.scheduler.num_steps, args.consumed_train_samples + batch, train_s
        )
        timers("diffckpt-diff").stop()
        if args.log_interval and iteration % args.log_interval == 0:
            self._log(iteration, args.log_interval)
        self._record_shard_map(iteration)
        if self.config.auto_tune:
            self.set_save_interval(self.manager.full_interval)

    def _record_shard_map(self, iteration: int) -> None:
        """The rank's shard map (``megatron-diffckpt merge``), once the optimizer has state:
        after a load, or after the first step. All ranks."""
        from megatron.core import parallel_state as mpu
        from megatron.core.utils import unwrap_model
        from megatron.training import get_args
        from megatron.training.checkpointing import (
            _build_sharded_state_dict_metadata,
            generate_state_dict,
        )

        args = get_args()

        def sharded_state_dict() -> dict:  # as save_checkpoint builds it
            meta = _build_sharded_state_dict_metadata(args)
            return generate_state_dict(
                args,
                unwrap_model(self.model),
                self.optimizer,
                self.scheduler,
                None,
                iteration,
                optim_sd_kwargs={"metadata": meta},
                model_sd_kwargs={"metadata": meta},
            )

        parallel = (
            mpu.get_tensor_model_parallel_world_size(),
            mpu.get_pipeline_model_parallel_world_size(),
            mpu.get_data_parallel_world_size(),
        )
        self.manager.record_shard_map(sharded_state_dict, parallel)

    def _log(self, iteration: int, interval: int) -> None:
        """Megatron-LM's timer line for ``diffckpt-diff`` (min/max across ranks), the manager's
        metrics on the last rank's log, and as ``diffckpt/*`` scalars to Megatron-LM's
        TensorBoard writer when it has one. All ranks, collectively (the timers gather)."""
        from megatron.training import get_tensorboard_writer, get_timers

        from megatron_diffckpt.manager import format_metrics

        get_timers().log(["diffckpt-diff"], normalizer=interval)
        metrics = self.manager.metrics(iteration)
        if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
            logger.info("diffckpt at iteration %d |%s", iteration, format_metrics(metrics))
        writer = get_tensorboard_writer()
        if writer is not None:
            for key, value in metrics.items():
                writer.add_scalar(f"diffckpt/{key}", value, iteration)

    def save_base(self, original: Callable, bound: inspect.BoundArguments) -> None:
        """A base of Megatron-LM's ``save_checkpoint(**bound)`` through the manager. All ranks."""
        from megatron.training import get_args

        from megatron_diffckpt.manager import DiffCheckpointManager

        args = get_args()
        iteration = int(bound.arguments["iteration"])
        manager: DiffCheckpointManager = self.manager

        def save(source: BaseSource) -> Any:
            if not source.background:
                original(*bound.args, **bound.kwargs)
                if not args.async_save:  # rank 0 moved the tracker before the save's barrier
                    manager.on_base_published(iteration)
                return None
            from megatron.core.utils import unwrap_model

            replica = bound.arguments.copy()
            replica["optimizer"] = source.optimizer
            replica["model"] = [
                ReplicaModule(m, source.model_params)
                for m in unwrap_model(bound.arguments["model"])
            ]
            async_save, args.async_save = args.async_save, True
            self.capture_request, self.captured = True, None
            try:
                original(**replica)
            finally:
                args.async_save = async_save
                self.capture_request = False
            request, self.captured = self.captured, None
            return request

        self.restore_recovered_rng(keep=True)  # Megatron-LM's save reads the RNG states
        self.saving = iteration
        try:
            manager.save_base(iteration, save)
        finally:
            self.saving = None

    def close(self) -> None:
        """Publish bases in flight, write what is pending and stop. All ranks, after pretrain()
        returned."""
        if self.manager is not None:
            self.manager.close()
            self.manager = None
        if self.exchange is not None:
            grad_sync.detach(self.model)
            self.exchange = None
