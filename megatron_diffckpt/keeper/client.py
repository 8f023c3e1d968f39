"""The rank's side of the node's keeper: :class:`KeeperClient`, one connection per rank (or
thread), and :func:`query` / :func:`stop` for any process (the launcher, ``megatron-diffckpt
inspect --keeper``). The protocol is :mod:`~megatron_diffckpt.keeper.protocol`'s; the keeper
process is :mod:`~megatron_diffckpt.keeper.server`.
"""

from __future__ import annotations

import io
import logging
import os
import socket
import threading
from dataclasses import asdict
from typing import Any

from megatron_diffckpt.keeper.protocol import Op
from megatron_diffckpt.keeper.wire import recv, send
from megatron_diffckpt.storage.format import (
    DiffLogFormatError,
    DiffRecord,
    EncodedRecord,
    SegmentIdentity,
    encode_record,
    iter_records,
)

logger = logging.getLogger(__name__)

ENV = "DIFFCKPT_KEEPER"
"""The keeper's socket path, set by the node launcher for the ranks it starts."""


class KeeperClient:
    """One rank's connection to its node's keeper (``path``: :data:`ENV`). Any thread; calls
    are serialised. A keeper that went away (its node's launcher ended) is reported once by
    :attr:`lost`; calls then return as if it held nothing."""

    TIMEOUT_S = 60.0

    def __init__(self, path: str, identity: SegmentIdentity, timeout: float | None = TIMEOUT_S):
        self.path = path
        self.identity = asdict(identity)
        self.lost: str | None = None
        self.held_iteration = -1
        """The newest iteration the keeper acknowledged."""
        self.served_by = "the node's keeper"
        """Who served the last :meth:`chain`: this node's keeper, or a peer's copy."""
        self._refused_warned = False
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        self._sock.connect(path)

    def sibling(self, timeout: float | None = TIMEOUT_S) -> KeeperClient:
        """Another connection of this rank to the same keeper (calls on it wait for none on
        this one); ``timeout=None``: a call waits as long as the keeper works on it, and ends
        only with the keeper."""
        return KeeperClient(self.path, SegmentIdentity(**self.identity), timeout)

    @classmethod
    def from_env(cls, identity: SegmentIdentity) -> KeeperClient | None:
        """The client of the keeper the launcher announced in :data:`ENV`, or ``None``."""
        path = os.environ.get(ENV)
        if not path:
            return None
        try:
            client = cls(path, identity)
        except OSError as exc:
            logger.warning(
                "keeper %s unreachable (%s): differentials go to storage only", path, exc
            )
            return None
        logger.info("the node's keeper (%s) serves this rank", path)
        return client

    def call(
        self, header: dict, payload: bytes | memoryview = b""
    ) -> tuple[dict, bytearray] | None:
        """One request for this rank (its identity added); the reply, or ``None`` once the
        keeper is lost."""
        if self.lost is not None:
            return None
        with self._lock:
            try:
                send(self._sock, {**header, "identity": self.identity}, payload)
                return recv(self._sock)
            except (OSError, ConnectionError, ValueError) as exc:
                self.lost = str(exc)
                logger.warning(
                    "keeper %s lost (%s): differentials go to storage only", self.path, exc
                )
                return None

    def put(self, record: DiffRecord | EncodedRecord) -> bool:
        """Hand ``record`` to the keeper; ``True`` once it holds it."""
        reply = self.hand(record)
        return reply is not None and reply["held"]

    def hand(self, record: DiffRecord | EncodedRecord, extra: dict | None = None) -> dict | None:
        """:meth:`put` with ``extra`` in the request (``log``: the diff log the keeper writes
        for this rank, :mod:`~megatron_diffckpt.keeper.logs`); the keeper's reply, or ``None``
        once it is lost."""
        header = {"op": Op.PUT, "iteration": record.iteration, **(extra or {})}
        data = record.data if isinstance(record, EncodedRecord) else encode_record(record)
        reply = self.call(header, data)
        if reply is None:
            return None
        if reply[0]["held"]:
            self.held_iteration = record.iteration
        elif not self._refused_warned:
            self._refused_warned = True
            logger.warning(
                "keeper did not take iteration %d: %s", record.iteration, reply[0]["why"]
            )
        return reply[0]

    def published(self, base: int) -> None:
        """A base of ``base`` is published: the keeper drops this rank's records up to it."""
        self.call({"op": Op.PUBLISHED, "iteration": base})

    def chain(self, after: int) -> list[DiffRecord]:
        """The records the keeper holds for this rank from ``after + 1`` on, consecutive, each
        checked against its checksum (a damaged one ends the chain)."""
        reply = self.call({"op": Op.CHAIN, "after": after})
        if reply is None:
            return []
        self.served_by = reply[0].get("tier", self.served_by)
        records: list[DiffRecord] = []
        try:
            for record in iter_records(io.BytesIO(reply[1])):
                if record.iteration != after + 1 + len(records):
                    break
                records.append(record)
        except DiffLogFormatError as exc:
            logger.warning("keeper: a damaged record ends its chain (%s)", exc)
        return records

    def stats(self) -> dict[str, Any]:
        reply = self.call({"op": Op.STATS})
        return reply[0] if reply is not None else {}

    def shm_folder(self) -> str:
        """The keeper's shared-memory folder (LowDiff+'s replica and slots go there)."""
        folder = self.stats().get("shm")
        if not folder:
            raise RuntimeError(f"the keeper at {self.path} has no shared-memory folder")
        return folder

    def close(self) -> None:
        with self._lock:
            self._sock.close()


def query(path: str, op: Op = Op.STATS) -> dict[str, Any]:
    """One request to the keeper at ``path`` (``stats``, ``stop``); its reply. Any process."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(KeeperClient.TIMEOUT_S)
        sock.connect(path)
        send(sock, {"op": op})
        return recv(sock)[0]


def stop(path: str) -> dict[str, Any]:
    """Ask the keeper at ``path`` to stop; its final stats. The launcher."""
    stats = query(path)
    query(path, Op.STOP)
    return stats
