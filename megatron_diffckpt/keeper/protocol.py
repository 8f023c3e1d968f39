"""The keeper's requests: every name a message's ``op`` may carry, and who sends it.

A message is a frame of :mod:`~megatron_diffckpt.keeper.wire` (a JSON header and a payload); its
header's ``op`` is one of :class:`Op` (a ``str`` enum: it travels as its value), with the rank's
``identity`` added by :class:`~megatron_diffckpt.keeper.client.KeeperClient`. The keeper answers
every request with one frame; a name it does not know is answered with an ``error`` and the
connection serves on. Requests from a peer keeper (the ring) reach only the names marked
"peer"; the others come from a node's own ranks or launcher.
"""

from __future__ import annotations

from enum import StrEnum


class Op(StrEnum):
    """The requests a keeper serves."""

    # differentials (any rank; ``put`` and ``published`` from a peer too)
    PUT = "put"
    """A record of the rank's next iteration (payload); reply ``held`` (or ``why`` not)."""
    PUBLISHED = "published"
    """A base of ``iteration`` is durable: drop the rank's records up to it."""
    CHAIN = "chain"
    """The consecutive records after ``after`` (payload: the records end to end)."""
    STATS = "stats"
    """What the keeper holds, per rank and in all (any process)."""
    STOP = "stop"
    """Stop serving (the launcher)."""

    # LowDiff's kept bases (rank), and their copies around the ring (peer)
    BASE_PUT = "base_put"
    """A base staged in the keeper's shared memory (its files); reply ``ok`` and what it holds."""
    BASE_STATE = "base_state"
    """The kept bases of the rank, offered at recovery."""
    BASE_COPY_PUT = "base_copy_put"
    """(peer) A copy of a base of the previous node's rank, streamed as files."""
    BASE_COPY_FETCH = "base_copy_fetch"
    """(peer) The copies this keeper holds of a rank, for a fresh keeper to adopt."""

    # replicas stepped in the keeper (rank), and their copies (peer)
    REPLICA_OPEN = "replica_open"
    """Host the rank's replica (LowDiff+) from files in shared memory."""
    REPLICA_CLOSE = "replica_close"
    """Drop the rank's replica."""
    REPLICA_MERGE = "replica_merge"
    """Step the replica with the iteration handed over in the snapshot slots."""
    REPLICA_LOG = "replica_log"
    """Write the iteration handed over in a snapshot slot to the diff log and give the slot
    back, unmerged (merges skipped until the replica is opened again)."""
    REPLICA_FLUSH = "replica_flush"
    """Reply once every hand-over is merged."""
    REPLICA_SETTLE = "replica_settle"
    """Recovery: merge or drop what is held, to the iteration the ranks agreed on."""
    REPLICA_STATE = "replica_state"
    """Recovery: the replica's iteration, the one held, and its files."""
    REPLICA_LOG_FLUSH = "replica_log_flush"
    """Write the diff log of the replica's merges out, then nothing until reopened."""
    REPLICA_COPY_OPEN = "replica_copy_open"
    """(peer) A whole replica of the previous node's rank, streamed as files."""
    REPLICA_COPY_STEP = "replica_copy_step"
    """(peer) A differential the previous node's keeper stepped its replica with (LowDiff)."""
    REPLICA_COPY_MERGE = "replica_copy_merge"
    """(peer) An iteration the previous node's keeper merged (LowDiff+)."""
    REPLICA_COPY_CLOSE = "replica_copy_close"
    """(peer) The copy of a rank's replica ends."""
    REPLICA_COPY_FETCH = "replica_copy_fetch"
    """(peer) The copy this keeper holds of a rank's replica, for a fresh keeper to adopt."""

    # the diff log written by the keeper (rank)
    LOG_OPEN = "log_open"
    """Write the rank's diff log from its chain start, with the rank's writer settings."""
    LOG_FLUSH = "log_flush"
    """Reply once what was handed over is durable."""
    LOG_CLOSE = "log_close"
    """Write out what is held, then nothing more until reopened."""

    # LowDiff+'s base files written by the keeper (rank)
    WRITE_FILES = "write_files"
    """Write a base's files from the plan's tensors staged in shared memory."""
