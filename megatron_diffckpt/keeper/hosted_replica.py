"""One replica hosted in the keeper (:class:`HostedReplica`): the rank's optimizer shard in
shared-memory files, stepped with each iteration the rank hands over, one behind; the diff log
written as the iterations come, ahead of their merges (:class:`ReplicaLog`); and its copy for
the next node's keeper (:func:`copy_of`, :func:`feed`). :mod:`~megatron_diffckpt.keeper.replicas`
holds a node's replicas and serves their requests.
"""

from __future__ import annotations

import io
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_diffckpt import blocked_adam, failpoints, merge_threads
from megatron_diffckpt.background import CpuMeter
from megatron_diffckpt.capture import GradShardCapture, record_grads, set_step_inputs
from megatron_diffckpt.keeper.logs import open_log
from megatron_diffckpt.keeper.wire import Parts, Received, span
from megatron_diffckpt.replica_merger import (
    ParamSlice,
    ShardLayout,
    StepInputs,
    step_inputs,
    step_replica,
)
from megatron_diffckpt.shared_replica import (
    build,
    checksum,
    damaged_file,
    files_of,
    nbytes_of,
    specs_of,
    tensor_from,
    tensors_of,
)
from megatron_diffckpt.storage.format import (
    DiffRecord,
    encode_record,
    iter_records,
)

logger = logging.getLogger(__name__)


@dataclass
class _Held:
    """An iteration handed over, not yet merged: its slot stays the keeper's."""

    iteration: int
    slot: int | None
    filled: set[str]
    inputs: StepInputs
    record: bytes
    differential: DiffRecord | None = None
    """LowDiff: the differential itself (the step input), in place of a slot's snapshots."""
    clipped: bool = False
    """The diff log read the slot first and multiplied its fp32 gradients by the clipping
    coefficients in place (as megatron does): the merge must not scale them again."""


class ReplicaLog:
    """The diff log of one rank whose replica this keeper holds, written by the keeper.

    Every iteration the rank hands over becomes a record as the keeper receives it, ahead of
    its merge, as the in-process merger's log thread
    (:class:`~megatron_diffckpt.replica_merger.ReplicaMerger` with a writer) makes it: the
    step input the merge will consume (each main parameter's gradient, clipped, and every
    group's learning rate and weight decay) with the counters and RNG states the rank handed
    over; a :class:`~megatron_diffckpt.storage.writer.DiffLogWriter` in this process writes it
    to the rank's folder of the diff log. So a job that loses everything (ranks and keepers)
    recovers from storage to the newest iteration every rank's keeper wrote, not to the newest
    base; and the rank's process does no diff-log work at all.

    A chain that does not continue this writer's (a new one: a fresh start, a recovery from
    storage, a replica adopted from a peer) starts with nothing after its first iteration left
    in storage's log (an older attempt's records there are cut off) and a writer of its own,
    which takes the rank's folder over (:data:`~megatron_diffckpt.storage.writer.OWNER_FILE`).
    Before a rank cuts its log itself (a recovery from storage), it asks for
    :meth:`flush`: nothing is written after it until the rank opens its replica again.

    ``spec`` (from the rank's ``replica_open``): :func:`~megatron_diffckpt.keeper.logs.open_log`'s,
    with ``durable`` set for a replica recovered from a peer (storage's chain may end before it).
    """

    def __init__(self, spec: dict[str, Any], iteration: int, identity: dict[str, Any]):
        # serialised at append, before the slot the gradients lie in is given back: not copied
        self.writer = open_log(spec, iteration, identity, serialise_at_append=True)
        self.capture = GradShardCapture(copy=False)

    def continues(self, iteration: int) -> bool:
        """Whether a replica at ``iteration`` continues this log's chain."""
        return self.writer.next_iteration == iteration + 1

    def append(self, iteration: int, handed: bytes) -> None:
        """Write ``iteration``: the step input :attr:`capture` saw (none for a skipped step)
        and ``handed``, the rank's record of its counters and RNG states."""
        counters = next(iter_records(io.BytesIO(handed)), None)
        if counters is None or counters.iteration != iteration:
            raise ValueError(f"iteration {iteration} was handed over without its counters")
        scalars = dict(counters.scalars)
        steps, consumed = scalars.pop("scheduler_steps"), scalars.pop("consumed_samples")
        record: DiffRecord = self.capture.build_record(
            iteration, steps, consumed, (scalars, counters.tensors)
        )
        self.writer.append(record)

    def flush(self) -> int:
        """Write everything appended; the newest durable iteration."""
        return self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class HostedReplica:
    """One rank's replica in the keeper, one iteration behind what the rank handed over."""

    def __init__(
        self,
        request: dict[str, Any],
        record: bytes,
        previous: HostedReplica | None,
        tensor_of: Callable[[dict], torch.Tensor] = tensor_from,
    ):
        reuse = request.get("reuse", False)
        if reuse and (previous is None or previous.merged != request["iteration"]):
            raise ValueError("nothing to reuse: the keeper's replica is not at that iteration")
        self.description = request["optimizers"]
        self.optimizers = previous.optimizers if reuse else build(self.description, tensor_of)
        self.raw_layout = request["layout"]
        self.layout: ShardLayout = [
            [[ParamSlice(*where) for where in group] for group in inner]
            for inner in self.raw_layout
        ]
        self.slot_specs = request["slots"]
        self.slots = [{k: tensor_of(s) for k, s in slot.items()} for slot in self.slot_specs]
        self.tier = "the node's keeper"
        """Where a recovery says the replica came from (a peer's copy, when adopted)."""
        self.files = files_of(self.description, self.slot_specs)
        self.nbytes = nbytes_of(self.description, self.slot_specs)
        self.merged = int(request["iteration"])
        self.record = record  # the counters and RNG states at ``merged`` (b"": none)
        self.held: _Held | None = None
        self.logged_only: int | None = None
        """The newest iteration written to the diff log unmerged (:meth:`log_only`); ``None``:
        every iteration handed over is merged."""
        self.rng: dict[str, torch.Tensor] | None = None
        """LowDiff's replica (stepped with differentials): every generator's newest state (a
        differential holds only those that moved), from the base's on; ``None``: LowDiff+'s."""
        self.residuals: dict[str, Any] | None = None
        """LowDiff's replica: the specs of its base's error-feedback residuals (its slot 0)."""
        if request.get("lowdiff"):  # stepped with differentials: its record holds every RNG
            self.rng = _rng_of(next(iter_records(io.BytesIO(record))))
            self.residuals = self.slot_specs[0] if self.slot_specs else {}
        self.log: ReplicaLog | None = None
        """Where merged iterations are written to storage (set by the keeper on open; a ring
        copy has none)."""
        self.cpu = CpuMeter()
        self.lock = threading.Lock()
        self.sums: list[int] = []
        """The checksum of each of its tensors (in :meth:`sealed_specs` order) as its last step
        left them: a recovery checks the files against them before loading them (a replica
        damaged in memory is never loaded)."""
        self._seal()

    def sealed_specs(self) -> list[dict[str, Any]]:
        """The specs :attr:`sums` covers: parameters and optimizer states, and LowDiff's
        error-feedback residuals (not LowDiff+'s snapshot slots: input, not state)."""
        return list(specs_of(self.description, [self.residuals] if self.residuals else []))

    def damaged(self) -> str:
        """The first file of the replica whose bytes no longer have the checksum its last step
        left (``""``: none): damage since then, in memory."""
        specs = [{**spec, "sum": s} for spec, s in zip(self.sealed_specs(), self.sums, strict=True)]
        with self.cpu.measure("checksum"):
            return damaged_file(specs)

    def _seal(self) -> None:
        with self.cpu.measure("checksum"):
            tensors = list(tensors_of(self.description, self.optimizers))
            if self.residuals:
                tensors += [self.slots[0][k] for k in self.residuals]
            self.sums = [checksum(t) for t in tensors]

    def take(self, request: dict[str, Any], record: bytes) -> list[int]:
        """Hold the iteration ``request`` hands over and write it to the diff log, then merge
        the one held before; the slots given back."""
        if self.logged_only is not None:
            raise ValueError(
                f"handed iteration {request['iteration']} to merge after logging "
                f"{self.logged_only} only: the replica must be opened again first"
            )
        held = self._handed(request, record)
        if self.log is not None:
            self._log(held)
        released = self._merge_held()
        self.held = held
        return released

    def log_only(self, request: dict[str, Any], record: bytes) -> list[int]:
        """Write the iteration ``request`` hands over to the diff log and give its slot back at
        once, unmerged: the rank's merges are skipped until its next base (training would
        otherwise wait for them past ``max_merge_wait_ms``), which opens the replica again. The
        input held is dropped (it is in the log already), and from now on the replica offers
        no iteration to a recovery (storage's base and log reach further) nor takes any to
        merge. The slots given back."""
        if self.log is None:
            raise ValueError("an iteration handed over to be logged only: no diff log is open")
        held = self._handed(request, record)
        self._log(held)
        released = [s for s in (self.held.slot if self.held else None, held.slot) if s is not None]
        self.held, self.logged_only = None, held.iteration
        return released

    def _handed(self, request: dict[str, Any], record: bytes) -> _Held:
        """The iteration ``request`` hands over, checked to be the next one."""
        iteration = int(request["iteration"])
        newest = self.held.iteration if self.held else self.merged
        expected = (self.logged_only if self.logged_only is not None else newest) + 1
        if iteration != expected:
            raise ValueError(f"handed iteration {iteration}, expected {expected}")
        inputs = StepInputs(
            {k: list(v) for k, v in request["groups"].items()},
            {int(k): float(v) for k, v in request["clip"].items()},
        )
        return _Held(iteration, request["slot"], set(request["filled"]), inputs, record)

    @torch.no_grad()
    def _log(self, held: _Held) -> None:
        """Write ``held`` to the diff log, its step input rebuilt from its slot (the fp32
        gradients clipped in place: its merge then steps with them as they are)."""
        log = self.log
        with self.cpu.measure("diff log record"):
            if not held.inputs.skipped:
                if held.slot is None:
                    raise ValueError(f"iteration {held.iteration} handed over without snapshots")
                for i, grads in step_inputs(
                    self.optimizers, self.layout, self.slots[held.slot], held.filled,
                    held.inputs, held.iteration,
                ):  # fmt: skip
                    log.capture.on_grads(i, held.inputs.groups, grads)
                held.clipped = True
            log.append(held.iteration, held.record)

    def take_differential(self, payload: bytes) -> None:
        """LowDiff: hold the differential ``payload`` (one encoded record, the step input
        itself), after merging the one held before. Its record for a recovery carries every
        generator's state (the ones it left out have not moved since the replica's last)."""
        differential = next(iter_records(io.BytesIO(payload)))
        expected = (self.held.iteration if self.held else self.merged) + 1
        if self.rng is None or differential.iteration != expected:
            raise ValueError(f"handed iteration {differential.iteration}, expected {expected}")
        self._merge_held()
        rng = {**self.rng, **_rng_of(differential)}
        full = encode_record(DiffRecord(differential.iteration, differential.scalars, rng))
        self.held = _Held(differential.iteration, None, set(), StepInputs(), full, differential)

    def flush(self, through: int) -> list[int]:
        """Merge the held iteration if it is at most ``through``; the slots given back."""
        if self.held is not None and self.held.iteration <= through:
            return self._merge_held()
        return []

    def offer(self) -> tuple[int, int]:
        """``(low, high)``: the iterations this replica can be recovered to (``-1, -1``: none).
        ``merged`` counts only with its counters and RNG states (a replica anchored from a base
        has none: storage serves that iteration); none while it logs only
        (:meth:`log_only`)."""
        if self.logged_only is not None:
            return -1, -1
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
        with merge_threads.merging():  # within the keeper's thread budget
            return self._merge_held_now()

    def _merge_held_now(self) -> list[int]:
        held, self.held = self.held, None
        if held is None:
            return []
        if held.differential is not None:
            self._step_differential(held.differential)
            self.merged, self.record = held.iteration, held.record
            self._seal()
            return []
        if not held.inputs.skipped:
            if held.slot is None:
                raise ValueError(f"iteration {held.iteration} stepped without snapshots")
            failpoints.delay("keeper-merge")
            step_replica(
                self.optimizers, self.layout, self.slots[held.slot], held.filled, held.inputs,
                held.iteration, self.cpu, clipped=held.clipped,
            )  # fmt: skip
        self.merged, self.record = held.iteration, held.record
        self._seal()
        return [] if held.slot is None else [held.slot]

    @torch.no_grad()
    def _step_differential(self, differential: DiffRecord) -> None:
        """The optimizer step a recovery's replay of ``differential`` runs, on the replica."""
        with self.cpu.measure("merge step"):
            if not differential.scalars["skipped"]:
                grads = record_grads(differential)
                for i, opt in enumerate(self.optimizers):
                    if opt is None:
                        continue
                    set_step_inputs(i, opt, differential, grads)
                    blocked_adam.step(opt)
                    for group in opt.param_groups:
                        for p in group["params"]:
                            p.grad = None
        self.rng.update(_rng_of(differential))

    def cpu_totals(self) -> dict[str, float]:
        """CPU seconds by activity, the log's writer thread as ``"diff log write"``."""
        totals = self.cpu.totals()
        if self.log is not None:
            totals["diff log write"] = self.log.writer.stats.cpu_seconds
        return totals


def _rng_of(record: DiffRecord) -> dict[str, torch.Tensor]:
    return {k: v for k, v in record.tensors.items() if k.startswith("rng.")}


def payload_slice(payload: bytearray | Received, where: list[int]) -> bytes:
    return bytes(span(payload, where[0], where[1]))


def copy_bytes(replica: HostedReplica) -> int:
    """The bytes of the files :func:`copy_of` makes of ``replica``."""
    held = replica.held
    filled = held.filled if held is not None and held.slot is not None else ()
    residuals = replica.slots[0].values() if replica.rng is not None and replica.slots else ()
    return (
        nbytes_of(replica.description, [])
        + sum(t.nbytes for t in residuals)
        + sum(replica.slots[held.slot][k].nbytes for k in filled)
    )


def copy_of(replica: HostedReplica, parts: Parts) -> dict[str, Any]:
    """``replica`` appended to ``parts`` for another keeper (its tensors copied as they are
    now: it steps on), what ``replica_copy_open`` takes (with its held iteration, if any, as a
    ``replica_copy_merge`` would bring it); the header."""
    tensors = list(tensors_of(replica.description, replica.optimizers))
    description = parts.packed(replica.description, tensors)
    record = parts.add(replica.record)
    if replica.rng is not None:  # LowDiff's: its residuals' contents and its held differential
        residuals = {k: parts.copy(replica.slots[0][k]) for k in replica.residuals or {}}
        header = {
            "iteration": replica.merged,
            "layout": [],
            "optimizers": description,
            "slots": [residuals] if residuals else [],
            "record": record,
            "lowdiff": True,
            "held": None,
        }
        if replica.held is not None:
            header["held_differential"] = parts.add(encode_record(replica.held.differential))
        return header
    buckets = {
        k: {"shape": s["shape"], "dtype": s["dtype"]} for k, s in replica.slot_specs[0].items()
    }
    header = {
        "iteration": replica.merged,
        "layout": replica.raw_layout,
        "optimizers": description,
        "slots": [buckets, dict(buckets)],  # two: the held iteration's and the next one's
        "record": record,
        "held": None,
    }
    held = replica.held
    if held is not None:
        spans = []
        for k in sorted(held.filled) if held.slot is not None else []:
            tensor = replica.slots[held.slot][k]
            spans.append([k, parts.copy(tensor)["offset"], tensor.nbytes])
        header["held"] = {
            "iteration": held.iteration,
            "filled": sorted(held.filled),
            "groups": held.inputs.groups,
            "clip": {str(k): v for k, v in held.inputs.clip_coeffs.items()},
            "buckets": spans,
            "has_slot": held.slot is not None,
            "clipped": held.clipped,
            "record": parts.add(held.record),
        }
    return header


def feed(replica: HostedReplica, held: dict[str, Any], payload: bytearray | Received) -> None:
    """Hand ``replica`` (a copy: two slots of its own) the iteration ``held`` describes: its
    snapshot into the slot of the iteration's parity (clipped in place already where the
    sender's diff log read it first: ``clipped``), then :meth:`HostedReplica.take`."""
    slot = held["iteration"] % 2 if held["has_slot"] else None
    for k, offset, n in held["buckets"]:
        target = replica.slots[slot][k].view(-1).view(torch.uint8)
        target[:n].copy_(torch.frombuffer(span(payload, offset, n), dtype=torch.uint8))
    replica.take({**held, "slot": slot}, payload_slice(payload, held["record"]))
    replica.held.clipped = held.get("clipped", False)  # its snapshot as the sender's slot holds it
