"""The node's keeper: recent differentials in host memory that outlives the ranks that made them.

A rank's memory dies with the rank: what it handed to the diff log's writer but had not yet made
durable (up to a write batch B and the pending batches) is lost with it, and recovery reads
everything it replays from storage. The keeper is one process per node, started by the node
launcher (``megatron-diffckpt-launch --keeper-memory MIB``) before torchrun and
stopped after it, so it outlives the ranks of an attempt that failed: torchrun's restarts
(``--max-restarts``) start new ranks under the same launcher, and they find the keeper holding
what their predecessors handed it.

What it holds, per rank (its whole :class:`~megatron_diffckpt.storage.format.SegmentIdentity`:
run, coordinates and shard layout, so it never serves a record to another layout): the records
after the newest base that rank reported published, each in the diff log's own record encoding
(checksummed, never pickle). LowDiff's ranks go on writing the diff log to storage themselves; the
keeper is a second copy, in memory, that a restart reads first. (With
``--diffckpt-option keeper_writes_log`` the keeper writes LowDiff's diff log from these records,
:mod:`~megatron_diffckpt.keeper.logs`; LowDiff+ with its replica here: from its merges.)

- **Acknowledged = held.** :meth:`KeeperClient.put` returns once the keeper holds the record: it
  survives the rank (SIGKILL included), not the node.
- **Bounded.** At most ``memory`` bytes: a record that does not fit evicts the oldest records of
  the rank whose chain is longest (a chain stays a run of consecutive iterations, so recovery
  takes its start from storage); one larger than the whole cap is not held (storage only, and
  the rank says so once).
- **Protocol.** A Unix stream socket in a folder only its user can enter; each message is a
  frame, a JSON header and a payload (:mod:`~megatron_diffckpt.keeper.wire`). Requests: ``put``
  (identity, iteration; payload: the record), ``published`` (identity, base iteration: drop the
  records up to it), ``chain`` (identity, after: the consecutive records from ``after + 1``;
  payload: the records end to end), ``stats``, ``stop``; ``replica_*``: LowDiff+'s replica
  hosted here, its merges, the diff log written from them, and its recovery
  (:mod:`~megatron_diffckpt.keeper.replicas`);
  ``base_*``: LowDiff's newest base in memory (:mod:`~megatron_diffckpt.keeper.bases`);
  ``write_files``: a LowDiff+ base's files, written here for the rank
  (:mod:`~megatron_diffckpt.keeper.writes`); ``log_*`` (and a ``put`` naming the log): LowDiff's
  diff log, written here for the rank (:mod:`~megatron_diffckpt.keeper.logs`).
- **A ring.** With ``--peers DIR --node N --nnodes M``, a second server on TCP takes the same
  requests from the previous node's keeper (each with this keeper's token), and every record
  and published base is copied to the next node's; a ``chain`` this keeper cannot serve (it was
  lost with its node, and started again) is asked of the next node's
  (:mod:`~megatron_diffckpt.keeper.peers`); so is a LowDiff+ replica (``replica_copy_*``) and
  a LowDiff kept base (``base_copy_*``).

Which processes call: the launcher starts and stops it; any rank's thread calls its own
:class:`KeeperClient` (one connection per client, calls serialised on it). SIGTERM (Slurm's
``scancel`` and preemption signal every process of the job) stops it as ``stop`` does: it
writes out the diff logs it writes for ranks, removes its shared memory and socket, says so in
one line and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import socketserver
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from typing import Any

from megatron_diffckpt import merge_threads
from megatron_diffckpt.background import lower_priority
from megatron_diffckpt.keeper.protocol import Op
from megatron_diffckpt.keeper.shm import (
    SHM_PREFIX,
    claim_shm,
    remove_shm,
    shared_memory_root,
    sweep_stale_shm,
)
from megatron_diffckpt.keeper.wire import (
    Parts,
    Received,
    receive,
    recv_exact,
    recv_header,
    send,
)
from megatron_diffckpt.merge_threads import default_threads

logger = logging.getLogger(__name__)


def _key(identity: dict) -> tuple:
    return tuple(sorted(identity.items()))


class KeeperState:
    """The records a keeper holds, bounded by ``memory`` bytes. Thread-safe.

    Invariant: each rank's chain is a run of consecutive iterations, after the newest base that
    rank reported published.
    """

    def __init__(self, memory: int):
        self.memory = memory
        self.nbytes = 0
        self.reserved = 0
        """Bytes of LowDiff+ replicas (:mod:`~megatron_diffckpt.keeper.replicas`): records get
        what is left."""
        self.evicted = 0
        self._chains: dict[tuple, OrderedDict[int, bytes | bytearray]] = {}
        self._published: dict[tuple, int] = {}
        self._lock = threading.Lock()

    def put(self, identity: dict, iteration: int, record: bytes | bytearray) -> tuple[bool, str]:
        """Hold ``record`` of ``iteration``; ``(held, why not)``."""
        key = _key(identity)
        with self._lock:
            if iteration <= self._published.get(key, -1):
                return False, f"iteration {iteration} is not after the published base"
            room = self.memory - self.reserved
            if len(record) > room:
                return False, f"a record of {len(record)} bytes exceeds the cap's {room} left"
            chain = self._chains.setdefault(key, OrderedDict())
            # A new attempt that resumed before the end of the chain replaces its tail; one that
            # resumed after a gap starts a new chain.
            while chain and next(reversed(chain)) >= iteration:
                self.nbytes -= len(chain.popitem()[1])
            if chain and next(reversed(chain)) != iteration - 1:
                self.nbytes -= sum(len(r) for r in chain.values())
                chain.clear()
            while self.nbytes + len(record) > room:
                self._evict_oldest()
            chain[iteration] = record
            self.nbytes += len(record)
            return True, ""

    def reserve(self, nbytes: int, releasing: int = 0) -> tuple[bool, str]:
        """Reserve ``nbytes`` for a replica that replaces one of ``releasing`` bytes, evicting
        records for room; ``(reserved, why not)``."""
        with self._lock:
            reserved = self.reserved - releasing + nbytes
            if reserved > self.memory:
                return False, (
                    f"a replica of {nbytes / 2**20:.1f} MiB does not fit the cap of "
                    f"{self.memory / 2**20:.1f} MiB ({(self.reserved - releasing) / 2**20:.1f} "
                    "MiB reserved by other ranks' replicas)"
                )
            self.reserved = reserved
            while self.nbytes > self.memory - self.reserved:
                self._evict_oldest()
            return True, ""

    def _evict_oldest(self) -> None:
        longest = max(self._chains.values(), key=len)
        _, dropped = longest.popitem(last=False)
        self.nbytes -= len(dropped)
        self.evicted += 1

    def published(self, identity: dict, base: int) -> None:
        """A base of ``base`` is published for ``identity``: drop its records up to it."""
        key = _key(identity)
        with self._lock:
            self._published[key] = max(base, self._published.get(key, -1))
            chain = self._chains.get(key, OrderedDict())
            while chain and next(iter(chain)) <= base:
                self.nbytes -= len(chain.popitem(last=False)[1])

    def chain(self, identity: dict, after: int) -> list[tuple[int, bytes | bytearray]]:
        """The consecutive records from ``after + 1`` on (none when the chain starts later)."""
        with self._lock:
            chain = self._chains.get(_key(identity), OrderedDict())
            if after + 1 not in chain:
                return []
            return [(i, r) for i, r in chain.items() if i > after]

    def stats(self) -> dict[str, Any]:
        """Totals, and per rank the iterations and bytes held."""
        with self._lock:
            chains = [
                {
                    **dict(key),
                    "first": next(iter(c)),
                    "last": next(reversed(c)),
                    "bytes": sum(len(r) for r in c.values()),
                }
                for key, c in self._chains.items()
                if c
            ]
            return {
                "ranks": len(self._chains),
                "records": sum(len(c) for c in self._chains.values()),
                "bytes": self.nbytes,
                "memory": self.memory,
                "reserved": self.reserved,
                "evicted": self.evicted,
                "chains": sorted(chains, key=lambda c: (c["tp_rank"], c["pp_rank"], c["dp_rank"])),
            }


STREAMED = frozenset({Op.BASE_COPY_PUT, Op.REPLICA_COPY_OPEN})
"""Peer requests whose tensors are written into the keeper's shared-memory folder as they
arrive (:func:`~megatron_diffckpt.keeper.wire.receive`)."""


def _answer(sock: socket.socket, header: dict, payload: bytes | Parts = b"") -> None:
    """Send a reply; a :class:`~megatron_diffckpt.keeper.wire.Parts`'s files are removed
    after it, sent or not."""
    try:
        send(sock, header, payload)
    finally:
        if isinstance(payload, Parts):
            payload.release()


class _Handler(socketserver.BaseRequestHandler):
    """One connection: a rank's (Unix socket) or a peer keeper's (TCP, every request carrying
    this keeper's token; what a peer hands over is held, never forwarded again)."""

    server: _Server | _PeerServer

    def handle(self) -> None:
        server = self.server
        link, from_peer = server.link, server.for_peers
        with server.lock:
            server.connections.add(self.request)
        self.niced = False
        while True:
            try:
                req, n = recv_header(self.request)
                op = req.get("op")
                if from_peer and (link is None or req.get("token") != link.token):
                    send(self.request, {"error": "a peer request without this keeper's token"})
                    return
                if from_peer and op in STREAMED:  # a copy's tensors: into shared-memory files
                    payload: bytearray | Received = receive(self.request, n, req, server.folder)
                else:
                    payload = recv_exact(self.request, n)
            except (ConnectionError, OSError, ValueError):
                return  # the rank went away (or died): what it put stays
            try:
                if not self._serve(req, op, payload):
                    return
            except ConnectionError:  # the rank died while its request was served (a merge)
                return
            finally:
                if isinstance(payload, Received):
                    payload.release()  # its files, unless a copy took them

    def _serve(self, req: dict, op: str, payload: bytearray | Received) -> bool:
        """Answer one request; ``False``: the connection ends."""
        server = self.server
        state, link, from_peer = server.state, server.link, server.for_peers
        if op == Op.PUT and server.stopping:
            send(self.request, {"held": False, "why": "the keeper is stopping"})
        elif op == Op.PUT:
            held, why = state.put(req["identity"], int(req["iteration"]), payload)
            if held and server.bases is not None:
                server.bases.drop_from(_key(req["identity"]), int(req["iteration"]))
            logged = {}  # the rank's diff log, when this keeper writes it (keeper_log)
            if "log" in req and not from_peer:
                logged = server.logs.append(_key(req["identity"]), req, payload)
            send(self.request, {"held": held, "why": why, **logged})
            if held and link is not None and not from_peer:
                link.forward({k: req[k] for k in ("op", "identity", "iteration")}, payload)
            if held and not from_peer:  # LowDiff's replica, off the rank's training path
                server.replicas.roll(_key(req["identity"]), payload)
        elif op == Op.PUBLISHED:
            state.published(req["identity"], int(req["iteration"]))
            if server.bases is not None:
                server.bases.published(_key(req["identity"]), int(req["iteration"]))
            if not from_peer:
                server.replicas.published(_key(req["identity"]), int(req["iteration"]))
                server.logs.rebase(_key(req["identity"]), int(req["iteration"]))
            send(self.request, {"ok": True})
            if link is not None and not from_peer:
                link.forward({k: req[k] for k in ("op", "identity", "iteration")})
        elif op == Op.CHAIN:
            self._chain(req, state, link, from_peer)
        elif op.startswith("replica_") and op.startswith("replica_copy_") == from_peer:
            if not self.niced:  # a rank's merges: after training, as the in-process merger's
                self.niced = lower_priority()
            _answer(self.request, *server.replicas.handle(op, _key(req["identity"]), req, payload))
        elif op == Op.WRITE_FILES and not from_peer:  # in a writer process, niced
            reply = server.writes.handle(_key(req["identity"]), req, payload)
            try:
                send(self.request, *reply)
            except OSError:
                return False  # the rank died while its files were written: no finalize follows
        elif op.startswith("log_") and not from_peer:
            send(self.request, server.logs.handle(op, _key(req["identity"]), req, self))
        elif op.startswith("base_copy_") and from_peer:  # the previous node's ranks' bases
            _answer(self.request, *server.bases.copy(op, _key(req["identity"]), req, payload))
        elif op.startswith("base_") and not from_peer:
            key = _key(req["identity"])
            reply = server.bases.handle(op, key, req, payload)
            send(self.request, *reply)
            if op == Op.BASE_PUT and req.get("replica") and reply[0].get("ok"):
                kept = server.bases.get(key, int(req["iteration"]))
                if kept is not None:
                    server.replicas.roll_from(key, kept)  # LowDiff's replica from it on
        elif op == Op.STATS:
            send(self.request, server.stats())
        elif op == Op.STOP and not from_peer:
            server.stopping = True
            send(self.request, {"ok": True})
            threading.Thread(target=server.stop_all, daemon=True).start()
            return False
        else:
            send(self.request, {"error": f"unknown request {op!r}"})
        return True

    def finish(self) -> None:
        """The connection ended: a log its rank opened is written out now (the rank died, or
        closed it already)."""
        if self.server.logs is not None:
            self.server.logs.detach(self)

    def _chain(self, req: dict, state: KeeperState, link: Any, from_peer: bool) -> None:
        records = state.chain(req["identity"], int(req["after"]))
        if not records and link is not None and not from_peer:
            # This node's keeper holds nothing of the rank (it was lost with the node): its
            # successor's copy.
            reply = link.chain_from_successor(req["identity"], int(req["after"]))
            if reply is not None and reply[0].get("records"):
                tier = f"the keeper of node {link.successor} (a peer)"
                send(self.request, {**reply[0], "tier": tier}, reply[1])
                return
        sizes = [[i, len(r)] for i, r in records]
        send(self.request, {"records": sizes, "tier": "the node's keeper"},
              b"".join(r for _, r in records))  # fmt: skip


class _Serving:
    """What both servers of a keeper share: its state, its ring link, its connections."""

    def setup_keeper(self, state: KeeperState, link: Any, for_peers: bool) -> None:
        self.state, self.link, self.for_peers = state, link, for_peers
        self.stopping = False
        self.replicas: Any = None  # the local server's HostedReplicas
        self.bases: Any = None  # the local server's KeptBases
        self.writes: Any = None  # the local server's KeeperWrites
        self.logs: Any = None  # the local server's KeeperLogs
        self.folder = ""  # the keeper's shared-memory folder
        self.connections: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.stop_all: Any = None  # set by serve()

    def stats(self) -> dict[str, Any]:
        out = self.state.stats()
        if self.replicas is not None:
            out.update(self.replicas.stats())
            out["shm"] = self.replicas.folder
        if self.bases is not None:
            out["bases"] = self.bases.stats()
        if self.writes is not None:
            out["writes"] = self.writes.stats()
        if self.logs is not None:
            out["logs"] = self.logs.stats()
        if self.link is not None:
            out["peer"] = {
                "successor": self.link.successor,
                "dropped": self.link.dropped,
                **self.link.waiting(),
            }
            for c in out["chains"]:
                key = tuple(sorted((k, c[k]) for k in _IDENTITY_FIELDS))
                c["peer_last"] = self.link.peer_last.get(key)
        return out

    def close_connections(self) -> None:
        """End every client's connection: their next call finds the keeper gone."""
        with self.lock:
            for conn in self.connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


_IDENTITY_FIELDS = ("run_id", "tp_rank", "pp_rank", "dp_rank", "layout_hash")


class _Server(_Serving, socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, state: KeeperState, link: Any = None):
        self.setup_keeper(state, link, for_peers=False)
        super().__init__(path, _Handler)


class _PeerServer(_Serving, socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, state: KeeperState):
        self.setup_keeper(state, None, for_peers=True)
        super().__init__((host, 0), _Handler)


def serve(
    path: str,
    memory: int,
    ready: threading.Event | None = None,
    peers: dict[str, Any] | None = None,
    shm: str | None = None,
) -> KeeperState:
    """Serve on the Unix socket ``path`` until a ``stop`` request; the final state.

    ``peers`` (``folder``, ``node``, ``nnodes``, ``host``): also serve the ring's peers on TCP
    and copy every record to the next node's keeper (:mod:`~megatron_diffckpt.keeper.peers`).
    ``shm``: the folder (created, private, removed at the end) where the ranks put LowDiff+
    replicas and their snapshot slots (:mod:`~megatron_diffckpt.keeper.replicas`); default a
    fresh one in ``/dev/shm``.
    """
    state = KeeperState(memory)
    # The shared-memory folder first: once the socket exists (what launchers and tests wait
    # for), the folder is claimed and the ones dead keepers left are gone.
    if shm is None:
        shm = tempfile.mkdtemp(prefix=SHM_PREFIX, dir=shared_memory_root())
    os.makedirs(shm, mode=0o700, exist_ok=True)
    claim_shm(shm)
    for stale in sweep_stale_shm(os.path.dirname(os.path.abspath(shm)), shm):
        logger.info("keeper: removed %s, left by a keeper that died", stale)
    try:
        return _serve(path, memory, state, shm, ready, peers)
    finally:
        remove_shm(shm)


def _serve(
    path: str,
    memory: int,
    state: KeeperState,
    shm: str,
    ready: threading.Event | None,
    peers: dict[str, Any] | None,
) -> KeeperState:
    from megatron_diffckpt.keeper.bases import KeptBases
    from megatron_diffckpt.keeper.logs import KeeperLogs
    from megatron_diffckpt.keeper.peers import PeerLink
    from megatron_diffckpt.keeper.replicas import HostedReplicas
    from megatron_diffckpt.keeper.writes import KeeperWrites

    servers: list[Any] = []
    link = None
    if peers is not None and peers["nnodes"] > 1:
        tcp = _PeerServer(peers.get("bind", "0.0.0.0"), state)
        port = tcp.server_address[1]
        link = PeerLink(peers["folder"], peers["node"], peers["nnodes"], peers["host"], port,
                        file_budget=memory)  # fmt: skip
        tcp.link = link
        servers.append(tcp)
        logger.info(
            "keeper: node %d of %d, copies to node %d, peers reach it at %s:%d",
            peers["node"],
            peers["nnodes"],
            link.successor,
            peers["host"],
            port,
        )
    local = _Server(path, state, link)
    os.chmod(path, 0o600)
    local.replicas = HostedReplicas(state, os.path.abspath(shm), link)
    local.bases = KeptBases(state, os.path.abspath(shm), link)
    local.writes = KeeperWrites(os.path.abspath(shm))
    local.logs = KeeperLogs()
    for server in servers:  # the peers' server takes the copies
        server.replicas, server.bases = local.replicas, local.bases
        server.folder = local.replicas.folder
    servers.insert(0, local)

    def stop_all() -> None:
        for server in servers:
            server.shutdown()

    for server in servers:
        server.stop_all = stop_all
    for server in servers[1:]:
        threading.Thread(target=server.serve_forever, args=(0.2,), daemon=True).start()
    logger.info("keeper: listening on %s, memory cap %.1f MiB", path, memory / 2**20)
    if ready is not None:
        ready.set()
    try:
        local.serve_forever(poll_interval=0.2)
    finally:
        for server in servers[1:]:  # their loops run on threads (stopped already after ``stop``)
            server.shutdown()
        for server in servers:
            server.close_connections()
            server.server_close()
        local.replicas.close()
        local.bases.close()
        local.writes.close()
        local.logs.close()
        if link is not None:
            link.close()
        if os.path.exists(path):
            os.remove(path)
    return state


class Terminated(Exception):
    """The keeper process got SIGTERM: raised where its main thread is, to stop it as a
    ``stop`` request does (the cleanup of :func:`serve` runs on the way out)."""


def _terminate(signum: int, _frame: Any) -> None:
    signal.signal(signum, signal.SIG_IGN)  # a second one does not cut the cleanup short
    raise Terminated(signal.Signals(signum).name)


def _listening(path: str) -> bool:
    """Whether a process accepts connections on the Unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--socket", required=True, help="the Unix socket to serve on")
    parser.add_argument("--memory-mib", type=float, required=True, help="memory cap (MiB)")
    parser.add_argument("--peers", default=None, help="the ring's folder (see keeper_peers)")
    parser.add_argument("--node", type=int, default=0, help="this node's rank in the ring")
    parser.add_argument("--nnodes", type=int, default=1, help="the number of nodes")
    parser.add_argument(
        "--host", default=socket.gethostname(), help="the address peers reach this node at"
    )
    parser.add_argument(
        "--shm-dir",
        default=None,
        help="the folder for LowDiff+ replicas (created, removed at the end; default: a fresh "
        "one in /dev/shm)",
    )
    parser.add_argument(
        "--merge-threads",
        type=int,
        default=None,
        help="CPU threads for the replicas' merges, all ranks together (default: half the CPUs "
        "this process may run on)",
    )
    parser.add_argument(
        "--ranks", type=int, default=1, help="the node's ranks, whose merges share the threads"
    )
    args = parser.parse_args(argv)
    if args.merge_threads is not None and args.merge_threads < 1:
        parser.error(f"--merge-threads must be at least 1, got {args.merge_threads}")
    if args.ranks < 1:
        parser.error(f"--ranks must be at least 1, got {args.ranks}")
    if args.memory_mib <= 0:
        parser.error(f"--memory-mib must be positive, got {args.memory_mib}")
    if not 0 <= args.node < args.nnodes:
        parser.error(f"--node {args.node} is not one of the {args.nnodes} node(s)")
    logging.basicConfig(level=logging.INFO, format="[keeper] %(message)s", stream=sys.stderr)
    if os.path.exists(args.socket):
        if _listening(args.socket):
            logger.error("keeper: a keeper already listens on %s", args.socket)
            return 2
        os.remove(args.socket)  # left by a keeper that was killed
        logger.info("keeper: removed %s, left by a keeper that died", args.socket)
    started = time.perf_counter()
    threads = merge_threads.configure(args.merge_threads or default_threads(), args.ranks)
    logger.info("keeper: merges get %r", threads)
    peers = None
    if args.peers is not None:
        peers = {"folder": args.peers, "node": args.node, "nnodes": args.nnodes}
        peers["host"] = args.host
    signal.signal(signal.SIGTERM, _terminate)
    try:
        state = serve(args.socket, int(args.memory_mib * 2**20), peers=peers, shm=args.shm_dir)
    except Terminated as stop:
        logger.info(
            "keeper: %s: stopped after %.0f s; the diff logs it wrote for ranks written out, its "
            "shared memory and socket removed",
            stop,
            time.perf_counter() - started,
        )
        return 0
    s = state.stats()
    logger.info(
        "keeper: stopped after %.0f s, holding %d record(s) of %d rank(s), %.1f of %.1f MiB, "
        "%d evicted for room",
        time.perf_counter() - started,
        s["records"],
        s["ranks"],
        s["bytes"] / 2**20,
        s["memory"] / 2**20,
        s["evicted"],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
