"""LowDiff+'s replica in the node's keeper: the merger runs there, fed through shared memory.

In-process, LowDiff+'s host replica dies with its rank, and what makes an iteration recoverable
after the newest base is the dense diff log (every iteration's gradient shard, written to
storage). With ``--diffckpt-option keeper_replica`` under a node launcher that runs a keeper, the
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
   at most one iteration apart (each iteration's first gradient reduction waits, before it is
   issued, for the rank's hand-over of the previous iteration:
   :meth:`~megatron_diffckpt.keeper.replica_client.KeeperReplicaMerger.attach`), so every rank can
   reach the newest iteration all of them handed over.
4. **Bases.** At a base the rank asks for everything up to its iteration to be merged, and reads
   the replica through its own mapping of the pages (the keeper is idle then: nothing later was
   handed over); the persist path is LowDiff+'s own.
5. **Recovery** (:func:`~megatron_diffckpt.keeper.replica_client.recover_from_keepers`, all ranks):
   each rank's keeper offers ``M`` and ``M + 1``; the ranks agree on the newest iteration every
   rank can reach (one MIN), the keeper merges or drops its held input, and the rank copies the
   replica into its optimizer: no base is read from storage and nothing is replayed. When some
   rank cannot reach it (its keeper was lost with its node), every rank goes to storage.

Exactness: the keeper runs the same torch optimizer class with the same options on the same
inputs (:func:`~megatron_diffckpt.replica_merger.step_replica`), so on CPU the replica is
bit-identical to the training state, as in-process.

The diff log: the keeper also writes the rank's dense diff log from what the rank hands over,
as it comes, ahead of the merge (:class:`ReplicaLog`), so that storage holds every iteration too.

LowDiff (``--diffckpt-option keeper_replica``) reuses the same replica and recovery: from each base
the keeper holds (:mod:`~megatron_diffckpt.keeper.bases`), a replica stepped with the rank's
differentials themselves (:meth:`HostedReplica.take_differential`), one behind, on one worker
thread, and copied around the ring the same way (``replica_copy_step``).

This module is the keeper's side (:class:`HostedReplicas`, one lock per rank);
:mod:`~megatron_diffckpt.keeper.replica_client` is the rank's,
:mod:`~megatron_diffckpt.shared_replica` what both share.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Any

import torch

from megatron_diffckpt.background import BackgroundWorker
from megatron_diffckpt.errors import DiffCkptError
from megatron_diffckpt.keeper.bases import missing_file
from megatron_diffckpt.keeper.hosted_replica import (
    HostedReplica,
    ReplicaLog,
    copy_bytes,
    copy_of,
    feed,
    payload_slice,
)
from megatron_diffckpt.keeper.protocol import Op
from megatron_diffckpt.keeper.wire import Parts, Received, rank_name
from megatron_diffckpt.replica_merger import (
    replica_of,
)
from megatron_diffckpt.shared_replica import (
    SharedArena,
    build,
    create_tensor,
    describe,
    initial_adam_state,
    map_tensor,
    remove_files,
)

logger = logging.getLogger(__name__)


class HostedReplicas:
    """Every rank's :class:`HostedReplica` of one keeper, and in a ring (``link``: the keeper's
    :class:`~megatron_diffckpt.keeper.peers.PeerLink`) the copies it holds of the previous
    node's ranks' replicas; bytes reserved against the keeper's cap.

    The copy (what a node lost whole recovers from): each replica a rank opens goes to the next
    node's keeper whole, and every iteration handed over after it as its snapshot (the filled
    buckets of the dense gradient shard) and step scalars, asynchronously; that keeper steps a
    replica of its own, one behind as here. A fresh keeper asked for a replica it does not hold
    adopts its successor's copy into its shared-memory folder and serves it as its own.

    A rank may also come back on another node: torchrun's rendezvous seats the nodes in the
    order of their addresses (then of their agents' process ids), not by ``--node-rank``, so a
    node that comes back can take node 0's ranks, its old ones going to node 0. A keeper asked
    for a rank it holds a copy of (the rank ran on the previous node) serves that copy as its
    own; one asked by its predecessor for a rank it holds the replica of (the rank runs there
    now) hands that replica over, its diff log written out first, and lets it go; so does one
    whose predecessor opens a copy of a rank whose replica it holds.
    """

    def __init__(self, state: Any, folder: str, link: Any = None):
        self.state = state  # the KeeperState whose cap the replicas share
        self.folder = folder
        self.link = link
        self._replicas: dict[tuple, HostedReplica] = {}
        self._copies: dict[tuple, HostedReplica] = {}
        self._lock = threading.RLock()  # a refused copy is dropped while it is held
        self._logs: dict[tuple, ReplicaLog] = {}
        """The diff logs this keeper writes, by rank: a log outlives the replica objects of its
        chain (a rank's restart from this keeper's replica continues it)."""
        self._rolling = BackgroundWorker("keeper-lowdiff-replicas", self._rolled, maxsize=4)
        """LowDiff's replicas are made and stepped here, in order, at lower CPU priority: the
        rank's hand-over (on its training thread) is answered first."""
        self._rolled_ranks: set[tuple] = set()  # the ranks that asked for LowDiff's replica

    def handle(self, op: str, key: tuple, req: dict, payload: bytearray) -> tuple[dict, bytes]:
        """One ``replica_*`` request (``replica_copy_*``: from the previous node's keeper); the
        reply. Errors are replies (``{"error": ...}``)."""
        try:
            if op.startswith("replica_copy_"):
                return self._copy(op, key, req, payload)
            if op == Op.REPLICA_OPEN:
                return self._open(key, req, payload), b""
            if op == Op.REPLICA_CLOSE:
                self._drop(self._replicas, key)
                self._forward({"op": Op.REPLICA_COPY_CLOSE, "identity": req["identity"]})
                log = self._logs.pop(key, None)
                if log is not None:
                    log.close()  # the job ended: the rank waits until its log is durable
                return {"ok": True}, b""
            if op == Op.REPLICA_LOG_FLUSH:
                return {"durable": self._flush_log(key)}, b""
            if op == Op.REPLICA_STATE:
                self._rolling.join()  # every differential handed over is in LowDiff's replica
            replica = self._replicas.get(key)
            if replica is None and op == Op.REPLICA_STATE:
                replica = self._adopt(key, req["identity"])
                if replica is None:
                    return {"replica": None}, b""
            if replica is None:
                return {"error": "the keeper holds no replica of this rank"}, b""
            with replica.lock:
                return self._serve(op, replica, req, payload)
        except (ValueError, KeyError, OSError, RuntimeError, DiffCkptError) as exc:
            # the diff log the keeper writes: a full filesystem, another writer of the folder
            return {"error": f"{type(exc).__name__}: {exc}", "kind": type(exc).__name__}, b""

    def _serve(self, op: str, replica: HostedReplica, req: dict, payload: bytearray):
        start = time.perf_counter()
        if op == Op.REPLICA_MERGE:
            record = bytes(payload)
            released = replica.take(req, record)
            self._forward_iteration(req, replica, record)
        elif op == Op.REPLICA_LOG:  # the copy is renewed when the replica is opened again
            released = replica.log_only(req, bytes(payload))
        elif op == Op.REPLICA_FLUSH:
            released = replica.flush(int(req["through"]))
        elif op == Op.REPLICA_SETTLE:
            damaged = replica.damaged()  # before the held iteration's step takes it in
            if damaged:
                return {"damaged": damaged}, b""
            released = replica.settle(int(req["iteration"]))
        elif op == Op.REPLICA_STATE:
            low, high = replica.offer()
            records = replica.record + (replica.held.record if replica.held else b"")
            doc = {"low": low, "high": high, "merged": replica.merged, "tier": replica.tier}
            doc["logged_only"] = replica.logged_only  # paused until the next base: offers none
            doc.update(optimizers=replica.description, residuals=replica.residuals)
            return {"replica": doc}, records
        else:
            return {"error": f"unknown request {op!r}"}, b""
        reply = {
            "released": released,
            "merged": replica.merged,
            "merge_s": time.perf_counter() - start,
            "cpu": replica.cpu_totals(),
            "durable": replica.log.writer.durable_iteration if replica.log else None,
        }
        if op == Op.REPLICA_SETTLE:  # what a recovery checks the files against
            reply["sums"] = replica.sums
        return reply, b""

    def _open(self, key: tuple, req: dict, payload: bytearray) -> dict:
        with self._lock:
            previous = self._replicas.get(key)
            if previous is not None:
                previous.lock.acquire()
            try:
                carried = b""
                if previous is not None and previous.merged == int(req["iteration"]):
                    carried = previous.record
                replica = HostedReplica(req, bytes(payload) or carried, previous)
                refused = self._install(self._replicas, key, replica, previous)
                if refused:
                    return {"error": refused}
                replica.log = self._log_for(key, req, replica.merged)
            finally:
                if previous is not None:
                    previous.lock.release()
        self._forward_copy(key, replica)
        return {"ok": True, "merged": replica.merged}

    # ----------------------------------------------------------------- LowDiff's replica
    def roll_from(self, key: tuple, base: Any) -> None:
        """LowDiff (``--diffckpt-option keeper_replica``): from the kept ``base`` (a
        :class:`~megatron_diffckpt.keeper.bases.KeptBase` just put) on, a replica in files of
        its own (the shard and the base's residuals copied) that every differential the rank
        hands over steps, one behind (:meth:`roll`), in place of the rank's previous one.
        Queued: made on the replicas' thread."""
        self._rolled_ranks.add(key)
        self._rolling.put((self._roll_from, key, base))

    def roll(self, key: tuple, payload: bytes | bytearray) -> None:
        """LowDiff: step the rank's replica with the differential it handed over (``payload``,
        held unchanged), one behind; a differential that does not follow the replica (a
        restart that recovered elsewhere) ends it until the next base. Queued: stepped on the
        replicas' thread, which then sends it on for the next node's copy (after the copy's
        opening, in order: ``replica_copy_step``)."""
        if key in self._rolled_ranks:
            self._rolling.put((self._roll, key, payload))

    def _rolled(self, item: tuple) -> None:
        work, key, arg = item
        try:
            work(key, arg)
        except Exception as exc:  # noqa: BLE001 - the rank recovers from the base instead
            stepping = work != self._roll_from  # a replica that missed a step ends
            logger.warning("keeper: LowDiff's replica of %s %s: %s: %s", rank_name(key),
                           "ends" if stepping else "not made", type(exc).__name__, exc)  # fmt: skip
            if stepping:
                self._drop(self._replicas, key)

    def _roll_from(self, key: tuple, base: Any) -> None:
        lost = missing_file(base)  # dropped meanwhile (a restart): mapping it would make it, zeroed
        if lost:
            raise ValueError(f"the base of iteration {base.iteration} lost a file ({lost})")
        arena = SharedArena(self.folder)
        try:
            optimizers = [
                None if o is None else replica_of(o, arena.copy, prefix=f"o{i}.")
                for i, o in enumerate(build(base.optimizers))
            ]
            for opt in optimizers:
                if opt is not None:
                    initial_adam_state(opt, arena.copy)  # state Adam makes lazily: shared too
            residuals = {
                k: arena.spec(arena.copy(map_tensor(spec))) for k, spec in base.residuals.items()
            }
            request = {
                "iteration": base.iteration,
                "optimizers": describe(optimizers, arena.spec),
                "layout": [],
                "slots": [residuals] if residuals else [],
                "lowdiff": True,
            }
        except (OSError, RuntimeError, ValueError):
            self._remove_files(set(arena.files()))
            raise
        with self._lock:
            previous = self._replicas.get(key)
            if previous is not None:
                previous.lock.acquire()
            try:
                replica = HostedReplica(request, base.record, None)
                refused = self._install(self._replicas, key, replica, previous)
            finally:
                if previous is not None:
                    previous.lock.release()
        if refused:
            logger.warning(
                "keeper: no replica of %s past base %d: %s", rank_name(key), base.iteration, refused
            )
        else:  # the next node's keeper steps a copy (replica_copy_step)
            self._forward_copy(key, replica)

    def _roll(self, key: tuple, payload: bytes | bytearray) -> None:
        replica = self._replicas.get(key)
        if replica is None or replica.rng is None:
            return
        with replica.lock:
            replica.take_differential(payload)
        self._forward({"op": Op.REPLICA_COPY_STEP, "identity": dict(key)}, payload)

    # ----------------------------------------------------------------- the diff log
    def _log_for(self, key: tuple, req: dict, iteration: int) -> ReplicaLog | None:
        """The log a replica opened at ``iteration`` writes to: the rank's current one when the
        chain continues it (a restart from this keeper's replica, a re-anchor at a base), else
        a new one (``None``: the rank asked for none). With ``self._lock`` held."""
        log = self._logs.get(key)
        spec = req.get("log")
        if log is not None and (spec is None or not log.continues(iteration)):
            del self._logs[key]
            log.close()  # its pending records first, then the new chain cuts what follows
            log = None
        if spec is not None and log is None:
            log = self._logs[key] = ReplicaLog(spec, iteration, req["identity"])
        return log

    def _flush_log(self, key: tuple) -> int | None:
        """Write what the rank's log holds and wait (before the rank cuts its log itself);
        the newest durable iteration (``None``: no log)."""
        log = self._logs.get(key)
        return None if log is None else log.flush()

    def published(self, key: tuple, base: int) -> None:
        """A base of ``base`` is published for the rank ``key``: its log's durability counts
        from it."""
        log = self._logs.get(key)
        if log is not None:
            log.writer.rebase(base)

    def close(self) -> None:
        """The keeper stops: write what every log holds (a rank that died leaves the
        iterations it handed over to storage)."""
        with self._lock:
            logs, self._logs = list(self._logs.values()), {}
        for log in logs:
            try:
                log.close()
            except Exception as exc:  # noqa: BLE001 - the others are still written
                logger.warning("keeper: a diff log could not be written at its end: %s", exc)

    # ----------------------------------------------------------------- the ring
    def _forward(self, header: dict, payload: bytes = b"") -> None:
        if self.link is not None:
            self.link.forward(header, payload)

    def _forward_copy(self, key: tuple, replica: HostedReplica) -> None:
        """``replica`` whole (as it is now), for the next node's keeper to hold a copy of."""
        if self.link is None:
            return
        self.link.forward_files(
            self.folder,
            copy_bytes(replica),
            lambda parts: (
                {"op": Op.REPLICA_COPY_OPEN, "identity": dict(key)} | copy_of(replica, parts)
            ),
        )

    def _forward_iteration(self, req: dict, replica: HostedReplica, record: bytes) -> None:
        """The iteration just handed over, for the next node's copy: its scalars, record and
        snapshot (copied now: the slot goes back to the rank once merged)."""
        if self.link is None:
            return
        filled = sorted(req["filled"]) if req["slot"] is not None else []
        tensors = [replica.slots[req["slot"]][k] for k in filled]

        def make(parts: Parts) -> dict:
            header = {k: req[k] for k in ("identity", "iteration", "filled", "groups", "clip")}
            header.update(op=Op.REPLICA_COPY_MERGE, record=parts.add(record))
            header["buckets"] = [
                [k, parts.copy(t)["offset"], t.nbytes] for k, t in zip(filled, tensors, strict=True)
            ]
            header["has_slot"] = req["slot"] is not None
            header["clipped"] = replica.held.clipped  # by the diff log, in the slot
            return header

        self.link.forward_files(self.folder, sum(t.nbytes for t in tensors), make)

    def _copy(self, op: str, key: tuple, req: dict, payload: bytearray) -> tuple[dict, bytes]:
        """A request of the previous node's keeper about its copy of one rank's replica."""
        if op == Op.REPLICA_COPY_OPEN:
            if key in self._replicas:  # the rank runs on the previous node now, anchored there
                self._moved_away(key)
            with self._lock:
                previous = self._copies.get(key)
                copy = HostedReplica(req, payload_slice(payload, req["record"]), None)
                refused = self._install(self._copies, key, copy, previous)
                if refused:  # the previous copy is of an older replica: no use any more
                    self._drop(self._copies, key)
                    return {"error": refused}, b""
                payload.claim(copy.files)
                if req.get("held"):
                    feed(copy, req["held"], payload)
                if req.get("held_differential"):
                    copy.take_differential(payload_slice(payload, req["held_differential"]))
            return {"ok": True}, b""
        if op == Op.REPLICA_COPY_STEP:  # LowDiff: the differential the previous node's stepped
            copy = self._copies.get(key)
            if copy is None or copy.rng is None:
                return {"error": "no copy of this LowDiff replica (until its next base)"}, b""
            with copy.lock:  # in order with the copy's opening, on this connection
                try:
                    copy.take_differential(payload)
                except ValueError:
                    self._drop(self._copies, key)
                    raise
            return {"held": True}, b""
        if op == Op.REPLICA_COPY_CLOSE:
            self._drop(self._copies, key)
            return {"ok": True}, b""
        copy = self._copies.get(key)
        if op == Op.REPLICA_COPY_FETCH:
            moved = copy is None and key in self._replicas  # the rank runs on the previous node
            if moved:
                self._rolling.join()  # LowDiff's: every differential handed over stepped in
                copy = self._replicas.get(key)
                moved = copy is not None
            if copy is None:
                return {"copy": None}, b""
            header, parts = self._taken(copy)  # a recovery's: the copy steps on meanwhile
            if moved:
                self._moved_away(key)
            return {"copy": header}, parts
        if op == Op.REPLICA_COPY_MERGE:
            if copy is None:
                return {"error": "no copy of this rank's replica (a gap: until its next open)"}, b""
            with copy.lock:
                try:
                    feed(copy, req, payload)
                except ValueError:
                    self._drop(self._copies, key)
                    raise
            return {"held": True}, b""
        return {"error": f"unknown request {op!r}"}, b""

    def _adopt(self, key: tuple, identity: dict) -> HostedReplica | None:
        """A replica of ``identity`` as this keeper's own, in files the rank maps: this keeper's
        copy of it (the rank ran on the previous node), else the successor's copy (this keeper
        is new: the node was lost whole) or the successor's replica (the rank ran there);
        ``None``: none of them."""
        if self.link is None:
            return None
        copy = self._copies.get(key)
        if copy is not None:
            header, parts = self._taken(copy)
            try:
                payload = parts.received(header)
            finally:
                parts.release()
            self._drop(self._copies, key)  # its bytes against the cap: the replica's now
            tier = f"the node's keeper (its copy of node {self.link.predecessor}'s replica)"
        else:
            reply = self.link.ask({"op": Op.REPLICA_COPY_FETCH, "identity": identity}, self.folder)
            if reply is None:
                return None
            header, payload = reply[0].get("copy"), reply[1]
            tier = f"the keeper of node {self.link.successor} (a peer)"
        try:
            replica = self._adopt_from(key, header, payload, tier)
        finally:
            payload.release()  # the files of a copy not taken
        if replica is None:
            return None
        logger.info(
            "keeper: adopted the replica of %s at iteration %d%s from %s",
            rank_name(key),
            replica.merged,
            f" (holding the input of {replica.held.iteration})" if replica.held else "",
            replica.tier,
        )
        return replica

    def _taken(self, replica: HostedReplica) -> tuple[dict, Parts]:
        """``replica`` as it is now, for another holder: :func:`copy_of`'s header and payload."""
        parts = Parts(self.folder)
        try:
            with replica.lock:
                return copy_of(replica, parts), parts
        except BaseException:
            parts.release()
            raise

    def _moved_away(self, key: tuple) -> None:
        """The rank ``key`` runs on another node now, whose keeper holds its replica: this
        keeper's goes, the diff log it wrote for the rank written out first (the other keeper's
        writer takes the rank's folder over)."""
        log = self._logs.pop(key, None)
        if log is not None:
            try:
                log.close()
            except Exception as exc:  # noqa: BLE001 - what it held reaches storage from the other
                logger.warning("keeper: the diff log of %s: %s", rank_name(key), exc)
        self._rolled_ranks.discard(key)
        self._drop(self._replicas, key)
        logger.info("keeper: %s runs on another node now: its replica here goes", rank_name(key))

    def _adopt_from(
        self, key: tuple, header: dict | None, payload: Received, tier: str
    ) -> HostedReplica | None:
        if header is None:
            return None
        made: list[str] = []

        def tensor_of(spec: dict) -> torch.Tensor:  # the slots the rank fills: files too
            if "file" not in spec:
                spec["file"] = os.path.join(self.folder, f"adopted-{uuid.uuid4().hex}")
                made.append(spec["file"])
                return create_tensor(spec)
            return map_tensor(spec)

        with self._lock:
            try:
                replica = HostedReplica(
                    header, payload_slice(payload, header["record"]), None, tensor_of
                )
                if header.get("held"):
                    feed(replica, header["held"], payload)
                if header.get("held_differential"):
                    replica.take_differential(payload_slice(payload, header["held_differential"]))
            except BaseException:
                self._remove_files(set(made))
                raise
            if replica.rng is not None:
                self._rolled_ranks.add(key)  # LowDiff's: the rank's differentials step it on
            replica.tier = tier
            refused = self._install(self._replicas, key, replica, None)
            if refused:
                logger.warning("keeper: the peer's copy does not fit here: %s", refused)
                return None
            payload.claim(replica.files)
        return replica

    # ----------------------------------------------------------------- bookkeeping
    def _install(
        self,
        table: dict[tuple, HostedReplica],
        key: tuple,
        replica: HostedReplica,
        previous: HostedReplica | None,
    ) -> str:
        """Put ``replica`` in ``table`` in place of ``previous``, its bytes reserved against the
        cap: ``""``, or why not (then ``replica``'s own files are removed, ``previous`` stays).
        With ``self._lock`` held."""
        room = self.state.reserve(replica.nbytes, previous.nbytes if previous else 0)
        before = previous.files if previous else set()
        if not room[0]:
            self._remove_files(replica.files - before)
            return room[1]
        table[key] = replica
        self._remove_files(before - replica.files)
        return ""

    def _drop(self, table: dict[tuple, HostedReplica], key: tuple) -> None:
        with self._lock:
            replica = table.pop(key, None)
            if replica is not None:
                self.state.reserve(0, replica.nbytes)
                self._remove_files(replica.files)

    def _remove_files(self, files: set[str]) -> None:
        remove_files(files, self.folder)  # never outside the keeper's own folder

    def stats(self) -> dict[str, list[dict[str, Any]]]:
        def rows(table: dict[tuple, HostedReplica]) -> list[dict[str, Any]]:
            return [
                {
                    **dict(key),
                    "merged": r.merged,
                    "held": r.held.iteration if r.held else None,
                    "logged_only": r.logged_only,
                    "bytes": r.nbytes,
                    "durable": r.log.writer.durable_iteration if r.log else None,
                    "system": "LowDiff" if r.rng is not None else "LowDiff+",
                }
                for key, r in table.items()
            ]

        return {"replicas": rows(self._replicas), "copies": rows(self._copies)}
