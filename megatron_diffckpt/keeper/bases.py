"""LowDiff's newest base in the node's keeper: a restart that reads no base from storage.

With a keeper (:mod:`~megatron_diffckpt.keeper`), LowDiff's differentials after the newest
published base outlive the ranks, but a restart still loaded that base from storage before
replaying them. Here every base a rank saves is also staged in its keeper's memory:

1. **Stage** (:class:`~megatron_diffckpt.keeper.base_stager.BaseStager`, right after the base's
   save call): the rank copies its error-feedback residuals (top-k exchange; the next backward
   pass changes them) at once, and its optimizer shard (main parameters, Adam moments and steps:
   :func:`~megatron_diffckpt.shared_replica.describe`) on a thread of its own while the next
   iteration's forward and backward passes run (the next optimizer step waits for it), into new
   files of the keeper's shared-memory folder, and hands their description over with the base
   iteration's record (scheduler steps, consumed samples, RNG states: ``base_put``). The
   keeper's reply is the acknowledgement; the files are the keeper's from then on. One copy of
   the shard, every F iterations.
2. **Held** (:class:`KeptBases`, the keeper): per rank its newest base, and the newest at or
   below the base it reported published (while a newer one is being saved, a rank killed before
   staging it still shares the published one with the others): at most two. Their bytes count
   against the keeper's cap; a base that does not fit is refused (the rank says so once and
   recovers from storage's base). A rank's differential of iteration i drops its kept bases at
   or after i: they belong to an attempt that the restart did not recover to.
3. **Recovery** (:func:`~megatron_diffckpt.keeper.base_stager.agree_on_kept_base`, all ranks): B =
   the oldest of the ranks' newest kept bases, used when every rank's keeper holds it, B is at least
   storage's newest base S (newer than S when the training loop has already loaded S) and every
   rank's chain (storage's diff log from S, then the keeper's records) reaches B, so that storage's
   log covers every iteration the job trains past (the records between S and B are written back as
   for any recovery); else every rank loads S from storage as without it. The rank maps the keeper's
   files, copies them into its optimizer and residuals, and replays its chain from B on
   (:meth:`~megatron_diffckpt.manager.DiffCheckpointManager.recover`).

**The ring** (with ``--keeper-peers``): each base a keeper takes is copied, off the
rank's path (a thread of the keeper, after the reply), to the next node's keeper
(``base_copy_put``: its files hard-linked, so a base dropped meanwhile still goes whole, and
streamed from them into the successor's shared memory, never through either keeper's heap:
:mod:`~megatron_diffckpt.keeper.wire`), which holds it under its cap as it holds its own (the
newest, and the newest at or below the base published; dropped by the same records and
publications, which travel the ring too). A node lost whole comes back with an empty keeper:
asked for its ranks' bases, it fetches the successor's copies (``base_copy_fetch``) into files
of its own folder and serves them as its own (``keeper: adopted the base of rank_0_0_1 at iteration
10 from the keeper of node 0 (a peer)``), so its ranks too recover without reading storage's
base, and replay the peer's differentials (:mod:`~megatron_diffckpt.keeper.peers`).

4. **Replica** (``--diffckpt-option keeper_replica``): from each kept base on, the keeper
   also steps a copy of it with every differential the rank hands over, one iteration behind
   (:meth:`~megatron_diffckpt.keeper.replicas.HostedReplicas.roll_from`), so that a restart
   takes the recovered iteration's state from it and replays nothing; this replica does go
   around the ring.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from megatron_diffckpt.background import BackgroundWorker
from megatron_diffckpt.keeper.protocol import Op
from megatron_diffckpt.keeper.wire import Parts, Received, rank_name, span
from megatron_diffckpt.shared_replica import (
    files_of,
    nbytes_of,
    remove_files,
    specs_of,
    tensor_nbytes,
)

logger = logging.getLogger(__name__)


@dataclass
class KeptBase:
    """One rank's base in the keeper: tensors in files of its shared-memory folder."""

    iteration: int
    optimizers: list[Any]
    """:func:`~megatron_diffckpt.shared_replica.describe` of the rank's torch optimizers."""
    residuals: dict[str, dict[str, Any]]
    """Error-feedback residual per bucket: its tensor spec."""
    record: bytes
    """The base iteration's counters and RNG states (one encoded record)."""
    tier: str = "the node's keeper"
    """Where it came from: this keeper's rank, or a peer's copy (adopted)."""
    files: set[str] = field(init=False)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.files = files_of(self.optimizers, self.slots)
        self.nbytes = nbytes_of(self.optimizers, self.slots)

    @property
    def slots(self) -> list[dict[str, dict[str, Any]]]:
        """The residuals' specs, as the slots of the shared_replica helpers."""
        return [self.residuals] if self.residuals else []


class KeptBases:
    """Every rank's kept bases in one keeper (``state``: the
    :class:`~megatron_diffckpt.keeper.server.KeeperState` whose cap they share; ``folder``: the
    keeper's shared-memory folder). Thread-safe."""

    def __init__(self, state: Any, folder: str, link: Any = None):
        self.state = state
        self.folder = folder
        self.link = link
        """The ring (:class:`~megatron_diffckpt.keeper.peers.PeerLink`), or ``None``."""
        self._bases: dict[tuple, list[KeptBase]] = {}
        self._copies: dict[tuple, list[KeptBase]] = {}
        """The previous node's ranks' bases."""
        self._published: dict[tuple, int] = {}
        self._lock = threading.Lock()
        self._sender = (
            BackgroundWorker("keeper-base-copy", self._send_copy) if link is not None else None
        )

    def handle(self, op: str, key: tuple, req: dict, payload: bytearray) -> tuple[dict, bytes]:
        """One ``base_*`` request; the reply (errors are replies)."""
        try:
            if op == Op.BASE_PUT:
                base = KeptBase(
                    int(req["iteration"]), req["optimizers"], req["residuals"], bytes(payload)
                )
                reply = self._hold(self._bases, key, base)
                if reply.get("ok") and self._sender is not None:  # the ring's copy, off the reply
                    self._sender.put((key, base.iteration))
                return reply, b""
            if op == Op.BASE_STATE:
                with self._lock:
                    held = list(self._bases.get(key, []))
                if not held and self.link is not None:  # the rank was elsewhere: a copy of them
                    held = self._adopt_own_copies(key) or self._adopt(key)
                rows = [
                    {"iteration": b.iteration, "optimizers": b.optimizers,
                     "residuals": b.residuals, "record": len(b.record), "tier": b.tier}
                    for b in held
                ]  # fmt: skip
                return {"bases": rows}, b"".join(b.record for b in held)
            return {"error": f"unknown request {op!r}"}, b""
        except (ValueError, KeyError, TypeError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}, b""

    def copy(self, op: str, key: tuple, req: dict, payload: bytearray) -> tuple[dict, bytes]:
        """A ``base_copy_*`` request of the previous node's keeper: ``put`` (one of its ranks'
        bases, held as a copy), ``fetch`` (the copies of one rank, for its fresh keeper)."""
        try:
            if op == Op.BASE_COPY_PUT:
                with self._lock:  # the rank runs on the previous node now: its bases are there
                    self._replace(self._bases, key, [], self._bases.get(key, []))
                base = _received(req, payload, "a peer's copy")
                return self._hold(self._copies, key, base, payload), b""
            if op == Op.BASE_COPY_FETCH:
                parts = Parts(self.folder)
                try:
                    with self._lock:  # linked while held: a base dropped now stays whole
                        # this keeper's own, when the rank runs on the previous node now
                        held = self._copies.get(key) or self._bases.get(key, [])
                        headers = [pack(b, parts) for b in held]
                        published = self._published.get(key, -1)
                except BaseException:
                    parts.release()
                    raise
                return {"bases": headers, "published": published}, parts
            return {"error": f"unknown request {op!r}"}, b""
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}, b""

    def _hold(
        self,
        table: dict[tuple, list[KeptBase]],
        key: tuple,
        base: KeptBase,
        received: Received | None = None,
    ) -> dict:
        """Hold ``base`` for the rank ``key`` in ``table`` (its own bases or the copies), within
        the cap: ``{"ok": True, "held": [...]}``, or the error (``base``'s files removed). A
        base ``received`` from a peer takes its files (:meth:`Received.claim`) when held."""
        with self._lock:
            others = {f for b in table.get(key, []) for f in b.files}
            why = _refused(base, self.folder, others)
            if why:
                self._remove_files(base.files - others)  # never another base's
                raise ValueError(why)
            held = [b for b in table.get(key, []) if b.iteration != base.iteration]
            dropped = [b for b in table.get(key, []) if b.iteration == base.iteration]
            kept, pruned = _prune([*held, base], self._published.get(key, -1))
            released = sum(b.nbytes for b in (*dropped, *pruned))
            room = self.state.reserve(base.nbytes, released)
            if not room[0]:
                self._remove_files(base.files)
                return {"error": room[1].replace("a replica", "a base")}
            table[key] = kept
            if received is not None:
                received.claim(base.files)
            for b in (*dropped, *pruned):
                self._remove_files(b.files)
        return {"ok": True, "held": [b.iteration for b in kept]}

    def _send_copy(self, item: tuple[tuple, int]) -> None:
        """The keeper's copy thread: the base ``item`` names, to the successor (unless a newer
        one replaced it meanwhile: its files may be gone)."""
        key, iteration = item
        base = self.get(key, iteration)
        if base is None:
            return

        def make(parts: Parts) -> dict | None:
            try:
                return {"op": Op.BASE_COPY_PUT, "identity": dict(key), **pack(base, parts)}
            except OSError:  # dropped before it was linked: a newer base follows
                return None

        self.link.forward_files(self.folder, base.nbytes, make)

    def _adopt_own_copies(self, key: tuple) -> list[KeptBase]:
        """This keeper's copies of the rank ``key``'s bases, held as its own: the rank ran on
        the previous node (torchrun's rendezvous seated the nodes in another order)."""
        tier = f"the node's keeper (its copy of node {self.link.predecessor}'s)"
        with self._lock:
            copies = self._copies.pop(key, [])
            if copies:
                self._bases[key] = copies  # the same bytes against the cap
            for base in copies:
                base.tier = tier
        for base in copies:
            logger.info(
                "keeper: adopted the base of %s at iteration %d from %s",
                rank_name(key),
                base.iteration,
                tier,
            )
        return list(copies)

    def _adopt(self, key: tuple) -> list[KeptBase]:
        """The successor's copies of the rank ``key``'s bases (or its own: the rank ran there),
        held as this keeper's own (this keeper is new: its node was lost whole, or the rank
        moved); none when it has none."""
        reply = self.link.ask({"op": Op.BASE_COPY_FETCH, "identity": dict(key)}, into=self.folder)
        if reply is None:
            return []
        try:
            if reply[0].get("bases"):  # none held there, or an error
                self._adopt_from(key, *reply)
        finally:
            reply[1].release()  # the files of a copy not held
        with self._lock:
            return list(self._bases.get(key, []))

    def _adopt_from(self, key: tuple, reply: dict, payload: Received) -> None:
        tier = f"the keeper of node {self.link.successor} (a peer)"
        with self._lock:  # what was published before this keeper started: kept as there
            self._published[key] = max(self._published.get(key, -1), reply["published"])
        for header in reply["bases"]:
            try:
                base = _received(header, payload, tier)
            except (ValueError, KeyError) as exc:
                logger.warning("keeper: the peer's copy of a base is unusable: %s", exc)
                continue
            held = self._hold(self._bases, key, base, payload)
            if held.get("ok"):
                logger.info(
                    "keeper: adopted the base of %s at iteration %d from %s",
                    rank_name(key),
                    base.iteration,
                    tier,
                )
            else:
                logger.warning("keeper: the peer's copy does not fit here: %s", held["error"])

    def get(self, key: tuple, iteration: int) -> KeptBase | None:
        """The rank ``key``'s kept base of ``iteration``, if held."""
        with self._lock:
            return next((b for b in self._bases.get(key, []) if b.iteration == iteration), None)

    def drop_from(self, key: tuple, iteration: int) -> None:
        """The rank ``key`` trains ``iteration`` (again): a kept base at or after it is of an
        attempt that did not recover to it, never to be served."""
        with self._lock:
            for table in (self._bases, self._copies):
                bases = table.get(key, [])
                self._replace(
                    table,
                    key,
                    [b for b in bases if b.iteration < iteration],
                    [b for b in bases if b.iteration >= iteration],
                )

    def published(self, key: tuple, base: int) -> None:
        """``base`` is published for the rank ``key``: drop what is older than both its newest
        kept base and the newest kept at or below ``base``."""
        with self._lock:
            self._published[key] = max(base, self._published.get(key, -1))
            for table in (self._bases, self._copies):
                self._replace(table, key, *_prune(table.get(key, []), self._published[key]))

    def _replace(
        self,
        table: dict[tuple, list[KeptBase]],
        key: tuple,
        kept: list[KeptBase],
        dropped: list[KeptBase],
    ) -> None:
        """The rank ``key`` holds ``kept`` in ``table``: ``dropped``'s bytes and files
        released. With the lock held."""
        if not dropped:
            return
        table[key] = kept
        self.state.reserve(0, sum(b.nbytes for b in dropped))
        for b in dropped:
            self._remove_files(b.files)

    def _remove_files(self, files: set[str]) -> None:
        remove_files(files, self.folder)  # never outside the keeper's own folder

    def close(self) -> None:
        if self._sender is not None:
            self._sender.stop()

    def stats(self) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {**dict(key), "iteration": b.iteration, "bytes": b.nbytes, "copy": copied}
                for copied, table in ((False, self._bases), (True, self._copies))
                for key, bases in table.items()
                for b in bases
            ]


def pack(base: KeptBase, parts: Parts) -> dict[str, Any]:
    """``base`` appended to ``parts`` for another keeper: its files linked (a kept base never
    changes; the copy stays whole while the keeper drops it), then its record. The header."""
    optimizers = parts.packed(base.optimizers)
    residuals = {name: parts.link(spec) for name, spec in base.residuals.items()}
    return {
        "iteration": base.iteration,
        "optimizers": optimizers,
        "residuals": residuals,
        "record": parts.add(base.record),
    }


def _received(header: dict[str, Any], payload: Received, tier: str) -> KeptBase:
    """A base :func:`pack` made, as another keeper received it (its tensors in files of this
    keeper's folder, named in ``header``)."""
    start, n = header["record"]
    record = bytes(span(payload, start, n))
    return KeptBase(
        int(header["iteration"]), header["optimizers"], header["residuals"], record, tier
    )


def _refused(base: KeptBase, folder: str, others: set[str]) -> str:
    """Why the keeper cannot hold ``base`` (``""``: it can): a file outside its ``folder``, one
    of another base it holds (``others``), or one missing or short."""
    outside = [f for f in base.files if os.path.dirname(f) != folder]
    if outside:
        return f"a base's files must be in the keeper's folder, not {outside[0]}"
    if others & base.files:
        return "a base's files are those of a base the keeper holds already"
    missing = missing_file(base)
    return f"a base's file is missing or short: {missing}" if missing else ""


def missing_file(base: KeptBase) -> str:
    """A file of ``base`` that is absent or shorter than its tensor (``""``: none)."""
    for spec in specs_of(base.optimizers, base.slots):
        if "file" not in spec:
            continue
        try:
            if os.path.getsize(spec["file"]) < tensor_nbytes(spec):
                return spec["file"]
        except OSError:
            return spec["file"]
    return ""


def _prune(bases: list[KeptBase], published: int) -> tuple[list[KeptBase], list[KeptBase]]:
    """``(kept, dropped)``: the newest base and the newest at or below ``published`` are kept."""
    if not bases:
        return [], []
    bases = sorted(bases, key=lambda b: b.iteration)
    keep = {bases[-1].iteration}
    below = [b.iteration for b in bases if b.iteration <= published]
    if below:
        keep.add(below[-1])
    return [b for b in bases if b.iteration in keep], [b for b in bases if b.iteration not in keep]


# --------------------------------------------------------------------- the rank's side
