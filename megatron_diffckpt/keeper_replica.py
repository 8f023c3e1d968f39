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
5. **Recovery** (:func:`~megatron_diffckpt.keeper_merger.recover_from_keepers`, all ranks):
   each rank's keeper offers ``M`` and ``M + 1``; the ranks agree on the newest iteration every
   rank can reach (one MIN), the keeper merges or drops its held input, and the rank copies the
   replica into its optimizer: no base is read from storage and nothing is replayed. When some
   rank cannot reach it (its keeper was lost with its node), every rank goes to storage.

Exactness: the keeper runs the same torch optimizer class with the same options on the same
inputs (:func:`~megatron_diffckpt.replica_merger.step_replica`), so on CPU the replica is
bit-identical to the training state, as in-process.

This module is the keeper's side (:class:`HostedReplicas`, one lock per rank);
:mod:`~megatron_diffckpt.keeper_merger` is the rank's, :mod:`~megatron_diffckpt.shared_replica`
what both share.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from megatron_diffckpt.background import CpuMeter
from megatron_diffckpt.replica_merger import ParamSlice, ShardLayout, StepInputs, step_replica
from megatron_diffckpt.shared_replica import build, files_of, map_tensor, nbytes_of

logger = logging.getLogger(__name__)


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
