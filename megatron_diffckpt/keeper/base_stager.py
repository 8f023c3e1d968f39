"""The rank's side of LowDiff's kept bases (:mod:`~megatron_diffckpt.keeper.bases` has the whole
protocol and the keeper's side): each base staged in the keeper's memory after its save
(:class:`BaseStager`), and, at recovery, the bases the keepers offer, the ranks' agreement on
one (:func:`agree_on_kept_base`, all ranks) and its copy into the optimizer
(:func:`load_kept_base`).
"""

from __future__ import annotations

import io
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from megatron_diffckpt import failpoints
from megatron_diffckpt.keeper.bases import KeptBase, missing_file
from megatron_diffckpt.keeper.protocol import Op
from megatron_diffckpt.replica_merger import replica_of
from megatron_diffckpt.shared_replica import (
    SharedArena,
    build,
    damaged_file,
    describe,
    map_tensor,
    remove_files,
    specs_of,
)
from megatron_diffckpt.storage.format import DiffRecord, encode_record, iter_records

logger = logging.getLogger(__name__)


class BaseStager:
    """Stages this rank's bases into its keeper (``client``: its
    :class:`~megatron_diffckpt.keeper.client.KeeperClient`), off the training path where it can.

    :meth:`start` (the training thread, right after a base's save call) copies the
    error-feedback residuals at once (the next backward pass changes them) and the optimizer
    shard on a thread of its own (on GPU on a side stream, after the step that made the
    state), which must end before the next optimizer step changes the shard: :meth:`wait`, from
    the step's hook. Then the keeper's reply is the acknowledgement.
    """

    def __init__(self, client: Any, replica: bool = False):
        self.client = client
        self.replica = replica
        """Ask the keeper to step a replica from each base on (``--diffckpt-option keeper_replica``:
        :meth:`~megatron_diffckpt.keeper.replicas.HostedReplicas.roll_from`)."""
        self._thread: threading.Thread | None = None
        self._result = ""
        self.seconds = 0.0
        """How long the last base's staging took, start to acknowledgement."""
        self._stream: Any = None

    def start(
        self,
        torch_optimizers: list[torch.optim.Optimizer | None],
        residuals: Any,
        record: DiffRecord,
    ) -> None:
        """Begin staging the state at ``record.iteration`` (``residuals``: ``None`` with the
        dense exchange). The training thread, between the base's save and the next step."""
        self.wait()
        started = time.perf_counter()
        arena = SharedArena(self.client.shm_folder(), sealed=True)  # checked when loaded
        tensors = residuals.tensors() if residuals is not None else {}
        try:
            kept_residuals = {k: arena.spec(arena.copy(v)) for k, v in tensors.items()}
        except BaseException:
            _remove(arena)
            raise
        made = None
        if torch.cuda.is_available() and any(
            p.is_cuda for o in torch_optimizers if o is not None for g in o.param_groups
            for p in g["params"]
        ):  # fmt: skip
            self._stream = self._stream or torch.cuda.Stream()
            made = torch.cuda.current_stream().record_event()  # the step that made the state

        def stage() -> None:
            try:
                if made is not None:
                    with torch.cuda.stream(self._stream):
                        self._stream.wait_event(made)
                        self._result = self._stage(arena, torch_optimizers, kept_residuals, record)
                        self._stream.synchronize()
                else:
                    self._result = self._stage(arena, torch_optimizers, kept_residuals, record)
            except Exception as exc:  # the rank trains on; a restart loads storage's base
                _remove(arena)
                self._result = f"{type(exc).__name__}: {exc}"
            self.seconds = time.perf_counter() - started

        self._thread = threading.Thread(target=stage, name="diffckpt-keeper-base", daemon=True)
        self._thread.start()

    def _stage(
        self,
        arena: SharedArena,
        torch_optimizers: list[torch.optim.Optimizer | None],
        residuals: dict[str, dict[str, Any]],
        record: DiffRecord,
    ) -> str:
        optimizers = [
            None if o is None else replica_of(o, arena.copy, prefix=f"o{i}.")
            for i, o in enumerate(torch_optimizers)
        ]
        request = {
            "op": Op.BASE_PUT,
            "iteration": record.iteration,
            "optimizers": describe(optimizers, arena.spec),
            "residuals": residuals,
            "replica": self.replica,
        }
        reply = self.client.call(request, encode_record(record))
        if reply is None:
            _remove(arena)
            return f"the keeper is gone ({self.client.lost})"
        if "error" in reply[0]:
            return reply[0]["error"]  # the keeper removed the files
        arena.specs.clear()  # the keeper's now
        failpoints.reach("base-kept")
        return ""

    def wait(self) -> str:
        """Wait for the base being staged; ``""`` once the keeper holds it (or when none was
        being staged), else why not (said once per base). Any thread but the stager's."""
        if self._thread is None:
            return ""
        self._thread.join()
        self._thread = None
        return self._result


def stage_base(
    client: Any,
    torch_optimizers: list[torch.optim.Optimizer | None],
    residuals: Any,
    record: DiffRecord,
) -> str:
    """Stage the state at ``record.iteration`` into ``client``'s keeper and wait for it:
    :class:`BaseStager` in one call. ``""`` once the keeper holds it, else why not."""
    stager = BaseStager(client)
    stager.start(torch_optimizers, residuals, record)
    return stager.wait()


def _remove(arena: SharedArena) -> None:
    remove_files(arena.files(), arena.folder)
    arena.specs.clear()


@dataclass
class OfferedBases:
    """What a rank's keeper holds for it: base iteration -> (its description, its record)."""

    bases: dict[int, tuple[dict[str, Any], DiffRecord]]

    @property
    def newest(self) -> int:
        return max(self.bases, default=-1)


def offered_bases(client: Any) -> OfferedBases:
    """The bases this rank's keeper holds for it (none without a keeper). Any rank."""
    reply = client.call({"op": Op.BASE_STATE}) if client is not None else None
    if reply is None or "error" in reply[0]:
        return OfferedBases({})
    records = {r.iteration: r for r in iter_records(io.BytesIO(reply[1]))}
    offered = {}
    for row in reply[0]["bases"]:
        base = KeptBase(row["iteration"], row["optimizers"], row["residuals"], b"")
        lost = missing_file(base)
        if lost:  # never mapped: mapping a missing file would create it, zeroed
            logger.warning("keeper: the base of iteration %d lost a file (%s)", row["iteration"],
                           lost)  # fmt: skip
            continue
        damaged = damaged_file(specs_of(base.optimizers, base.slots))
        if damaged:  # a copy damaged in memory is never loaded: the next tier serves
            logger.warning(
                "keeper: the base of iteration %d in %s is damaged (%s does not have the "
                "checksum it was made with): not used",
                row["iteration"],
                row.get("tier", "the node's keeper"),
                damaged,
            )
        elif row["iteration"] in records:
            offered[row["iteration"]] = (row, records[row["iteration"]])
    return OfferedBases(offered)


def agree_on_kept_base(
    offered: OfferedBases, storage_base: int, chain_end: int, newer: bool, all_reduce_min: Any
) -> tuple[int, int] | None:
    """``(B, T)``: the base every rank recovers from its keeper (see the module doc) and the
    iteration every rank's chain reaches; ``None``: storage's base. ``chain_end``: the last
    iteration this rank's chain reaches from ``storage_base``; ``newer``: the training loop
    loaded ``storage_base`` already (a kept base must be newer). All ranks, collectively (two
    all-reduces)."""
    base, reach = all_reduce_min([offered.newest, chain_end])
    usable = (
        base in offered.bases
        and (base > storage_base if newer else base >= storage_base)
        and reach >= base
    )
    return (base, reach) if all_reduce_min([int(usable)])[0] else None


def load_kept_base(
    row: dict[str, Any],
    torch_optimizers: list[torch.optim.Optimizer | None],
    residuals: Any,
) -> None:
    """Copy the kept base ``row`` describes into the training ``torch_optimizers`` and the
    error-feedback ``residuals`` (``None``: dense exchange). Any rank."""
    from megatron_diffckpt.keeper.replica_client import load_replica

    load_replica(torch_optimizers, build(row["optimizers"]))
    if residuals is not None:
        residuals.load_state_dict({k: map_tensor(s) for k, s in row["residuals"].items()})
