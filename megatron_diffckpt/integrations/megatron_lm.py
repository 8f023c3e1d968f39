"""Megatron-LM's own training loop (``megatron.training``) with differential checkpointing:
both systems inside Megatron-LM's ``pretrain()``, with nothing changed but the ``--diffckpt-*``
flags.

Megatron-LM is not a package on the registries: it comes from a checkout (written against and
checked with the versions in :data:`TESTED_MEGATRON_LM_VERSIONS`; each release's signatures of
the hooked functions are in :mod:`megatron_lm_releases`). Every hook wraps a module
global that Megatron-LM's code looks up at call time, and calls the original; all of them talk
to the :class:`~megatron_diffckpt.manager.DiffCheckpointManager` through its public interface:

1. ``training.setup_model_and_optimizer``: after the model, the optimizer and the scheduler exist
   and ``--load`` has loaded the newest base: the compressed exchange is attached to Megatron-LM's
   DDP modules (``--diffckpt-compressor topk``; its error-feedback residuals are loaded from the
   base), the manager is created, the differentials every rank holds after the base are replayed
   (the scheduler's step and the consumed samples follow them, so the data iterators, built next,
   resume at the recovered iteration; the RNG states are set again at the first ``train_step``,
   after building the data iterators drew from torch's generator), and capture starts
   (LowDiff: the optimizer-step hook; LowDiff+: bucket snapshots, pipeline bubbles, the replica).
   With ``--diffckpt-option keeper_replica``, the node keepers' LowDiff+ replicas, newer than the
   base, replace the loaded state instead of a replay (Megatron-LM has read the base by then;
   the example's loop asks the keepers first and reads no base).
2. ``training.train_step``: after it, the iteration's differential is handed off (timed by
   Megatron-LM's timers as ``diffckpt-diff``), and once, the rank's shard map is written
   (``megatron-diffckpt merge``). Every ``--log-interval``, the timer (min/max across ranks) and
   the manager's metrics are logged, and written to Megatron-LM's TensorBoard writer when it has
   one. With ``--diffckpt-auto-tune``, ``--save-interval`` follows the tuned F.
3. ``training.save_checkpoint`` (what ``save_checkpoint_and_time`` and ``pretrain`` call): a base
   goes through :meth:`DiffCheckpointManager.save_base`. LowDiff: Megatron-LM's save as the user
   configured it (sync or ``--async-save``). LowDiff+: Megatron-LM's own save path plans an
   asynchronous save of the replica (its optimizer view, and the model wrapped so that its
   sharded state dict holds the replica's host parameters), whose request
   ``checkpointing.schedule_async_save`` hands back instead of queueing; the LowDiff+ persister
   writes it, and Megatron-LM's own finalize functions (metadata, tracker) publish it.
4. ``checkpointing.generate_state_dict``: while a base is saved, the residuals of the compressed
   exchange join Megatron-LM's state dict; when ``--load`` reads a base, a base of another model
   (a tensor's global shape differs) is refused in one line before megatron's load fails.
5. ``checkpointing.schedule_async_save``: an asynchronous base tells the manager when it is
   published (its finalize step, after Megatron-LM's tracker update).
6. ``training.maybe_finalize_async_save``: where Megatron-LM waits for its own saves (blocking,
   at the end of training), bases in flight are published too; an asynchronous base whose write
   failed for want of space goes to the manager's ``--diffckpt-when-full`` rule (skipped with a
   warning, or the job stopped in one line) instead of ending the job in a traceback.
7. ``megatron.core.datasets.utils.compile_helpers``: skipped when the compiled helpers import
   (megatron-core wheels ship them, without the Makefile that Megatron-LM's start-up runs).

Refused, with the flag to change (:meth:`DiffCkptConfig.check_launch`): context or expert
parallelism, ``--iterations-to-skip``, LowDiff+ without the distributed optimizer, with fp16
loss scaling or with ``--dist-ckpt-optim-fully-reshardable``.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from megatron_diffckpt.capture import capture_rng, restore_rng
from megatron_diffckpt.checkpoint_layout import (
    CheckpointNotFoundError,
    checkpoint_dir,
    find_latest_iteration,
    has_tracker,
)
from megatron_diffckpt.config import DiffCkptConfig
from megatron_diffckpt.errors import DiffCkptUsageError
from megatron_diffckpt.integrations.megatron_lm_releases import CHECKPOINTING as _C
from megatron_diffckpt.integrations.megatron_lm_releases import (
    GENERATE_STATE_DICT_SIGNATURE,
    MEGATRON_LM_COMMITS,
    SIGNATURES,
    TESTED_MEGATRON_LM_VERSIONS,
)
from megatron_diffckpt.integrations.megatron_lm_releases import TRAINING as _T
from megatron_diffckpt.patches import base_checkpoint, grad_sync
from megatron_diffckpt.patches.base import MethodPatch, PatchSet
from megatron_diffckpt.storage.format import DiffRecord
from megatron_diffckpt.strategy import BaseSource

logger = logging.getLogger(__name__)
__all__ = [
    "MEGATRON_LM_COMMITS",  # from megatron_lm_releases, with the signatures of each release
    "PATCHES",
    "RUN",
    "TESTED_MEGATRON_LM_VERSIONS",
    "MegatronLMIntegrationError",
    "add_arguments",
    "apply",
    "check_drift",
    "revert",
]


class MegatronLMIntegrationError(DiffCkptUsageError):
    """A Megatron-LM run asks for something the integration does not support (says what to do)."""


class _ReplicaModule:
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


class _Run:
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
                _ReplicaModule(m, source.model_params)
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


RUN = _Run()


def _setup_wrapper(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def setup_model_and_optimizer(*args, **kwargs):
        from megatron.training import get_args

        margs = get_args()
        checkpoint = _checkpoint_being_loaded(margs)
        if checkpoint is not None and margs.ckpt_format == "torch_dist":
            # A dp_reshardable base under another TP or PP size: one line naming the merge
            # that makes it loadable, before Megatron-LM's own error (which names another flag).
            base_checkpoint.check_base_layout(
                checkpoint, margs.tensor_model_parallel_size, margs.pipeline_model_parallel_size
            )
        bound = signature.bind(*args, **kwargs).arguments
        RUN.checkpoint_config = getattr(bound.get("cfg_container"), "checkpoint", None)
        start = time.perf_counter()
        model, optimizer, scheduler = original(*args, **kwargs)
        RUN.begin(model, optimizer, scheduler, time.perf_counter() - start)
        now = RUN.base_now()
        if now is not None:
            from megatron.training import get_args, training

            why = "the recovered iteration" if RUN.base_loaded is not None else "the start"
            logger.info("saving the base of iteration %d (%s)", now, why)
            context = bound.get("checkpointing_context")
            training.save_checkpoint(
                now,
                model,
                optimizer,
                scheduler,
                get_args().num_floating_point_operations_so_far,
                checkpointing_context=context,
            )
            if RUN.base_loaded is None:  # a job's starting point: published before step 1
                training.maybe_finalize_async_save(blocking=True)
        return model, optimizer, scheduler

    return setup_model_and_optimizer


def _train_step_wrapper(original: Callable) -> Callable:
    @functools.wraps(original)
    def train_step(*args, **kwargs):
        RUN.restore_recovered_rng()
        start = time.perf_counter()
        out = original(*args, **kwargs)
        if RUN.manager is not None:
            RUN.after_step(time.perf_counter() - start)
        return out

    return train_step


def _save_wrapper(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_checkpoint(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a["non_persistent_ckpt"] or a["release"]:
            return original(*args, **kwargs)
        if RUN.manager is None:  # no diff log; the compressed exchange's residuals still go in
            RUN.saving = int(a["iteration"])
            try:
                return original(*args, **kwargs)
            finally:
                RUN.saving = None
        RUN.save_base(original, bound)
        return None

    return save_checkpoint


def _checkpoint_being_loaded(args: Any) -> str | None:
    """The ``iter_N`` folder Megatron-LM's ``load_checkpoint`` reads from ``--load`` (its tracker,
    or ``--ckpt-step``), when there is one."""
    if not args.load or not has_tracker(args.load):
        return None
    try:
        step = getattr(args, "ckpt_step", None)
        return checkpoint_dir(
            args.load, step if step is not None else find_latest_iteration(args.load)
        )
    except CheckpointNotFoundError:
        return None


def _generate_state_dict_wrapper(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate_state_dict(*args, **kwargs):
        state = original(*args, **kwargs)
        if RUN.saving is not None and RUN.exchange is not None:
            state.update(base_checkpoint.residuals_state(RUN.exchange.residuals))
            return state
        a = signature.bind(*args, **kwargs).arguments
        loading = a.get("iteration") is None and (a.get("optim_sd_kwargs") or {}).get("is_loading")
        checkpoint = _checkpoint_being_loaded(a["args"]) if loading else None
        if checkpoint is not None and a["args"].ckpt_format == "torch_dist":
            # Another model than the checkpoint's: one line, before megatron fails in its load.
            base_checkpoint.check_base_shapes(state, checkpoint)
        return state

    return generate_state_dict


def _schedule_async_save_wrapper(original: Callable) -> Callable:
    @functools.wraps(original)
    def schedule_async_save(async_request):
        manager, iteration = RUN.manager, RUN.saving
        if manager is not None and iteration is not None:

            def published() -> None:
                # Finalize functions run on every rank; rank 0's tracker update ran before this.
                torch.distributed.barrier()
                manager.on_base_published(iteration)

            async_request.add_finalize_fn(published)
        if RUN.capture_request:  # a LowDiff+ base: its persister writes it
            RUN.captured = async_request
            return None
        if manager is not None and iteration is not None:
            RUN.scheduled.append(iteration)
        return original(async_request)

    return schedule_async_save


def _finalize_async_save_wrapper(original: Callable) -> Callable:
    @functools.wraps(original)
    def maybe_finalize_async_save(*args, **kwargs):
        out = None
        if RUN.manager is None:
            out = original(*args, **kwargs)
        else:  # a base whose write failed (a full disk) goes to the manager
            from megatron.training import async_utils

            def finalize() -> None:
                nonlocal out
                out = original(*args, **kwargs)

            def unfinalized() -> int:  # Megatron-LM 0.19 makes its queue at the first async save
                queue = async_utils._async_calls_queue
                return 0 if queue is None else queue.get_num_unfinalized_calls()

            base_checkpoint.finalize_async_bases(
                finalize,
                unfinalized,
                RUN.scheduled,
                RUN.manager.base_failed,
            )
        blocking = kwargs.get("blocking", args[0] if args else False)
        if blocking and RUN.manager is not None:
            RUN.manager.finish_bases()
        return out

    return maybe_finalize_async_save


def _compile_helpers_wrapper(original: Callable) -> Callable:
    @functools.wraps(original)
    def compile_helpers():
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
            return None  # built already (megatron-core wheels ship it)
        return original()

    return compile_helpers


PATCHES = PatchSet(
    (
        MethodPatch(
            target=f"{_T}:setup_model_and_optimizer",
            expected_signature=SIGNATURES["setup_model_and_optimizer"],
            make_wrapper=_setup_wrapper,
            purpose="recover from base + differentials and start capturing after --load",
            requires=((f"{_T}:num_floating_point_operations", SIGNATURES["num_flops"]),),
        ),
        MethodPatch(
            target=f"{_T}:train_step",
            expected_signature=SIGNATURES["train_step"],
            make_wrapper=_train_step_wrapper,
            purpose="hand each iteration's differential to the diff log",
            requires=(
                ("megatron.core.utils:unwrap_model", "(model, module_instances=None)"),
                (
                    f"{_C}:_build_sharded_state_dict_metadata",
                    "(args: argparse.Namespace, dp_cp_group: Optional[torch.distributed."
                    "distributed_c10d.ProcessGroup] = None) -> dict",
                ),
            ),
        ),
        MethodPatch(
            target=f"{_T}:save_checkpoint",
            expected_signature=SIGNATURES["save_checkpoint"],
            make_wrapper=_save_wrapper,
            purpose="save bases through the manager (LowDiff+: from the replica)",
        ),
        MethodPatch(
            target=f"{_C}:generate_state_dict",
            expected_signature=GENERATE_STATE_DICT_SIGNATURE,
            make_wrapper=_generate_state_dict_wrapper,
            purpose="save the compressed exchange's error-feedback residuals with every base; "
            "refuse a base of another model in one line",
        ),
        MethodPatch(
            target=f"{_C}:schedule_async_save",
            expected_signature=SIGNATURES["schedule_async_save"],
            make_wrapper=_schedule_async_save_wrapper,
            purpose="learn when an asynchronous base is published; write LowDiff+ bases",
        ),
        MethodPatch(
            target=f"{_T}:maybe_finalize_async_save",
            expected_signature="(blocking: bool = False, terminate=False)",
            make_wrapper=_finalize_async_save_wrapper,
            purpose="publish bases in flight where Megatron-LM waits for its saves",
        ),
        MethodPatch(
            target="megatron.core.datasets.utils:compile_helpers",
            expected_signature="()",
            make_wrapper=_compile_helpers_wrapper,
            purpose="skip rebuilding the dataset helpers a megatron-core wheel ships",
        ),
    )
)
check_drift = PATCHES.check_drift


def apply() -> None:
    """Install the hooks. Any rank, before ``pretrain()``; idempotent. Imports
    ``megatron.training`` (a Megatron-LM checkout must be on the path)."""
    PATCHES.apply()


def revert() -> None:
    PATCHES.revert()


def add_arguments(parser: Any) -> Any:
    """Megatron-LM's ``extra_args_provider``: the ``--diffckpt-*`` flags."""
    DiffCkptConfig.add_arguments(parser)
    return parser
