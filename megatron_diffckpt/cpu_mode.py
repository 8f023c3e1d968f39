"""CPU mode: run real megatron-core on CPU processes with the gloo backend.

megatron-core assumes a GPU in a handful of places (tensor factories with ``device="cuda"``,
``torch.cuda.current_device()``, the CUDA RNG tracker, ``torch.cuda.synchronize()``,
``Tensor.type()`` checks against ``torch.cuda.*Tensor``, and for mixture-of-experts the router's
gemm and the alltoall dispatcher's streams and host copies). This module maps exactly those
calls to their CPU meaning so that GPTModel, megatron DDP, the DistributedOptimizer, the pipeline
schedules and ``dist_checkpointing`` run unmodified on a machine without a GPU: the demo and CI
use it.

Rules:

- :func:`enable` must run **before megatron is imported** (``dist_checkpointing/mapping.py``
  captures ``torch.empty`` as a default argument at import time). It raises :class:`CpuModeError`
  if megatron is already imported, and refuses to act when CUDA is available: the shim must never
  be active on a GPU machine.
- It is idempotent, and :func:`disable` restores every patched attribute.
- Processes that megatron forks (the async-save worker) inherit the patches. Helpers that
  ``multiprocessing`` starts by spawn or forkserver (megatron-core 0.19's persistent async-save
  worker) re-import the entry script first: an entry script that calls
  :func:`enable_if_inherited` at import applies CPU mode there too (the environment says that
  the process that started them was in CPU mode). Any other process must call :func:`enable`
  itself before importing megatron.

What "cuda" means in CPU mode: the CPU. Tensors requested on ``cuda`` are created on the CPU;
the "CUDA RNG state" that megatron's tracker forks for tensor-parallel regions is the CPU default
generator's state (dropout on CPU draws from that generator, so forking it has the same meaning as
on a GPU). ``torch.cuda.is_available()`` still returns ``False``.

Every patch below names the megatron-core 0.16 call sites it was written for;
``tests/test_drift.py`` checks the megatron functions it replaces on each tested release.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_diffckpt.errors import DiffCkptUsageError

logger = logging.getLogger(__name__)

__all__ = [
    "CpuModeError",
    "enable",
    "enable_if_inherited",
    "enable_training",
    "disable",
    "is_enabled",
    "check_drift",
]


class CpuModeError(DiffCkptUsageError, RuntimeError):
    """CPU mode cannot be applied (a GPU is present, or megatron was imported first)."""


@dataclass(frozen=True)
class _Patch:
    owner: Any
    name: str
    make: Callable[[Any], Any]  # original -> replacement
    serves: str  # the megatron-core call sites this patch exists for


_CPU = torch.device("cpu")


def _to_cpu_device(device: Any) -> Any:
    """Map a CUDA device spec (``"cuda"``, ``"cuda:0"``, an index, a cuda torch.device) to CPU."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _cpu_factory(original: Callable) -> Callable:
    """Wrap a tensor factory so that ``device=cuda`` creates a CPU tensor, unpinned."""

    @functools.wraps(original)
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # pinning needs a CUDA driver
        return original(*args, **kwargs)

    factory.__diffckpt_cpu_mode__ = True
    return factory


def _tensor_cuda(original: Callable) -> Callable:
    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return self

    return cuda


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _tensor_type(original: Callable) -> Callable:
    @functools.wraps(original)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return _CUDA_TYPE_NAMES.get(name, name)
        return original(self, dtype, non_blocking, **kwargs)

    return type_


def _const(value: Any) -> Callable[[Any], Callable]:
    def make(original: Callable) -> Callable:
        def replacement(*args, **kwargs):
            return value

        return replacement

    return make


def _noop(original: Callable) -> Callable:
    return _const(None)(original)


class _CpuEvent:
    """Stands in for ``torch.cuda.Event``: on CPU every recorded piece of work is done."""

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def query(self) -> bool:
        return True

    def synchronize(self):
        pass


class _CpuStream:
    """Stands in for ``torch.cuda.Stream`` on CPU, where all work is ordered on the host: every
    stream is the same one (the MoE token dispatcher's side stream is its current stream)."""

    def __init__(self, *args, **kwargs):
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _CpuStream)

    def __hash__(self) -> int:
        return hash(_CpuStream)

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def synchronize(self):
        pass


def _cpu_rng_get(original: Callable) -> Callable:
    def get_rng_state(device: Any = "cuda", *args, **kwargs):
        return torch.get_rng_state()

    return get_rng_state


def _cpu_rng_set(original: Callable) -> Callable:
    def set_rng_state(new_state: torch.Tensor, device: Any = -1, *args, **kwargs):
        torch.set_rng_state(new_state)

    return set_rng_state


def _cpu_seed(original: Callable) -> Callable:
    def manual_seed(seed: int):
        # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, this very function.
        torch.default_generator.manual_seed(int(seed))

    return manual_seed


_compile_off: list[bool] = []  # non-empty while enable_training() has torch.compile switched off


def _deferred_compile(original: Callable) -> Callable:
    """``torch.compile`` that imports and runs the compiler at a function's first call, not when it
    wraps the function.

    megatron's ``jit_fuser`` is ``torch.compile``, and ``megatron/core/fusions/*.py`` wrap their
    elementwise functions with it at import time: that alone imports ``torch._dynamo`` and
    ``torch._inductor``, 2.4 s of every process's start-up on this machine, although the CPU runs
    rarely call those functions. ``torch.compile`` compiles at the first call anyway, so deferring
    the wrapping changes nothing else. While :func:`enable_training` has compilation off, the first
    call runs the function as written, as ``torch._dynamo.config.disable`` would.
    """

    @functools.wraps(original)
    def compile_(model=None, **kwargs):
        if model is None:  # used as @torch.compile(**options)
            return lambda fn: compile_(fn, **kwargs)
        if isinstance(model, torch.nn.Module):
            return model if _compile_off else original(model, **kwargs)
        compiled: list[Callable] = []

        @functools.wraps(model)
        def first_call_compiles(*args, **kw):
            if not compiled:
                compiled.append(model if _compile_off else original(model, **kwargs))
            return compiled[0](*args, **kw)

        return first_call_compiles

    return compile_


# Patches on torch itself. They must be in place before megatron is imported.
_TORCH_FACTORIES = (
    "rand",  # Megatron-LM's initialize.py (_warmup_jit_function)
    "randn",
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "arange",
    "empty_like",
    "zeros_like",
)
_TORCH_PATCHES: tuple[_Patch, ...] = (
    *(
        _Patch(
            torch,
            f,
            _cpu_factory,
            'device="cuda" factories: schedules.py (total_num_tokens), optimizer.py (found_inf), '
            "clip_grads.py, grad_scaler.py, param_and_grad_buffer.py, p2p_communication.py, "
            "state_dict_saver.py, exchange_utils.py; torch.empty captured by mapping.py",
        )
        for f in _TORCH_FACTORIES
    ),
    _Patch(
        torch,
        "compile",
        _deferred_compile,
        "jit.py jit_fuser, applied at import by fusions/fused_bias_gelu.py, fused_bias_geglu.py, "
        "fused_bias_swiglu.py and the other fused elementwise functions",
    ),
    _Patch(
        torch.cuda,
        "current_device",
        _const(_CPU),
        "utils.py GlobalMemoryBuffer, param_and_grad_buffer.py, p2p_communication.py, "
        "async_utils.py, distrib_optimizer.py",
    ),
    _Patch(
        torch.cuda,
        "synchronize",
        _noop,
        "p2p_communication.py, filesystem_async.py, async_utils.py",
    ),
    _Patch(torch.cuda, "empty_cache", _noop, "optimizer.py, distributed_data_parallel.py"),
    _Patch(torch.cuda, "set_device", _noop, "async_utils.py persistent async-save worker"),
    _Patch(torch.cuda, "device_count", _const(1), "async_utils.py persistent async-save worker"),
    _Patch(torch.cuda, "Stream", lambda original: _CpuStream, "distributed_data_parallel.py"),
    _Patch(
        torch.cuda,
        "stream",
        lambda original: lambda stream=None: contextlib.nullcontext(),
        "param_and_grad_buffer.py",
    ),
    _Patch(
        torch.cuda,
        "default_stream",
        lambda original: lambda *a, **k: _CpuStream(),
        "param_and_grad_buffer.py (communication_stream.wait_stream)",
    ),
    _Patch(
        torch.cuda,
        "current_stream",
        lambda original: lambda *a, **k: _CpuStream(),
        "fine_grained_activation_offload.py, utils.py",
    ),
    _Patch(torch.cuda, "get_rng_state", _cpu_rng_get, "tensor_parallel/random.py tracker.add"),
    _Patch(torch.cuda, "set_rng_state", _cpu_rng_set, "tensor_parallel/random.py"),
    _Patch(torch.cuda, "manual_seed", _cpu_seed, "random.py model_parallel_cuda_manual_seed"),
    _Patch(torch.cuda, "manual_seed_all", _cpu_seed, "random.py"),
    _Patch(
        torch.Tensor,
        "cuda",
        _tensor_cuda,
        "optimizer.py, distrib_optimizer.py, exchange_utils.py, grad_scaler.py (.cuda())",
    ),
    _Patch(
        torch.Tensor,
        "type",
        _tensor_type,
        "distrib_optimizer.py, optimizer.py, clip_grads.py (param.type() == 'torch.cuda.*Tensor')",
    ),
)


_MCORE_RANDOM = "megatron.core.tensor_parallel.random"
_WRITE_BUCKETS = "List[Tuple[pathlib.Path, str, Tuple[list, list]]]"


def _staging_copy(original: Any) -> Any:
    """``FileSystemWriterAsync.preload_tensors`` that stages copies of shared tensors.

    Its staging step is a device-to-host copy, ``tensor.to("cpu")``, which on a CPU tensor is the
    tensor itself. megatron's persistent async-save worker receives a save's tensors through a
    ``multiprocessing`` queue, that is in shared memory with the training process, and stages
    them while training waits; after that training goes on and changes them under the worker's
    write. So shared tensors are copied here, as the staging copy does on a GPU; a process forked
    for the save (the temporal caller) has its own copy-on-write pages and copies nothing.
    """
    stage = original.__func__

    @functools.wraps(stage)
    def preload_tensors(write_buckets, non_blocking=True):
        staged = []
        for file_name, storage_key, (bytes_data, tensor_data) in stage(write_buckets, non_blocking):
            tensors = [(item, t.clone() if t.is_shared() else t) for item, t in tensor_data]
            staged.append((file_name, storage_key, (bytes_data, tensors)))
        return staged

    return staticmethod(preload_tensors)


def _host_splits(original: Callable) -> Callable:
    """``maybe_move_tensor_to_cpu`` for CPU tensors: the MoE alltoall dispatcher's split sizes
    as numpy arrays, which megatron gets from a device tensor's host copy and hands to
    ``all_to_all_single`` (which takes no tensor there)."""

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy, record_stream)

    return maybe_move_tensor_to_cpu


def _megatron_patches():
    """Patches on megatron modules, applied after the torch patches (this imports megatron)."""
    from megatron_diffckpt.patches.base import MethodPatch, PatchSet

    return PatchSet(
        (
            MethodPatch(
                target=f"{_MCORE_RANDOM}:_get_cuda_rng_state",
                expected_signature="(device: Union[int, str, torch.device] = 'cuda', "
                "clone: bool = False, graph_safe: bool = False) -> torch.Tensor",
                make_wrapper=_cpu_rng_get,
                purpose="read the device RNG state in CudaRNGStatesTracker.fork (CPU mode)",
            ),
            MethodPatch(
                target=f"{_MCORE_RANDOM}:_set_cuda_rng_state",
                expected_signature="(new_state: torch.Tensor, device: int = -1, "
                "graph_safe: bool = False)",
                make_wrapper=_cpu_rng_set,
                purpose="set the device RNG state in CudaRNGStatesTracker.add/fork (CPU mode)",
            ),
            MethodPatch(
                target="megatron.core.dist_checkpointing.strategies.filesystem_async:"
                "FileSystemWriterAsync.preload_tensors",
                expected_signature=f"(write_buckets: {_WRITE_BUCKETS}, non_blocking=True) -> "
                f"{_WRITE_BUCKETS}",
                make_wrapper=_staging_copy,
                purpose="stage a copy of what the persistent async-save worker writes (CPU mode)",
            ),
            MethodPatch(
                target="megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu",
                expected_signature="(tensor: torch.Tensor, as_numpy: bool = False, "
                "record_stream: bool = False) -> torch.Tensor",
                make_wrapper=_host_splits,
                purpose="give the MoE alltoall dispatcher its split sizes on the host (CPU mode)",
            ),
        )
    )


# Names megatron-core imports from transformer-engine only, with no binding otherwise, and then
# tests for ``None`` before falling back to torch: bound to ``None`` while CPU mode is on where
# the module lacks them (from megatron-core 0.17 on it binds them to ``None`` itself).
_TE_ONLY_NAMES = (
    (
        "megatron.core.transformer.moe.moe_utils",
        "te_general_gemm",
        "RouterGatingLinearFunction: the MoE router's gemm (torch.mm without it)",
    ),
)
_bound: list[tuple[Any, str]] = []  # (module, name) bound to None by enable()


def _bind_te_only_names() -> None:
    for module_name, name, _serves in _TE_ONLY_NAMES:
        module = importlib.import_module(module_name)
        if not hasattr(module, name):
            setattr(module, name, None)
            _bound.append((module, name))


def _allow_no_cuda(original: Callable) -> Callable:
    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True  # CPU mode stands in for CUDA
        return original(*args, **kwargs)

    return initialize_megatron


def _training_patches():
    """Patches on Megatron-LM's ``megatron.training`` (imports it: a Megatron-LM checkout must be
    on the path), for its GPT pretraining on CPU processes."""
    from megatron_diffckpt.patches.base import MethodPatch, PatchSet

    return PatchSet(
        (
            MethodPatch(
                target="megatron.training.training:initialize_megatron",
                expected_signature={
                    "0.16.1": "(extra_args_provider=None, args_defaults={}, "
                    "ignore_unknown_args=False, allow_no_cuda=False, "
                    "skip_mpu_initialization=False, get_embedding_ranks=None, "
                    "get_position_embedding_ranks=None, parsed_args=None, store=None)",
                    "0.19.0": "(allow_no_cuda=False, skip_mpu_initialization=False, "
                    "get_embedding_ranks=None, get_position_embedding_ranks=None, store=None, "
                    "skip_model_parallel_init=False, seed_pp_group=None, seed_dp_group=None, "
                    "seed_tp_group=None, seed_ep_group=None, seed_etp_group=None, "
                    "skip_random_seed=False)",
                },
                make_wrapper=_allow_no_cuda,
                purpose="let pretrain() initialize without CUDA (CPU mode)",
            ),
            MethodPatch(
                # validate_args asks for the GPU architecture with TP > 1, to require
                # CUDA_DEVICE_MAX_CONNECTIONS=1 before Blackwell (10): a CUDA stream-scheduling
                # concern that has no meaning on CPU, so CPU mode answers "no such limit".
                target="megatron.training.arguments:get_device_arch_version",
                expected_signature="()",
                make_wrapper=_const(10),
                purpose="validate Megatron-LM's arguments without a GPU (CPU mode)",
            ),
            MethodPatch(
                target="megatron.legacy.fused_kernels:load",
                expected_signature="(args)",
                make_wrapper=lambda original: lambda args: None,
                purpose="skip building the CUDA fused kernels (CPU mode)",
                until="0.19.0",  # Megatron-LM no longer builds them at start-up
            ),
        )
    )


_training_applied: list = []


def enable_training() -> None:
    """CPU mode for Megatron-LM's ``megatron.training`` as well: after :func:`enable`, before
    ``pretrain()``. Also switches ``torch.compile`` off: Megatron-LM's fused elementwise
    functions would each be compiled to C++ on CPU (tens of seconds per process, for nothing on a
    test machine); they run as written. Idempotent; :func:`disable` reverts it."""
    if not is_enabled():
        raise CpuModeError("cpu_mode.enable_training() needs cpu_mode.enable() first")
    if _training_applied:
        return
    patches = _training_patches()
    patches.apply()
    _training_applied.append(patches)
    _compile_off.append(True)


class _ForkWarningFilter(logging.Filter):
    """Drops megatron's "CPU RNG state changed within GPU RNG context" warning.

    In CPU mode the tracker's device generator *is* the CPU generator, so that warning fires on
    every tensor-parallel weight initialisation and dropout while meaning nothing.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_applied: list[tuple[Any, str, Any]] = []  # torch patches: (owner, name, original), in order
_INHERITED = "DIFFCKPT_CPU_MODE"  # "1" while CPU mode is on: what helper processes inherit
_megatron_applied: list = []  # the PatchSet applied on megatron modules, while enabled
_filter = _ForkWarningFilter()


def is_enabled() -> bool:
    """Whether CPU mode is active in this process."""
    return bool(_applied)


def _apply(patches: tuple[_Patch, ...]) -> None:
    for p in patches:
        original = getattr(p.owner, p.name)
        setattr(p.owner, p.name, p.make(original))
        _applied.append((p.owner, p.name, original))


def enable() -> None:
    """Apply the CPU shim in this process. Any rank, before megatron is imported; idempotent.

    Raises:
        CpuModeError: CUDA is available, or megatron-core was imported before this call.
    """
    if is_enabled():
        return
    if torch.cuda.is_available():
        raise CpuModeError(
            "CPU mode refuses to act on a machine with CUDA: megatron-core runs natively there. "
            "Drop --cpu to run on the GPU, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to force CPU."
        )
    if any(m == "megatron.core" or m.startswith("megatron.core.") for m in sys.modules):
        raise CpuModeError(
            "megatron.core was imported before megatron_diffckpt.cpu_mode.enable(): some of its "
            "modules capture torch factories at import time. Call enable() first."
        )
    megatron_patches = _megatron_patches()
    _apply(_TORCH_PATCHES)
    try:
        megatron_patches.apply()
        _bind_te_only_names()
    except Exception:
        disable()
        raise
    _megatron_applied.append(megatron_patches)
    os.environ[_INHERITED] = "1"
    logging.getLogger(_MCORE_RANDOM).addFilter(_filter)
    logger.debug("CPU mode enabled: %d patches", len(_applied))


def enable_if_inherited() -> None:
    """For entry scripts, at import: in a helper that ``multiprocessing`` started by spawn or
    forkserver from a process in CPU mode (such a helper imports the entry script before its
    target), CPU mode here too, before the target imports megatron. A no-op anywhere else."""
    if os.environ.get(_INHERITED) == "1":
        enable()


def disable() -> None:
    """Restore every attribute :func:`enable` replaced. Any rank; idempotent.

    Megatron objects created while CPU mode was on keep their CPU tensors.
    """
    while _training_applied:
        _training_applied.pop().revert()
    _compile_off.clear()
    while _megatron_applied:
        _megatron_applied.pop().revert()
    while _bound:
        delattr(*_bound.pop())
    while _applied:
        owner, name, original = _applied.pop()
        setattr(owner, name, original)
    os.environ.pop(_INHERITED, None)
    logging.getLogger(_MCORE_RANDOM).removeFilter(_filter)


def check_drift() -> None:
    """Check the megatron-core functions CPU mode replaces. Any process; imports megatron."""
    _megatron_patches().check_drift()
