"""Hook point: megatron ``dist_checkpointing`` bases (what differential checkpointing adds to them,
and how a LowDiff+ base is written from its ``AsyncRequest``).

Both training entries (the GPT example on megatron-core, and Megatron-LM's ``megatron.training``
through :mod:`megatron_diffckpt.integrations.megatron_lm`) save bases with their own save path;
this module holds what they share, so that no training loop copies it:

- :func:`residuals_state` / :func:`load_residuals`: the compressed exchange's error-feedback
  residuals (local training state no gradient can rebuild, invariant 6) as one
  ``ShardedObject`` per (PP, TP, DP) rank under a key that names the layout. A checkpoint
  without them (dense training, another layout) loads with a warning and zero residuals.
- :func:`split_async_request`: an unscheduled megatron ``AsyncRequest`` as the two halves the
  LowDiff+ strategy runs itself: ``write`` (stage, then write this rank's files: the persister
  thread) and ``finalize`` (metadata last, then the loop's own finalize functions, e.g. the
  tracker: all ranks together, once every rank has written). The request's fields are
  drift-checked (``AsyncRequest`` is a ``NamedTuple`` in the tested releases). ``write`` runs
  megatron's own per-file writer (``FileSystemWriterAsync.write_preloaded_data``: same files,
  same write results) on threads of this process, one per file, where megatron-core 0.16 forks
  a process per file: a LowDiff+ base is host memory that training never touches, so nothing
  needs a process of its own, and a fork of a rank costs it the page-table copy and then a
  copy-on-write fault for every page training writes while the writers live (measured at 12.9M
  parameters on 2 CPU processes: a base every iteration cost +32% forked, +17% on threads).
  megatron-core 0.19 writes with threads itself (``write_preloaded_data_multithread``).
  The files are written without the zip CRC-32 that ``torch.save`` computes by default: no
  loader checks it (``torch.load``, hence megatron's and DCP's loaders, read a file without it;
  a ``.distcp`` file is several ``torch.save`` streams end to end, not one zip an archiver could
  test), and it was two thirds of the write's CPU (measured: 100 MB, 127-190 ms with it, 37-41 ms
  without, on this project's 2-core CI machine).
- :func:`warm_up_writer` / :func:`wait_for_writer`: megatron's checkpoint writer starts a
  ``multiprocessing`` manager by *spawn* the first time a process saves (a few seconds, on the
  training thread, at the first base: the spawned interpreter re-runs the entry script); the
  manager starts it at start-up on a background thread instead, by *fork* (milliseconds), so
  the first base costs what later ones cost.
- :func:`check_base_shapes`: a base of another model is refused in one line;
  :func:`check_base_layout`: so is a ``dp_reshardable`` base under another TP or PP size (with
  the merge that makes it loadable), and a loader learns the base's optimizer format and whether
  its RNG states are this layout's.
- :func:`finalize_async_bases`: finalize a loop's queue of asynchronous saves, handing one whose
  write failed (a full disk) to the manager and going on with the others.

Collective rule: :func:`load_residuals` and :func:`finalize_async_bases` are called by all ranks
together; ``finalize`` of :func:`split_async_request` too; the rest by any rank.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from megatron_diffckpt.errors import DiffCkptUsageError
from megatron_diffckpt.out_of_space import SAVE_FAILURES
from megatron_diffckpt.patches.base import MegatronDriftError, MethodPatch, PatchSet

logger = logging.getLogger(__name__)

_ASYNC = "megatron.core.dist_checkpointing.strategies.async_utils"
_FS_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"

# Drift checks only: split_async_request reads these fields and runs them as megatron's own
# AsyncRequest.execute_sync does (stage with preload_fn, then async_fn), minus its barrier;
# finalize_async_bases counts on the queue's bookkeeping.
PATCHES = PatchSet(
    (
        MethodPatch(
            target=f"{_ASYNC}:AsyncRequest",
            expected_signature={
                release: "(async_fn: Optional[Callable], async_fn_args: Tuple, finalize_fns: "
                f"List[Callable], async_fn_kwargs: Dict = {{}}, preload_fn: {preload} = None, "
                "is_frozen: bool = False, call_idx: int = 0)"
                for release, preload in (("0.16.1", "Callable"), ("0.19.2", "Optional[Callable]"))
            },
            make_wrapper=lambda original: original,
            purpose="write a LowDiff+ base from the replica on the persister thread",
            requires=((f"{_ASYNC}:AsyncRequest.execute_sync", "(self) -> None"),),
        ),
        MethodPatch(
            target=f"{_ASYNC}:AsyncCallsQueue.maybe_finalize_async_calls",
            expected_signature="(self, blocking=False, no_dist=False) -> List[int]",
            make_wrapper=lambda original: original,
            purpose="hand a base whose write failed (a full disk) to the manager and finalize "
            "the saves after it (the failed save has left the queue when megatron raises)",
            requires=((f"{_ASYNC}:AsyncCallsQueue.get_num_unfinalized_calls", "(self)"),),
        ),
    )
)

# The file writer's results queue: a module global that megatron creates on first use through
# its accessor (renamed, and given a start-method argument, in 0.19).
_QUEUE_ACCESSORS = {"0.16.1": "_get_write_results_queue", "0.19.2": "get_write_results_queue"}


def _writer_module() -> Any:
    """megatron's ``filesystem_async`` module, checked to hold the results queue as the warm-up
    expects (the global ``_results_queue`` and an accessor that returns it)."""
    import importlib

    module = importlib.import_module(_FS_ASYNC)
    if not hasattr(module, "_results_queue") or not any(
        hasattr(module, name) for name in _QUEUE_ACCESSORS.values()
    ):
        known = ", ".join(f"{name} ({release})" for release, name in _QUEUE_ACCESSORS.items())
        raise MegatronDriftError(
            f"megatron-core drift at {_FS_ASYNC} (needed to start megatron's checkpoint writer "
            "at start-up, off the training path): expected the module global _results_queue "
            f"and its accessor, one of {known}"
        )
    return module


def check_drift() -> None:
    """Raise :class:`MegatronDriftError` if what this module relies on has changed."""
    PATCHES.check_drift()
    _writer_module()
    _per_file_writer()


RESIDUALS_KEY = "diffckpt_error_feedback"
"""Prefix of the residuals' key; the full key names the (PP, TP, DP) sizes."""


def _layout() -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    from megatron.core import parallel_state as mpu

    coords = (
        mpu.get_pipeline_model_parallel_rank(),
        mpu.get_tensor_model_parallel_rank(),
        mpu.get_data_parallel_rank(),
    )
    sizes = (
        mpu.get_pipeline_model_parallel_world_size(),
        mpu.get_tensor_model_parallel_world_size(),
        mpu.get_data_parallel_world_size(),
    )
    return coords, sizes


def residuals_key() -> str:
    """The residuals' key for this run's layout: residuals of another layout cannot be mapped to
    this one's buckets, and a key a checkpoint lacks is simply not loaded."""
    pp, tp, dp = _layout()[1]
    return f"{RESIDUALS_KEY}.pp{pp}.tp{tp}.dp{dp}"


def residuals_state(residuals: Any) -> dict[str, Any]:
    """``{key: ShardedObject}`` of this rank's error-feedback residuals, to add to a base's
    sharded state dict (one object per rank, no replicas). Any rank."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    coords, sizes = _layout()
    return {
        residuals_key(): ShardedObject(
            residuals_key(), residuals.state_dict(), sizes, coords, replica_id=0
        )
    }


def load_residuals(checkpoint: str, residuals: Any) -> bool:
    """Load this rank's residuals from the base in ``checkpoint`` (an ``iter_N`` folder) when it
    holds them for this layout; otherwise they stay zero, with a warning (training goes on, the
    gradient mass they held is lost). All ranks, collectively. Returns whether they loaded."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    template = residuals_state(residuals)
    state, _missing, unexpected = dist_checkpointing.load(
        template, checkpoint, strict=StrictHandling.RETURN_UNEXPECTED
    )
    key = residuals_key()
    if key in unexpected or key not in state:
        logger.warning(
            "%s holds no error-feedback residuals for this layout: they start from zero",
            checkpoint,
        )
        return False
    residuals.load_state_dict(state[key])
    return True


def split_async_request(
    request: Any, run_writer: Callable[..., tuple[Any, float]] | None = None
) -> tuple[Callable[[], float], Callable[[], None]]:
    """``(write, finalize)`` of an unscheduled megatron ``AsyncRequest`` (see the module doc).
    ``write()`` returns the CPU seconds its file writers took.

    ``run_writer(write_files, *args)`` runs megatron's file writer where the caller chooses
    (LowDiff+ with its replica in the node's keeper: in the keeper,
    :mod:`~megatron_diffckpt.keeper.writes`) and returns what :func:`write_files` returns;
    default: here."""
    check_drift()
    if request is None or not hasattr(request, "finalize_fns"):
        raise TypeError(
            "a LowDiff+ base needs the save function to return the AsyncRequest of an "
            f"asynchronous dist_checkpointing save, got {type(request).__name__}"
        )

    def write() -> float:
        args = list(request.async_fn_args)
        if request.preload_fn is not None:  # stage (a no-op copy for host tensors)
            args[1] = request.preload_fn()
        if request.async_fn is None:
            return 0.0
        files = _file_writer_args(request.async_fn)
        if files is None:  # another writer than megatron's file writer: run it as it is
            request.async_fn(*args, **request.async_fn_kwargs)
            return 0.0
        _rank, write_buckets, results_queue = args  # megatron's writer only logs the rank
        outcome, cpu = (run_writer or _run_here)(write_files, *files, write_buckets)
        results_queue.put(outcome)  # fewer results than files: megatron's finalize reports it
        return cpu

    def finalize() -> None:
        for fn in request.finalize_fns:
            fn()

    return write, finalize


def _run_here(writer: Callable[..., Any], *args: Any) -> Any:
    return writer(*args)


# megatron's file writer (FileSystemWriterAsync): the function an AsyncRequest of a torch_dist
# save runs, per release, and the per-file writer it calls for each file.
_FILE_WRITERS = ("write_preloaded_data_multiproc", "write_preloaded_data_multithread")
_PER_FILE_PARAMS = (
    "transform_list",
    "local_proc_idx",
    "write_bucket",
    "results_queue",
    "count_queue",
    "use_fsync",
    "kwargs",
)


def _file_writer_args(async_fn: Any) -> tuple[Any, bool] | None:
    """``(transform_list, use_msc)`` when ``async_fn`` is megatron's file writer (a ``partial``
    of one of ``_FILE_WRITERS`` with those two arguments bound), else ``None``."""
    func = getattr(async_fn, "func", None)
    if getattr(func, "__name__", None) not in _FILE_WRITERS or len(async_fn.args) != 2:
        return None
    return async_fn.args[0], async_fn.args[1]


def _per_file_writer() -> Callable[..., Any]:
    """``FileSystemWriterAsync.write_preloaded_data``, checked to take what it took in the tested
    releases (its annotations name ``multiprocessing`` objects, so the names are compared)."""
    import importlib

    writer = importlib.import_module(_FS_ASYNC).FileSystemWriterAsync.write_preloaded_data
    found = tuple(inspect.signature(writer).parameters)
    if found != _PER_FILE_PARAMS:
        raise MegatronDriftError(
            f"megatron-core drift at {_FS_ASYNC}:FileSystemWriterAsync.write_preloaded_data "
            f"(writes a LowDiff+ base's files): expected parameters {_PER_FILE_PARAMS}, found "
            f"{found}"
        )
    return writer


@contextlib.contextmanager
def _without_zip_crc32() -> Iterator[None]:
    """``torch.save`` without its zip CRC-32 in this thread while the block runs (see the
    module doc). torch's switch is per thread (a ``ContextVar``): other threads' saves keep
    theirs."""
    import torch.serialization

    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def write_files(
    transform_list: Any, use_msc: bool, write_buckets: list
) -> tuple[dict | Exception, float]:
    """What megatron's file writer does (one writer per file; ``{file index: write results}``
    or the first error, which megatron's finalize step reads from its results queue), on
    threads of the calling process; and the threads' CPU seconds. Any process that can import
    megatron (a rank, or its node's keeper)."""
    writer = _per_file_writer()
    results: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()  # megatron's "count" queue: each writer takes one item
    cpu = [0.0] * len(write_buckets)
    extra = {"use_msc": True} if use_msc else {}

    def run(index: int, bucket: Any) -> None:
        start = time.thread_time()
        try:
            with _without_zip_crc32():
                writer(transform_list, index, bucket, results, done, True, **extra)
        except BaseException as exc:  # noqa: BLE001 - megatron's writer catches its own errors
            results.put((index, exc))
        finally:
            cpu[index] = time.thread_time() - start

    threads = []
    for index, bucket in enumerate(write_buckets):
        done.put(index)
        threads.append(
            threading.Thread(target=run, args=(index, bucket), name=f"diffckpt-base-file-{index}")
        )
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    outcome: dict | Exception = {}
    while not results.empty():
        index, written = results.get()
        if isinstance(written, Exception):
            outcome = written
            break
        outcome[index] = written
    return outcome, sum(cpu)


_WARM_UP: Future | None = None


def finalize_async_bases(
    finalize: Callable[[], Any],
    unfinalized: Callable[[], int],
    scheduled: deque[int],
    on_failed: Callable[[int, BaseException], None] | None,
) -> None:
    """Run ``finalize`` (a ``maybe_finalize_async_calls`` of megatron's ``AsyncCallsQueue``)
    until it returns, handing a save whose finalize step raised to ``on_failed(iteration, exc)``
    and finalizing the ones after it. All ranks, collectively (megatron raises a failed write on
    every rank, after popping the failed save from the queue).

    ``unfinalized()`` is the queue's ``get_num_unfinalized_calls``; ``scheduled`` holds the
    iterations of the queued saves, oldest first, and is kept in step with the queue. Without
    ``on_failed`` the error propagates."""

    def forget_finalized() -> list[int]:
        left = len(scheduled) - unfinalized()
        return [scheduled.popleft() for _ in range(left)]

    while True:
        try:
            finalize()
        except SAVE_FAILURES as exc:
            failed = forget_finalized()
            if on_failed is None or not failed:
                raise
            on_failed(failed[-1], exc)
            continue
        forget_finalized()
        return


def warm_up_writer() -> Future:
    """Start megatron's checkpoint writer machinery (the results queue of its file writer, a
    ``multiprocessing`` manager started by spawn) on a background thread; logs when it is
    ready. Any rank; idempotent (once per process). Returns the future of the seconds it took."""
    global _WARM_UP
    if _WARM_UP is None:
        PATCHES.check_drift()
        module = _writer_module()  # the rest of check_drift()

        def warm() -> float:
            start = time.perf_counter()
            if module._results_queue is None:
                module._results_queue = _fork_results_queue()
            return time.perf_counter() - start

        def report(done: Future) -> None:
            if done.exception() is not None:
                logger.warning("checkpoint writer did not start: %s", done.exception())
            else:
                logger.info(
                    "checkpoint writer ready in %.2f s (started off the training path)",
                    done.result(),
                )

        # The thread stays (idle) after the warm-up: the writer's manager process, which it
        # starts, dies when its starting thread ends (background.helpers_die_with_this_rank).
        future: Future = Future()
        future.add_done_callback(report)

        def run() -> None:
            try:
                future.set_result(warm())
            except BaseException as exc:  # noqa: BLE001 - reported by the callback
                future.set_exception(exc)
            threading.Event().wait()

        threading.Thread(target=run, name="diffckpt-writer-warm-up", daemon=True).start()
        _WARM_UP = future
    return _WARM_UP


def _fork_results_queue() -> Any:
    """The results queue of megatron's file writer, served by a ``multiprocessing`` manager
    started by *fork* (megatron's own default is *spawn*).

    A spawned interpreter re-runs the rank's entry script before it serves (the whole of
    Megatron-LM's ``pretrain_gpt.py`` imports: about 10 CPU-seconds per rank on the CI machines,
    then most of a second of shutdown at exit); a forked one serves at once, already holding
    the modules of what it will carry (DCP's ``WriteResult``, imported here before the fork,
    so the child never imports). Megatron forks its file writers from the rank in the same way, and
    megatron-core 0.19 offers the fork mode for this queue itself (``mp_mode``). Like every
    process a rank forks, the manager dies with the thread that started it
    (:func:`~megatron_diffckpt.background.children_die_with_this_process`): the warm-up thread,
    which stays for the life of the rank."""
    import multiprocessing

    import torch.distributed.checkpoint.storage  # noqa: F401 - the queue carries WriteResults

    return multiprocessing.get_context("fork").Manager().Queue()


def wait_for_writer() -> float:
    """Before a base: wait for :func:`warm_up_writer` to finish (so that the save does not start
    a second writer). Returns the seconds waited (0 once it is ready, or without a warm-up)."""
    if _WARM_UP is None or _WARM_UP.done():
        return 0.0
    start = time.perf_counter()
    _WARM_UP.exception()  # wait; a failed warm-up leaves megatron to start it at the save
    return time.perf_counter() - start


def check_base_shapes(sharded_state_dict: dict, checkpoint: str) -> None:
    """Refuse, in one line, a base whose tensors have other global shapes than this run's
    (another model: hidden size, layers, vocabulary, sequence length) before megatron fails
    deep inside its load. Any rank (reads the checkpoint's metadata)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    saved = dist_checkpointing.load_tensors_metadata(checkpoint)
    shapes = {t.key: tuple(t.global_shape) for t in nested_values(saved)}
    differ = []
    for t in nested_values(sharded_state_dict):
        if isinstance(t, ShardedTensor) and t.key in shapes:
            if shapes[t.key] != tuple(t.global_shape):
                differ.append(
                    f"{t.key} is {list(shapes[t.key])} there, {list(t.global_shape)} here"
                )
    if differ:
        more = f" (and {len(differ) - 2} more)" if len(differ) > 2 else ""
        raise DiffCkptUsageError(
            f"{checkpoint} holds another model than this run builds: {'; '.join(differ[:2])}"
            f"{more}; resume with the model flags that saved it (--num-layers, --hidden-size, "
            "--seq-length, vocabulary, ...)"
        )


_RNG_KEY = re.compile(r"^rng_state/shard_\d+\.\d+_(\d+)\.(\d+)$")
FULLY_RESHARDABLE = ("fully_reshardable", "fully_sharded_model_space")
"""megatron's optimizer formats that load under another TP or PP size."""


@dataclass(frozen=True)
class BaseLayout:
    """How a base was saved, as far as loading it under this run's layout goes."""

    optimizer_format: str
    """The distributed optimizer's ``distrib_optim_sharding_type`` (``dp_reshardable`` for a
    checkpoint that does not say)."""
    same_model_parallel: bool
    """Saved under this run's TP and PP sizes (or it does not say): its RNG states are this
    layout's, so they load."""
    chained_optim_avoid_prefix: bool = False
    """A chained optimizer's model-space keys are unprefixed (megatron's content metadata flag,
    as Megatron-LM and ``merge --reshardable`` save them)."""

    @property
    def load_metadata(self) -> dict:
        """The ``metadata`` of the optimizer's ``sharded_state_dict`` that loads the base, as
        Megatron-LM passes it (the checkpoint's content metadata)."""
        return {
            "distrib_optim_sharding_type": self.optimizer_format,
            "chained_optim_avoid_prefix": self.chained_optim_avoid_prefix,
        }


def check_base_layout(checkpoint: str, tp_size: int, pp_size: int) -> BaseLayout:
    """The optimizer format of ``checkpoint`` and whether it was saved under ``tp_size`` and
    ``pp_size``; a ``dp_reshardable`` base saved under other TP or PP sizes (it reshards along
    data parallelism only) is refused in one line naming the merge that makes it loadable. Any
    rank (reads the checkpoint's metadata and ``common.pt``, as megatron's load does)."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    content = dist_checkpointing.load_content_metadata(checkpoint) or {}
    fmt = content.get("distrib_optim_sharding_type", "dp_reshardable")
    saved = None
    for key in FileSystemReader(checkpoint).read_metadata().state_dict_metadata:
        if m := _RNG_KEY.match(key):
            saved = (int(m.group(2)), int(m.group(1)))  # the key holds (PP, TP) sizes
            break
    same = saved is None or saved == (tp_size, pp_size)
    if not same and fmt not in FULLY_RESHARDABLE:
        root, name = os.path.split(os.path.normpath(checkpoint))
        raise DiffCkptUsageError(
            f"{checkpoint} was saved under TP={saved[0]} PP={saved[1]} in the distributed "
            f"optimizer's {fmt} format, which loads under another data-parallel size only; this "
            f"run has TP={tp_size} PP={pp_size}: resume with --tensor-model-parallel-size "
            f"{saved[0]} --pipeline-model-parallel-size {saved[1]}, or first `megatron-diffckpt "
            f"merge {root} --iteration {int(name.split('_')[-1])} --reshardable --out DIR2` "
            "and --load DIR2 (it loads under any layout)"
        )
    return BaseLayout(fmt, same, bool(content.get("chained_optim_avoid_prefix", False)))
