"""LowDiff+'s replica in the node's keeper: the merger runs there, fed through shared memory.

In-process, LowDiff+'s host replica dies with its rank, and what makes an iteration recoverable
after the newest base is the dense diff log (every iteration's gradient shard, written to
storage). With ``--diffckpt-plus-keeper-replica`` under a node launcher that runs a keeper, the
replica lives in the keeper instead (:mod:`~megatron_diffckpt.keeper`), and so does its merger:

1. **Anchor.** The rank creates the replica (the main-parameter shard and the optimizer state,
   as :class:`~megatron_diffckpt.replica_merger.ReplicaMerger` does) and its snapshot slots in
   files of the keeper's shared-memory folder (``/dev/shm``), and hands their description to the
   keeper (``replica_open``), which maps the same pages and builds the same torch optimizer over
   them. Bytes count against the keeper's memory cap; a replica that does not fit is refused in
   one line naming the flag.
2. **Hand-over.** Each iteration the bucket snapshots land in a shared slot; a background thread
   of the rank sends the step's scalars (learning rates, clipping coefficients) and the
   iteration's RNG states and counters (``replica_merge``); the keeper's reply is the
   acknowledgement: from then on the iteration survives the rank (SIGKILL included), not the
   node.
3. **One behind.** The keeper steps its replica with iteration ``t`` only when ``t + 1`` arrives
   (or a base, or a recovery, asks for it), then gives ``t``'s slot back. A rank can therefore
   be recovered to ``M`` (what the replica holds) or ``M + 1`` (the input it holds): ranks die
   at most one iteration apart (the next iteration's collectives wait for every rank's hand-over
   of the previous one), so every rank can reach the newest iteration all of them handed over.
4. **Bases.** At a base the rank asks for everything up to its iteration to be merged, and reads
   the replica through its own mapping of the pages (the keeper is idle then: nothing later was
   handed over); the persist path is LowDiff+'s own.
5. **Recovery** (:func:`recover_from_keepers`, all ranks): each rank's keeper offers ``M`` and
   ``M + 1``; the ranks agree on the newest iteration every rank can reach (one MIN), the keeper
   merges or drops its held input, and the rank copies the replica into its optimizer: no base
   is read from storage and nothing is replayed. When some rank cannot reach it (its keeper was
   lost with its node), every rank goes to storage.

Exactness: the keeper runs the same torch optimizer class with the same options on the same
inputs (:func:`~megatron_diffckpt.replica_merger.step_replica`), so on CPU the replica is
bit-identical to the training state, as in-process.

Which threads: :class:`KeeperReplicaMerger`'s methods are the training thread's, as
:class:`~megatron_diffckpt.replica_merger.ReplicaMerger`'s; its hand-over thread does the rest.
:class:`HostedReplica` is the keeper's (one lock per rank).
"""

from __future__ import annotations

import io
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from megatron_diffckpt.background import BackgroundWorker, CpuMeter
from megatron_diffckpt.capture import restore_rng
from megatron_diffckpt.errors import DiffCkptUsageError
from megatron_diffckpt.replica_merger import (
    MergeJob,
    ParamSlice,
    ShardLayout,
    StepInputs,
    _replica_of,
    step_replica,
)
from megatron_diffckpt.snapshot import BucketSnapshotter, SnapshotSlot
from megatron_diffckpt.storage.format import DiffRecord, encode_record, iter_records

logger = logging.getLogger(__name__)

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.uint8,
    )  # fmt: skip
}
_OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}
KEEPER_FLAG_HINT = "raise the node launcher's --diffckpt-keeper-memory"


def map_tensor(spec: dict[str, Any]) -> torch.Tensor:
    """The tensor a ``{"file", "shape", "dtype"}`` spec names, mapped shared (writes are seen by
    every process that maps the file)."""
    shape, dtype = tuple(spec["shape"]), _DTYPES[spec["dtype"]]
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_file(spec["file"], shared=True, size=numel, dtype=dtype).view(shape)


class SharedArena:
    """Tensors this rank creates in files of the keeper's shared-memory folder.

    File names carry the process id and a counter, so a restarted rank never maps its
    predecessor's files; the keeper removes a file when it stops using it, and the whole
    folder when it stops.
    """

    def __init__(self, folder: str):
        self.folder = folder
        self._count = 0
        self.specs: dict[int, dict[str, Any]] = {}  # id(tensor) -> its spec

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        self._count += 1
        spec = {
            "file": os.path.join(self.folder, f"{os.getpid()}-{self._count}"),
            "shape": list(shape),
            "dtype": str(dtype).removeprefix("torch."),
        }
        tensor = map_tensor(spec)
        self.specs[id(tensor)] = spec
        return tensor

    def copy(self, source: torch.Tensor, _name: str = "") -> torch.Tensor:
        """A shared copy of ``source`` (a replica allocator)."""
        tensor = self.empty(tuple(source.shape), source.dtype)
        tensor.copy_(source.detach())
        return tensor

    def spec(self, tensor: torch.Tensor) -> dict[str, Any]:
        return self.specs[id(tensor)]


def describe(optimizers: list[torch.optim.Optimizer | None], spec_of: Any) -> list[Any]:
    """The replica ``optimizers`` as plain data: class, group options, and per parameter the
    spec of its tensor and of each state tensor (``spec_of(tensor)``)."""
    out: list[Any] = []
    for opt in optimizers:
        if opt is None:
            out.append(None)
            continue
        groups = []
        for group in opt.param_groups:
            options = {k: v for k, v in group.items() if k != "params"}
            params = []
            for p in group["params"]:
                state = {
                    k: {"tensor": spec_of(v)} if torch.is_tensor(v) else {"value": v}
                    for k, v in opt.state.get(p, {}).items()
                }
                params.append({"param": spec_of(p), "state": state})
            groups.append({"options": options, "params": params})
        out.append({"class": type(opt).__name__, "groups": groups})
    return out


def build(description: list[Any]) -> list[torch.optim.Optimizer | None]:
    """The optimizers :func:`describe` described, over mapped tensors."""
    optimizers: list[torch.optim.Optimizer | None] = []
    for d in description:
        if d is None:
            optimizers.append(None)
            continue
        groups, states = [], []
        for g in d["groups"]:
            params = [map_tensor(p["param"]) for p in g["params"]]
            groups.append({"params": params, **g["options"]})
            for p, spec in zip(params, g["params"], strict=True):
                states.append((p, spec["state"]))
        opt = _OPTIMIZERS[d["class"]](groups)
        for p, state in states:
            if state:
                opt.state[p] = {
                    k: map_tensor(v["tensor"]) if "tensor" in v else v["value"]
                    for k, v in state.items()
                }
        optimizers.append(opt)
    return optimizers


def files_of(description: list[Any], slots: list[dict[str, Any]]) -> set[str]:
    files = {s["file"] for slot in slots for s in slot.values()}
    for d in description:
        for g in d["groups"] if d else []:
            for p in g["params"]:
                files.add(p["param"]["file"])
                files.update(v["tensor"]["file"] for v in p["state"].values() if "tensor" in v)
    return files


def nbytes_of(description: list[Any], slots: list[dict[str, Any]]) -> int:
    specs = [s for slot in slots for s in slot.values()]
    for d in description:
        for g in d["groups"] if d else []:
            for p in g["params"]:
                specs.append(p["param"])
                specs.extend(v["tensor"] for v in p["state"].values() if "tensor" in v)
    return sum(math.prod(s["shape"]) * _DTYPES[s["dtype"]].itemsize for s in specs)


def initial_adam_state(opt: torch.optim.Optimizer, alloc: Any) -> None:
    """Give each parameter without state (no step yet) the state torch Adam's first step would
    create, made by ``alloc(tensor)``: in shared memory, the keeper's steps update it in place
    where the rank and a recovery see it (a state Adam created lazily would be the keeper's)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if opt.state.get(p):
                continue
            names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
            state = {"step": alloc(torch.tensor(0.0, dtype=torch.float32))}
            state.update({n: alloc(torch.zeros_like(p)) for n in names})
            opt.state[p] = state


# ---------------------------------------------------------------------------------- the keeper
@dataclass
class _Held:
    """An iteration handed over, not yet merged: its slot stays the keeper's."""

    iteration: int
    slot: int | None
    filled: set[str]
    inputs: StepInputs
    record: bytes


class HostedReplica:
    """One rank's replica in the keeper, one iteration behind what the rank handed over."""

    def __init__(self, request: dict[str, Any], record: bytes, previous: HostedReplica | None):
        reuse = request.get("reuse", False)
        if reuse and (previous is None or previous.merged != request["iteration"]):
            raise ValueError("nothing to reuse: the keeper's replica is not at that iteration")
        self.description = request["optimizers"]
        self.optimizers = previous.optimizers if reuse else build(self.description)
        self.layout: ShardLayout = [
            [[ParamSlice(*where) for where in group] for group in inner]
            for inner in request["layout"]
        ]
        self.slot_specs = request["slots"]
        self.slots = [{k: map_tensor(s) for k, s in slot.items()} for slot in self.slot_specs]
        self.files = files_of(self.description, self.slot_specs)
        self.nbytes = nbytes_of(self.description, self.slot_specs)
        self.merged = int(request["iteration"])
        self.record = record  # the counters and RNG states at ``merged`` (b"": none)
        self.held: _Held | None = None
        self.cpu = CpuMeter()
        self.lock = threading.Lock()

    def take(self, request: dict[str, Any], record: bytes) -> list[int]:
        """Hold the iteration ``request`` hands over, after merging the one held before; the
        slots given back."""
        iteration = int(request["iteration"])
        expected = (self.held.iteration if self.held else self.merged) + 1
        if iteration != expected:
            raise ValueError(f"handed iteration {iteration}, expected {expected}")
        released = self._merge_held()
        inputs = StepInputs(
            {k: list(v) for k, v in request["groups"].items()},
            {int(k): float(v) for k, v in request["clip"].items()},
        )
        self.held = _Held(iteration, request["slot"], set(request["filled"]), inputs, record)
        return released

    def flush(self, through: int) -> list[int]:
        """Merge the held iteration if it is at most ``through``; the slots given back."""
        if self.held is not None and self.held.iteration <= through:
            return self._merge_held()
        return []

    def offer(self) -> tuple[int, int]:
        """``(low, high)``: the iterations this replica can be recovered to (``-1, -1``: none).
        ``merged`` counts only with its counters and RNG states (a replica anchored from a base
        has none: storage serves that iteration)."""
        high = self.held.iteration if self.held else self.merged
        low = self.merged if self.record else self.merged + 1
        return (low, high) if low <= high else (-1, -1)

    def settle(self, target: int) -> list[int]:
        """Make the replica hold ``target`` (merge or drop the held iteration)."""
        if self.held is not None and self.held.iteration == target:
            return self._merge_held()
        if self.merged != target or not self.record:
            raise ValueError(f"cannot settle at {target}: holds {self.offer()}")
        released = [] if self.held is None or self.held.slot is None else [self.held.slot]
        self.held = None
        return released

    def _merge_held(self) -> list[int]:
        held, self.held = self.held, None
        if held is None:
            return []
        if not held.inputs.skipped:
            if held.slot is None:
                raise ValueError(f"iteration {held.iteration} stepped without snapshots")
            step_replica(
                self.optimizers, self.layout, self.slots[held.slot], held.filled, held.inputs,
                held.iteration, self.cpu,
            )  # fmt: skip
        self.merged, self.record = held.iteration, held.record
        return [] if held.slot is None else [held.slot]


class HostedReplicas:
    """Every rank's :class:`HostedReplica` of one keeper; bytes reserved against its cap."""

    def __init__(self, state: Any, folder: str):
        self.state = state  # the KeeperState whose cap the replicas share
        self.folder = folder
        self._replicas: dict[tuple, HostedReplica] = {}
        self._lock = threading.Lock()

    def handle(self, op: str, key: tuple, req: dict, payload: bytes) -> tuple[dict, bytes]:
        """One ``replica_*`` request; the reply. Errors are replies (``{"error": ...}``)."""
        try:
            if op == "replica_open":
                return self._open(key, req, payload), b""
            replica = self._replicas.get(key)
            if op == "replica_close":
                self._drop(key)
                return {"ok": True}, b""
            if replica is None:
                return ({"replica": None}, b"") if op == "replica_state" else (
                    {"error": "the keeper holds no replica of this rank"}, b""
                )  # fmt: skip
            with replica.lock:
                return self._serve(op, replica, req, payload)
        except (ValueError, KeyError, OSError, RuntimeError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}, b""

    def _serve(self, op: str, replica: HostedReplica, req: dict, payload: bytes):
        start = time.perf_counter()
        if op == "replica_merge":
            released = replica.take(req, bytes(payload))
        elif op == "replica_flush":
            released = replica.flush(int(req["through"]))
        elif op == "replica_settle":
            released = replica.settle(int(req["iteration"]))
        elif op == "replica_state":
            low, high = replica.offer()
            records = replica.record + (replica.held.record if replica.held else b"")
            doc = {"low": low, "high": high, "merged": replica.merged}
            return {"replica": {**doc, "optimizers": replica.description}}, records
        else:
            return {"error": f"unknown request {op!r}"}, b""
        return {
            "released": released,
            "merged": replica.merged,
            "merge_s": time.perf_counter() - start,
            "cpu": replica.cpu.totals(),
        }, b""

    def _open(self, key: tuple, req: dict, payload: bytes) -> dict:
        with self._lock:
            previous = self._replicas.get(key)
            if previous is not None:
                previous.lock.acquire()
            try:
                carried = b""
                if previous is not None and previous.merged == int(req["iteration"]):
                    carried = previous.record
                replica = HostedReplica(req, bytes(payload) or carried, previous)
                room = self.state.reserve(replica.nbytes, previous.nbytes if previous else 0)
                if not room[0]:
                    self._remove_files(replica.files - (previous.files if previous else set()))
                    return {"error": room[1]}
                self._replicas[key] = replica
                if previous is not None:
                    self._remove_files(previous.files - replica.files)
            finally:
                if previous is not None:
                    previous.lock.release()
        return {"ok": True, "merged": replica.merged}

    def _drop(self, key: tuple) -> None:
        with self._lock:
            replica = self._replicas.pop(key, None)
            if replica is not None:
                self.state.reserve(0, replica.nbytes)
                self._remove_files(replica.files)

    def _remove_files(self, files: set[str]) -> None:
        for path in files:
            if os.path.dirname(path) == self.folder:  # never outside the keeper's own folder
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass

    def stats(self) -> list[dict[str, Any]]:
        return [
            {
                **dict(key),
                "merged": r.merged,
                "held": r.held.iteration if r.held else None,
                "bytes": r.nbytes,
            }  # fmt: skip
            for key, r in self._replicas.items()
        ]


# ---------------------------------------------------------------------------------- the rank
class KeeperReplicaMerger:
    """:class:`~megatron_diffckpt.replica_merger.ReplicaMerger`'s interface, with the replica
    and its merger in the node's keeper (``client``: this rank's
    :class:`~megatron_diffckpt.keeper.KeeperClient`).

    Build the :class:`BucketSnapshotter` with ``buffer=merger.slot_buffer`` (its slots in
    shared memory) and one slot more than in-process (the keeper holds one), then
    :meth:`attach` it.
    """

    def __init__(self, client: Any, layout: ShardLayout, cpu: CpuMeter | None = None):
        self.client = client
        self.layout = layout
        self.cpu = cpu if cpu is not None else CpuMeter()
        self.arena = SharedArena(client.shm_folder())
        self.optimizers: list[torch.optim.Optimizer | None] = []
        self.snapshotter: BucketSnapshotter | None = None
        self.resumed: tuple[int, list[Any]] | None = None
        """Set by :func:`recover_from_keepers`: the iteration and description of the keeper's
        replica the training state was copied from (the next :meth:`anchor` keeps it)."""
        self._slot_specs: list[dict[str, Any]] = []
        self._held: dict[int, SnapshotSlot] = {}
        self._merged = -1
        self._cpu_seen: dict[str, float] = {}
        self._cond = threading.Condition()
        self.merge_seconds = 0.0
        """The keeper's time merging this rank's iterations, cumulative."""
        self._worker = BackgroundWorker(
            "diffckpt-keeper-hand-over", self._hand_over, drop=self._drop, on_error=self._failed
        )

    def slot_buffer(self, slot: int, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A snapshot slot's buffer in shared memory (``BucketSnapshotter(buffer=...)``)."""
        tensor = self.arena.empty((numel,), dtype)
        while len(self._slot_specs) <= slot:
            self._slot_specs.append({})
        self._slot_specs[slot][key] = self.arena.spec(tensor)
        return tensor

    def attach(self, snapshotter: BucketSnapshotter) -> None:
        self.snapshotter = snapshotter

    # ----------------------------------------------------------------- training thread
    def anchor(self, torch_optimizers: list[torch.optim.Optimizer | None], iteration: int) -> None:
        """Make the keeper's replica equal to ``torch_optimizers`` after ``iteration`` (a new
        copy in shared memory, or, after a recovery from the keeper, the replica it came from)."""
        self.wait_idle()
        request: dict[str, Any] = {"op": "replica_open", "iteration": iteration}
        if self.resumed is not None and self.resumed[0] == iteration:
            description = self.resumed[1]
            optimizers, request["reuse"] = build(description), True
        else:
            optimizers = [
                None if o is None else _replica_of(o, self.arena.copy, prefix=f"o{i}.")
                for i, o in enumerate(torch_optimizers)
            ]
            for opt in optimizers:
                if opt is not None:
                    initial_adam_state(opt, self.arena.copy)
            description = describe(optimizers, self.arena.spec)
        self.resumed = None
        request["optimizers"] = description
        request["layout"] = [
            [[[w.bucket, w.start, w.end] for w in group] for group in inner]
            for inner in self.layout
        ]
        request["slots"] = self._slot_specs
        self._call(request)
        self.optimizers = optimizers
        self.arena.specs.clear()  # the keeper owns the files now
        with self._cond:
            self._merged = iteration
            self._cond.notify_all()

    def submit(self, job: MergeJob) -> None:
        self._raise_background_error()
        self._worker.put(job)

    @property
    def merged_iteration(self) -> int:
        return self._merged

    def wait_merged(self, iteration: int) -> float:
        """Block until the keeper's replica holds ``iteration``; the seconds waited."""
        start = time.perf_counter()
        self.wait_idle()
        if self._merged < iteration:
            self._released(self._call({"op": "replica_flush", "through": iteration}))
        return time.perf_counter() - start

    def wait_idle(self) -> None:
        self._worker.join()
        self._raise_background_error()

    def close(self) -> None:
        """Hand over what is queued, then drop the replica (the job ended: its final base is
        the training loop's)."""
        self._worker.stop()
        self._raise_background_error()
        self.client.call({"op": "replica_close"})

    # ----------------------------------------------------------------- hand-over thread
    def _hand_over(self, job: MergeJob) -> None:
        if job.slot is not None:
            job.slot.wait_ready()
            self._held[job.slot.index] = job.slot
        rng = job.rng if job.rng is not None else ({}, {})
        scalars = {"scheduler_steps": job.scheduler_steps, "consumed_samples": job.consumed_samples}
        record = encode_record(DiffRecord(job.iteration, {**scalars, **rng[0]}, dict(rng[1])))
        request = {
            "op": "replica_merge",
            "iteration": job.iteration,
            "slot": None if job.slot is None else job.slot.index,
            "filled": sorted(job.slot.filled) if job.slot is not None else [],
            "groups": job.inputs.groups,
            "clip": {str(k): v for k, v in job.inputs.clip_coeffs.items()},
        }
        self._released(self._call(request, record))
        self.client.held_iteration = job.iteration

    def _released(self, reply: dict[str, Any]) -> None:
        for index in reply["released"]:
            self.snapshotter.release(self._held.pop(index))
        self.merge_seconds += reply["merge_s"]
        for activity, total in reply["cpu"].items():  # the keeper's merge CPU, as in-process
            self.cpu.add(activity, total - self._cpu_seen.get(activity, 0.0))
        self._cpu_seen = dict(reply["cpu"])
        with self._cond:
            self._merged = max(self._merged, int(reply["merged"]))
            self._cond.notify_all()

    def _call(self, request: dict[str, Any], payload: bytes = b"") -> dict[str, Any]:
        reply = self.client.call(request, payload)
        if reply is None:
            raise RuntimeError(
                f"LowDiff+: the node's keeper, which holds this rank's replica, is gone "
                f"({self.client.lost}); a restart recovers from storage's newest base"
            )
        if "error" in reply[0]:
            message = f"the node's keeper refused LowDiff+'s replica: {reply[0]['error']}"
            if "cap" in reply[0]["error"]:
                raise DiffCkptUsageError(f"{message}; {KEEPER_FLAG_HINT}")
            raise RuntimeError(message)
        return reply[0]

    def _drop(self, job: MergeJob) -> None:
        if job.slot is not None and job.slot.index not in self._held:
            self.snapshotter.release(job.slot)

    def _failed(self, exc: BaseException) -> None:
        logger.error("LowDiff+: handing an iteration to the keeper failed", exc_info=exc)
        with self._cond:
            self._cond.notify_all()

    def _raise_background_error(self) -> None:
        if self._worker.error is not None:
            raise RuntimeError("LowDiff+: the hand-over to the keeper failed") from (
                self._worker.error
            )


# ---------------------------------------------------------------------------------- recovery
def load_replica(
    torch_optimizers: list[torch.optim.Optimizer | None],
    replicas: list[torch.optim.Optimizer | None],
) -> None:
    """Copy ``replicas`` (parameters and state) into the training ``torch_optimizers``, state
    created where a fresh optimizer has none, on its parameter's device."""
    for opt, replica in zip(torch_optimizers, replicas, strict=True):
        if opt is None or replica is None:
            continue
        for g_dst, g_src in zip(opt.param_groups, replica.param_groups, strict=True):
            on_device = bool(g_dst.get("capturable") or g_dst.get("fused"))
            for p_dst, p_src in zip(g_dst["params"], g_src["params"], strict=True):
                p_dst.detach().copy_(p_src)
                state = opt.state[p_dst]
                for k, v in replica.state.get(p_src, {}).items():
                    if not torch.is_tensor(v):
                        state[k] = v
                    elif torch.is_tensor(state.get(k)):
                        state[k].copy_(v)
                    else:
                        device = p_dst.device if (k != "step" or on_device) else "cpu"
                        state[k] = v.to(device, copy=True)


def recover_from_keepers(
    client: Any,
    torch_optimizers: list[torch.optim.Optimizer | None],
    publish: Any,
    rng_tracker: Any,
    all_reduce_min: Any,
) -> tuple[int, DiffRecord, float, list[Any]] | None:
    """Recover this rank from its keeper's replica, when every rank can. All ranks, together.

    ``client`` is this rank's keeper client (``None``: none runs); ``publish()`` makes the
    model's parameters follow the copied main parameters (collective); ``all_reduce_min`` is
    :func:`~megatron_diffckpt.recovery.all_reduce_min`. Returns ``(iteration, its record, the
    seconds it took, the replica's description)``, or ``None`` when some rank's keeper cannot
    reach the iteration every rank reaches (then every rank recovers from storage).
    """
    start = time.perf_counter()
    reply = client.call({"op": "replica_state"}) if client is not None else None
    held = reply[0].get("replica") if reply is not None else None
    low, high = (held["low"], held["high"]) if held else (-1, -1)
    target = all_reduce_min([high])[0]
    can = held is not None and target >= 0 and low <= target <= high
    if not all_reduce_min([int(can)])[0]:
        if target < 0:
            logger.info("recovery: the node keepers hold no replica: recovering from storage")
        else:
            logger.info(
                "recovery: not every rank's keeper reaches iteration %d (this rank's: %s): "
                "recovering from storage",
                target,
                f"{low}-{high}" if held else "none",
            )
        return None
    records = {r.iteration: r for r in iter_records(io.BytesIO(reply[1]))}
    settled = client.call({"op": "replica_settle", "iteration": target})
    if settled is None or "error" in settled[0]:
        raise RuntimeError(f"the node's keeper could not settle at {target}: {settled}")
    replicas = build(held["optimizers"])
    load_replica(torch_optimizers, replicas)
    publish()
    restore_rng([records[target]], rng_tracker)
    return target, records[target], time.perf_counter() - start, held["optimizers"]
