"""Keepers in a ring: each node's keeper copies what its ranks hand it to the next node's keeper.

A node that is lost whole (its ranks and its keeper) takes its keeper's memory with it. So each
keeper (:mod:`~megatron_diffckpt.keeper`) of a job of N nodes also sends every record it is
given, and every base a rank reports published, to the keeper of node ``(n + 1) % N``, which
holds them like its own ranks' (a rank's identity names its coordinates, so the chains never
mix; the cap counts both). When the lost node comes back, its fresh keeper holds nothing, and
asks its successor for the chain of each rank that asks it.

What travels: LowDiff's compressed records as they are made, LowDiff+'s dense ones (a peer then
holds the same bytes as storage would; for LowDiff+ a peer copy costs as much network as the diff
log costs storage); with LowDiff+'s replica in the keepers, each replica whole when a rank opens
it and then every iteration's snapshot, which the successor merges into a replica of its own
(:class:`~megatron_diffckpt.keeper.replicas.HostedReplicas`).

How keepers find each other: a folder every node sees (``--keeper-peers``, on the
job's shared storage, e.g. beside ``--save``), where each keeper publishes ``keeper_<node>.json``
(its TCP address and a random token) when it starts. A peer request carries the receiver's token:
only a process that can read the folder (the job's user) can hand a keeper records or read them.
The copy is asynchronous: a rank's ``put`` returns once its own keeper holds the record; the
newest iteration the successor acknowledged is ``peer_last`` in the keeper's stats. A successor
that is not up yet or went away: each record is tried twice, each time waiting up to
``CONNECT_S`` for it (reconnecting, re-reading the folder: a restarted successor has a new
address and token), then dropped, as are records beyond ``QUEUE`` waiting, or beyond
``QUEUE_BYTES`` of records in the keeper's heap, or beyond the keeper's cap of tensor files
(:class:`~megatron_diffckpt.keeper.wire.Parts`: bases, replicas, snapshots) waiting in its
shared memory; the first drop is warned about (the copy then has a gap, and a lost node
recovers from storage until the next base; a LowDiff+ replica's copy, until the rank opens it
again).

Large copies (a base or a replica: a rank's optimizer shard, 12 bytes per parameter) travel as
files (:mod:`~megatron_diffckpt.keeper.wire`): a kept base is hard-linked (it never changes),
a replica and an iteration's snapshot are copied into the keeper's shared memory when the copy
is made; the sender streams them with ``sendfile`` and the successor writes them into its own
shared memory as they arrive, so neither keeper holds them in its heap and no size is too
large.

Which processes call: the keeper process only (its server threads and its sender thread).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from megatron_diffckpt.durable_io import publish_file
from megatron_diffckpt.keeper.protocol import Op
from megatron_diffckpt.keeper.wire import Parts, Received, receive, recv, recv_header, send

logger = logging.getLogger(__name__)

QUEUE = 256
"""Records (and published bases) waiting for the successor, at most."""
QUEUE_BYTES = 1 << 30
"""Bytes of records waiting for the successor in the keeper's heap, at most (tensor files wait
in shared memory: bounded by the keeper's cap)."""
CONNECT_S = 5.0
"""How long one record waits for the successor to be reachable before the sender moves on."""


def peer_file(folder: str, node: int) -> str:
    return os.path.join(folder, f"keeper_{node}.json")


class PeerLink:
    """This keeper's place in the ring: its own address (published in ``folder``) and the
    sender to its successor. ``file_budget``: the bytes of tensor files that may wait for it
    (the keeper's cap)."""

    def __init__(
        self, folder: str, node: int, nnodes: int, host: str, port: int, file_budget: int = 0
    ):
        self.folder, self.node, self.nnodes = folder, node, nnodes
        self.token = secrets.token_hex(16)
        self.successor = (node + 1) % nnodes
        self.predecessor = (node - 1) % nnodes
        """The node whose ranks' copies this keeper holds."""
        self.peer_last: dict[tuple, int] = {}
        """Per rank identity: the newest iteration the successor acknowledged."""
        self.dropped = 0
        self.file_budget = file_budget
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE)
        self._queued_bytes = 0
        self._file_bytes = 0
        self._bytes_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._warned = False
        os.makedirs(folder, mode=0o700, exist_ok=True)
        doc = json.dumps({"node": node, "host": host, "port": port, "token": self.token})
        publish_file(peer_file(folder, node), lambda f: f.write(doc.encode()))
        self._thread = threading.Thread(target=self._run, name="keeper-peer", daemon=True)
        self._thread.start()

    # -- the keeper's server threads ---------------------------------------------------------

    def forward_files(self, folder: str, nbytes: int, make: Callable[[Parts], dict | None]) -> None:
        """Queue a copy whose tensors are files of the keeper's shared memory (``folder``):
        ``make`` appends them to an empty :class:`Parts` (links or copies, ``nbytes`` of them,
        reserved until sent or dropped) and returns the header (``None``: nothing to copy any
        more). Dropped, as any copy, when the files waiting would exceed :attr:`file_budget` or
        cannot be made (no room in shared memory)."""
        with self._bytes_lock:
            room = self._file_bytes + nbytes <= self.file_budget
            if room:
                self._file_bytes += nbytes
            waiting = self._file_bytes
        if not room:
            self._dropped(f"{waiting / 2**20:.0f} MiB of copies wait for it already")
            return

        def unreserve() -> None:
            with self._bytes_lock:
                self._file_bytes -= nbytes

        parts = Parts(folder, on_release=unreserve)
        try:
            header = make(parts)
        except (OSError, RuntimeError) as exc:
            parts.release()
            self._dropped(str(exc))
            return
        if header is None:
            parts.release()
        else:
            self.forward(header, parts)

    def forward(self, header: dict, payload: bytes | bytearray | Parts = b"") -> None:
        """Queue ``header`` (a ``put``, a ``published``, a ``replica_copy_*``, a
        ``base_copy_put``) for the successor; never blocks. A :class:`Parts` payload is the
        sender's from then on (released once sent or dropped)."""
        heap = 0 if isinstance(payload, Parts) else len(payload)
        with self._bytes_lock:
            full = self._queued_bytes + heap > QUEUE_BYTES
            if not full:
                self._queued_bytes += heap
        if full:
            self._dropped(f"{self._queued_bytes / 2**20:.0f} MiB of records wait for it already")
            _release(payload)
            return
        try:
            self._queue.put_nowait((header, payload, heap))
        except queue.Full:
            with self._bytes_lock:
                self._queued_bytes -= heap
            self._dropped(f"{QUEUE} records wait for it already")
            _release(payload)

    def waiting(self) -> dict[str, int]:
        """What waits for the successor: messages, their bytes in the heap, and in files of
        shared memory (reserved up to :attr:`file_budget`)."""
        with self._bytes_lock:
            heap, files = self._queued_bytes, self._file_bytes
        return {"waiting": self._queue.qsize(), "waiting_heap": heap, "waiting_files": files}

    def chain_from_successor(self, identity: dict, after: int) -> tuple[dict, bytearray] | None:
        """The successor's copy of ``identity``'s chain after ``after`` (the reply of a
        ``chain`` request), or ``None`` when it cannot be asked."""
        return self.ask({"op": Op.CHAIN, "identity": identity, "after": after})

    def ask(
        self, header: dict, into: str | None = None
    ) -> tuple[dict, bytearray | Received] | None:
        """The successor's reply to one request, on a connection of its own; ``None`` when it
        cannot be asked. ``into``: a folder where the reply's tensors are written as they
        arrive (:func:`~megatron_diffckpt.keeper.wire.receive`; the caller releases it)."""
        try:
            with self._connect(timeout=CONNECT_S) as sock:
                send(sock, self._header(header))
                if into is None:
                    return recv(sock)
                reply, n = recv_header(sock)
                return reply, receive(sock, n, reply, into)
        except (OSError, ConnectionError, ValueError) as exc:
            logger.warning(
                "keeper: the keeper of node %d cannot be asked (%s)", self.successor, exc
            )
            return None

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
        while True:  # what the sender did not reach: its files
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                _release(item[1])

    # -- internals ---------------------------------------------------------------------------

    def _header(self, header: dict) -> dict:
        return {**header, "token": self._successor_doc()["token"], "peer": self.node}

    def _successor_doc(self) -> dict:
        with open(peer_file(self.folder, self.successor)) as f:
            return json.load(f)

    def _connect(self, timeout: float) -> socket.socket:
        """A connection to the successor, retried until ``timeout`` (it may not be up yet)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                doc = self._successor_doc()
                return socket.create_connection((doc["host"], doc["port"]), timeout=60)
            except (OSError, ValueError, KeyError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            header, payload, heap = item
            with self._bytes_lock:
                self._queued_bytes -= heap
            reply = None
            try:
                for attempt in range(2):  # a connection to a successor that restarted is stale
                    try:
                        if self._sock is None:
                            self._sock = self._connect(timeout=CONNECT_S)
                        send(self._sock, self._header(header), payload)
                        reply, _ = recv(self._sock)
                        break
                    except (OSError, ConnectionError, ValueError) as exc:
                        if self._sock is not None:
                            self._sock.close()
                        self._sock = None
                        if attempt == 1:
                            self._dropped(str(exc))
            finally:
                _release(payload)
            if reply is None:
                continue
            if header["op"] in (Op.PUT, Op.REPLICA_COPY_MERGE) and reply.get("held"):
                key = tuple(sorted(header["identity"].items()))
                self.peer_last[key] = max(int(header["iteration"]), self.peer_last.get(key, -1))
        if self._sock is not None:
            self._sock.close()

    def _dropped(self, why: str) -> None:
        self.dropped += 1
        if not self._warned:
            self._warned = True
            logger.warning(
                "keeper: a record was not copied to the keeper of node %d (%s); until it is "
                "reachable, a loss of this node recovers from storage",
                self.successor,
                why,
            )


def _release(payload: Any) -> None:
    if isinstance(payload, Parts):
        payload.release()
