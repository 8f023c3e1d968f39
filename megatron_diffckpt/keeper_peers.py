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
(:class:`~megatron_diffckpt.keeper_replica.HostedReplicas`).

How keepers find each other: a folder every node sees (``--diffckpt-keeper-peers``, on the
job's shared storage, e.g. beside ``--save``), where each keeper publishes ``keeper_<node>.json``
(its TCP address and a random token) when it starts. A peer request carries the receiver's token:
only a process that can read the folder (the job's user) can hand a keeper records or read them.
The copy is asynchronous: a rank's ``put`` returns once its own keeper holds the record; the
newest iteration the successor acknowledged is ``peer_last`` in the keeper's stats. A successor
that is not up yet or went away: each record is tried twice, each time waiting up to
``CONNECT_S`` for it (reconnecting, re-reading the folder: a restarted successor has a new
address and token), then dropped, as are records beyond ``QUEUE`` (or ``QUEUE_BYTES``)
waiting; the first drop is warned about (the copy then has a gap, and a lost node recovers from
storage until the next base; a LowDiff+ replica's copy, until the rank opens it again).

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
from typing import Any

from megatron_diffckpt.durable_io import publish_file

logger = logging.getLogger(__name__)

QUEUE = 256
"""Records (and published bases) waiting for the successor, at most."""
QUEUE_BYTES = 1 << 30
"""Bytes waiting for the successor, at most (LowDiff+'s snapshots are dense)."""
CONNECT_S = 5.0
"""How long one record waits for the successor to be reachable before the sender moves on."""


def peer_file(folder: str, node: int) -> str:
    return os.path.join(folder, f"keeper_{node}.json")


class PeerLink:
    """This keeper's place in the ring: its own address (published in ``folder``) and the
    sender to its successor. ``send`` and ``recv`` are the keeper's message functions."""

    def __init__(
        self, folder: str, node: int, nnodes: int, host: str, port: int, send: Any, recv: Any
    ):
        self.folder, self.node, self.nnodes = folder, node, nnodes
        self.token = secrets.token_hex(16)
        self.successor = (node + 1) % nnodes
        self.peer_last: dict[tuple, int] = {}
        """Per rank identity: the newest iteration the successor acknowledged."""
        self.dropped = 0
        self._send, self._recv = send, recv
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE)
        self._queued_bytes = 0
        self._bytes_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._warned = False
        os.makedirs(folder, mode=0o700, exist_ok=True)
        doc = json.dumps({"node": node, "host": host, "port": port, "token": self.token})
        publish_file(peer_file(folder, node), lambda f: f.write(doc.encode()))
        self._thread = threading.Thread(target=self._run, name="keeper-peer", daemon=True)
        self._thread.start()

    # -- the keeper's server threads ---------------------------------------------------------

    def forward(self, header: dict, payload: bytes | bytearray = b"") -> None:
        """Queue ``header`` (a ``put``, a ``published``, a ``replica_copy_*``) for the successor;
        never blocks."""
        with self._bytes_lock:
            if self._queued_bytes + len(payload) > QUEUE_BYTES:
                self._dropped(f"{self._queued_bytes} bytes wait for it already")
                return
            self._queued_bytes += len(payload)
        try:
            self._queue.put_nowait((header, payload))
        except queue.Full:
            with self._bytes_lock:
                self._queued_bytes -= len(payload)
            self._dropped(f"{QUEUE} records wait for it already")

    def chain_from_successor(self, identity: dict, after: int) -> tuple[dict, bytearray] | None:
        """The successor's copy of ``identity``'s chain after ``after`` (the reply of a
        ``chain`` request), or ``None`` when it cannot be asked."""
        return self.ask({"op": "chain", "identity": identity, "after": after})

    def ask(self, header: dict) -> tuple[dict, bytearray] | None:
        """The successor's reply to one request, on a connection of its own; ``None`` when it
        cannot be asked."""
        try:
            with self._connect(timeout=CONNECT_S) as sock:
                self._send(sock, self._header(header))
                return self._recv(sock)
        except (OSError, ConnectionError, ValueError) as exc:
            logger.warning(
                "keeper: the keeper of node %d cannot be asked (%s)", self.successor, exc
            )
            return None

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

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
            header, payload = item
            with self._bytes_lock:
                self._queued_bytes -= len(payload)
            reply = None
            for attempt in range(2):  # a connection to a successor that restarted is stale
                try:
                    if self._sock is None:
                        self._sock = self._connect(timeout=CONNECT_S)
                    self._send(self._sock, self._header(header), payload)
                    reply, _ = self._recv(self._sock)
                    break
                except (OSError, ConnectionError, ValueError) as exc:
                    if self._sock is not None:
                        self._sock.close()
                    self._sock = None
                    if attempt == 1:
                        self._dropped(str(exc))
            if reply is None:
                continue
            if header["op"] in ("put", "replica_copy_merge") and reply.get("held"):
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
