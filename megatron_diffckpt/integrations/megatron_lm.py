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

Refused, with the flag to change (:meth:`DiffCkptConfig.check_launch`): context parallelism,
``--iterations-to-skip``, LowDiff+ without the distributed optimizer, with fp16
loss scaling or with ``--dist-ckpt-optim-fully-reshardable``.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import torch

from megatron_diffckpt.checkpoint_layout import (
    CheckpointNotFoundError,
    checkpoint_dir,
    find_latest_iteration,
    has_tracker,
)
from megatron_diffckpt.config import DiffCkptConfig
from megatron_diffckpt.integrations.megatron_lm_releases import CHECKPOINTING as _C
from megatron_diffckpt.integrations.megatron_lm_releases import (
    GENERATE_STATE_DICT_SIGNATURE,
    MEGATRON_LM_COMMITS,
    SIGNATURES,
    TESTED_MEGATRON_LM_VERSIONS,
)
from megatron_diffckpt.integrations.megatron_lm_releases import TRAINING as _T
from megatron_diffckpt.integrations.megatron_lm_run import MegatronLMIntegrationError, MegatronLMRun
from megatron_diffckpt.patches import base_checkpoint
from megatron_diffckpt.patches.base import MethodPatch, PatchSet
from megatron_diffckpt.reshardable import fit_loaded_optimizer_state

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


RUN = MegatronLMRun()


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


def _chained_load_wrapper(original: Callable) -> Callable:
    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        fitted = fit_loaded_optimizer_state(state_dict, len(self.chained_optimizers))
        return original(self, fitted)

    return load_state_dict


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
            target="megatron.core.optimizer.optimizer:ChainedOptimizer.load_state_dict",
            expected_signature="(self, state_dict)",
            make_wrapper=_chained_load_wrapper,
            purpose="load a fully_reshardable checkpoint of another optimizer chaining (a "
            "mixture of experts merged at EP=2 resumed at EP=1, or the other way)",
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
    _escape_stray_percents(parser)
    return parser


def _escape_stray_percents(parser: Any) -> None:
    """argparse expands each help text with ``%``: a help with a bare ``%`` makes ``--help``
    raise (megatron-core 0.19.2's ``--moe-paged-stash-buffer-size-factor-cuda`` ends in "10%)."),
    so such a help gets its bare ``%`` escaped and ``--help`` prints."""
    for action in parser._actions:
        if not isinstance(action.help, str) or "%" not in action.help:
            continue
        try:
            action.help % {**vars(action), "prog": parser.prog}
        except (ValueError, TypeError, KeyError):
            action.help = re.sub(r"%(?![(%])", "%%", action.help)
