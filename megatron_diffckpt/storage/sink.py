"""``RecordSink``: where a diff-log writer hands each record before storage.

The writer (:class:`~megatron_diffckpt.storage.writer.DiffLogWriter`) knows storage only; a
tier above it (the node's keeper, :class:`~megatron_diffckpt.keeper.client.KeeperClient`) plugs in
as a sink, so that ``storage/`` imports nothing of the tiers built on it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from megatron_diffckpt.storage.format import DiffRecord, EncodedRecord


@runtime_checkable
class RecordSink(Protocol):
    """A copy of the diff log outside storage. The training thread calls it, in the order of
    the log: ``put`` for each record (once it returns, the sink holds the record, or has said
    why not), ``published`` when a base makes the records before it unneeded."""

    def put(self, record: DiffRecord | EncodedRecord) -> None:
        """Hold ``record`` (the writer's next iteration)."""

    def published(self, base_iteration: int) -> None:
        """A base of ``base_iteration`` is durable: records up to it may be dropped."""

    @property
    def held_iteration(self) -> int | None:
        """The newest iteration the sink holds (``None``: none)."""
