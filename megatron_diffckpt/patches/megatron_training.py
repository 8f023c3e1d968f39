"""Hook points of Megatron-LM's training loop (``megatron.training``): differential checkpointing
inside Megatron-LM's own ``pretrain()``, with nothing changed but the ``--diffckpt-*`` flags.

Megatron-LM is not a package on the registries: it comes from a checkout (written against and
checked with the versions in :data:`TESTED_MEGATRON_LM_VERSIONS`). Every hook wraps a module
global that Megatron-LM's code looks up at call time, and calls the original:

1. ``training.setup_model_and_optimizer``: after the model, the optimizer and the scheduler exist
   and ``--load`` has loaded the newest base, the :class:`DiffCheckpointManager` is created, the
   differentials every rank holds after the base are replayed (the scheduler's step and the
   consumed samples follow them, so the data iterators, built next, resume at the recovered
   iteration; the RNG states are set again at the first ``train_step``, after building the data
   iterators drew from torch's generator), and capture starts.
2. ``training.train_step``: the optimizer step's input was captured inside it (the
   :mod:`~megatron_diffckpt.patches.optimizer_step` hook); after it, the iteration's differential
   is handed to the writer (timed by Megatron-LM's timers as ``diffckpt-diff``), and once, the
   rank's shard map is written (``megatron-diffckpt merge``). Every ``--log-interval``, the
   timer (min/max across ranks) and the manager's metrics (recoverable lag, diff bytes per
   iteration, writer backlog) are logged, and written to Megatron-LM's TensorBoard writer when
   it has one. With ``--diffckpt-auto-tune``, ``--save-interval`` follows the tuned F.
3. ``training.save_checkpoint`` (what ``save_checkpoint_and_time`` and ``pretrain`` call) and
   ``checkpointing.schedule_async_save``: the manager learns that a base was saved and, once its
   tracker moved (at once for a synchronous save, in the asynchronous save's finalize step),
   that it is published, so the diff log rebases and retention applies.
4. ``megatron.core.datasets.utils.compile_helpers``: skipped when the compiled helpers import
   (megatron-core wheels ship them, without the Makefile that Megatron-LM's start-up runs).

Supported here: ``--diffckpt-mode lowdiff`` with dense differentials (megatron's own gradient
reduction), stock ``torch_dist`` bases, TP, PP, DP, the distributed optimizer or not. Refused,
with the flag to change: LowDiff+ and the top-k exchange (they run with
``examples/gpt/pretrain_gpt.py``), context or expert parallelism, ``--iterations-to-skip``.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from megatron_diffckpt.capture import capture_rng, restore_rng
from megatron_diffckpt.config import DiffCkptConfig
from megatron_diffckpt.patches.base import MethodPatch, PatchSet
from megatron_diffckpt.storage.format import DiffRecord

logger = logging.getLogger(__name__)

# Megatron-LM versions (git tags of its repository) these hooks were checked against.
TESTED_MEGATRON_LM_VERSIONS = ("core_v0.16.1",)

_T = "megatron.training.training"
_C = "megatron.training.checkpointing"
_SAVE_SIGNATURE = (
    "(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far, "
    "checkpointing_context=None, pipeline_rank=None, expert_rank=None, tensor_rank=None, "
    "pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False, "
    "train_data_iterator=None, preprocess_common_state_dict_fn=None, release=False, "
    "tp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, "
    "pp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, "
    "dp_cp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None)"
)


class MegatronLMIntegrationError(ValueError):
    """A Megatron-LM run asks for something the integration does not support (says what to do)."""


class _Run:
    """The one training run of this process: what the hooks share."""

    def __init__(self) -> None:
        self.config: DiffCkptConfig | None = None
        self.manager: Any = None
        self.model: list[Any] = []
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.saving: int | None = None  # the iteration of the base being saved
        self.recovered_rng: Any = None  # RNG states at the recovered iteration, until step 1

    def begin(self, model: list[Any], optimizer: Any, scheduler: Any, setup_s: float) -> None:
        """After setup_model_and_optimizer: manager, recovery, start. All ranks."""
        from megatron.core import parallel_state as mpu
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        from megatron.training import get_args
        from megatron.training.training import num_floating_point_operations

        from megatron_diffckpt.manager import DiffCheckpointManager

        args = get_args()
        self.config = DiffCkptConfig.from_args(args)
        if not self.config.enabled:
            return
        _refuse_unsupported(args, self.config)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        coords = (
            mpu.get_tensor_model_parallel_rank(),
            mpu.get_pipeline_model_parallel_rank(),
            mpu.get_data_parallel_rank(),
        )
        self.manager = DiffCheckpointManager(
            self.config, args.save, optimizer, get_cuda_rng_tracker(), coords, model
        )
        if args.load is not None and args.iteration > 0:
            base = args.iteration
            iteration, steps, consumed = self.manager.recover(base, base_load_s=setup_s)
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
        self.manager.start(args.iteration, args.save_interval or 0)

    def after_step(self, train_s: float) -> None:
        """After each train_step: the iteration's differential, the shard map. All ranks."""
        from megatron.core import parallel_state as mpu
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.training import get_args, get_timers
        from megatron.training.checkpointing import (
            _build_sharded_state_dict_metadata,
            generate_state_dict,
        )
        from megatron.training.utils import unwrap_model

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
        if self.config.auto_tune:
            args.save_interval = self.manager.full_interval

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

    def close(self) -> None:
        """Write what is pending and stop. All ranks, after pretrain() returned."""
        if self.manager is not None:
            self.manager.close()
            self.manager = None


RUN = _Run()


def _refuse_unsupported(args: Any, config: DiffCkptConfig) -> None:
    problems = []
    if config.mode != "lowdiff":
        problems.append(
            f"--diffckpt-mode {config.mode}: the Megatron-LM integration runs lowdiff; LowDiff+ "
            "runs with examples/gpt/pretrain_gpt.py"
        )
    if config.compressor != "none":
        problems.append(
            "--diffckpt-compressor topk: the compressed exchange runs with "
            "examples/gpt/pretrain_gpt.py; here differentials are dense"
        )
    if not args.save:
        problems.append("--diffckpt-mode needs --save (the diff log lives beside the bases)")
    if args.ckpt_format != "torch_dist":
        problems.append(f"--ckpt-format {args.ckpt_format}: bases must be torch_dist")
    if (
        getattr(args, "context_parallel_size", 1) > 1
        or getattr(args, "expert_model_parallel_size", 1) > 1
    ):
        problems.append("context or expert parallelism is not supported yet")
    if getattr(args, "iterations_to_skip", None):
        problems.append("--iterations-to-skip leaves gaps that no differential can fill")
    if problems:
        raise MegatronLMIntegrationError("; ".join(problems))


def _setup_wrapper(original: Callable) -> Callable:
    @functools.wraps(original)
    def setup_model_and_optimizer(*args, **kwargs):
        start = time.perf_counter()
        model, optimizer, scheduler = original(*args, **kwargs)
        RUN.begin(model, optimizer, scheduler, time.perf_counter() - start)
        return model, optimizer, scheduler

    return setup_model_and_optimizer


def _train_step_wrapper(original: Callable) -> Callable:
    @functools.wraps(original)
    def train_step(*args, **kwargs):
        if RUN.recovered_rng is not None:
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            restore_rng([RUN.recovered_rng], get_cuda_rng_tracker())
            RUN.recovered_rng = None
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
        manager = RUN.manager
        if manager is None or a["non_persistent_ckpt"] or a["release"]:
            return original(*args, **kwargs)
        from megatron.training import get_args

        iteration = int(a["iteration"])
        RUN.saving = iteration
        start = time.perf_counter()
        try:
            out = original(*args, **kwargs)
        finally:
            RUN.saving = None
        blocked = time.perf_counter() - start
        if not get_args().async_save:  # rank 0 moved the tracker before save_checkpoint's barrier
            manager.on_base_published(iteration)
        manager.on_base_saved(iteration, blocked)
        return out

    return save_checkpoint


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
        return original(async_request)

    return schedule_async_save


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
            expected_signature="(model_provider_func, model_type, checkpointing_context=None)",
            make_wrapper=_setup_wrapper,
            purpose="recover from base + differentials and start capturing after --load",
            requires=((f"{_T}:num_floating_point_operations", "(args, batch_size)"),),
        ),
        MethodPatch(
            target=f"{_T}:train_step",
            expected_signature="(forward_step_func, data_iterator, model, optimizer, "
            "opt_param_scheduler, config, forward_backward_func, iteration=None)",
            make_wrapper=_train_step_wrapper,
            purpose="hand each iteration's differential to the diff log",
            requires=(
                (
                    f"{_C}:generate_state_dict",
                    "(args, model, optimizer, opt_param_scheduler, rng_state, iteration=None, "
                    "optim_sd_kwargs=None, model_sd_kwargs=None, rerun_state=None)",
                ),
                ("megatron.training.utils:unwrap_model", "(model, module_instances=None)"),
                (
                    f"{_C}:_build_sharded_state_dict_metadata",
                    "(args: argparse.Namespace, dp_cp_group: Optional[torch.distributed."
                    "distributed_c10d.ProcessGroup] = None) -> dict",
                ),
            ),
        ),
        MethodPatch(
            target=f"{_T}:save_checkpoint",
            expected_signature=_SAVE_SIGNATURE,
            make_wrapper=_save_wrapper,
            purpose="tell the diff log that a base was saved and published",
        ),
        MethodPatch(
            target=f"{_C}:schedule_async_save",
            expected_signature="(async_request: megatron.core.dist_checkpointing.strategies."
            "async_utils.AsyncRequest)",
            make_wrapper=_schedule_async_save_wrapper,
            purpose="learn when an asynchronous base is published",
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
