"""Fail points: named places where a fault-injection test makes this process die by SIGKILL.

Crash safety is tested by really killing processes. Some moments are too short to hit from
outside (a segment of a few hundred KB is written in about a millisecond), so the code names
them, and a test asks for a SIGKILL at the N-th time one rank reaches one of them::

    DIFFCKPT_FAILPOINT="segment-write:2@1"   # rank 1, the 2nd segment it writes

The points:

- ``segment-write``: a diff-log segment's bytes are in its ``.tmp`` file, neither fsynced nor
  renamed (:class:`~megatron_diffckpt.storage.writer.DiffLogWriter`, its background thread);
- ``replay``: a recovery has replayed one more differential into the optimizer, before the next
  (:func:`~megatron_diffckpt.recovery.replay`);
- ``plus-hand-over``: LowDiff+ is about to hand an iteration to its merger, after the
  iteration's optimizer step
  (:meth:`~megatron_diffckpt.strategies.lowdiff_plus.LowDiffPlusStrategy.end_iteration`);
- ``iteration-end``: an iteration's differential was handed over (LowDiff: to the diff log's
  writer, and to the node's keeper when one runs; LowDiff+: to its merger), before the next
  iteration (:meth:`~megatron_diffckpt.manager.DiffCheckpointManager.end_iteration`);
- ``base-kept``: LowDiff's node keeper acknowledged a base
  (:mod:`~megatron_diffckpt.keeper.base_stager`, on the staging thread, before the next
  optimizer step; an asynchronous save not yet published).

*Delay points* slow a place down instead, to test what happens when it cannot keep up
(``DIFFCKPT_DELAY="merge:0.5@0"``: rank 0 sleeps half a second there each time):

- ``merge``: LowDiff+'s merger is about to step the replica with an iteration
  (:class:`~megatron_diffckpt.replica_merger.ReplicaMerger`, its thread);
- ``keeper-merge``: the node's keeper is about to step a rank's LowDiff+ replica with an
  iteration (:class:`~megatron_diffckpt.keeper.hosted_replica.HostedReplica`); the keeper has
  no rank: give no ``@RANK``, every replica it holds is slowed;
- ``base-write``: LowDiff+'s persister is about to write a base from the replica (its thread,
  before the files are written, here or by the node's keeper): the base is published that much
  later while training goes on.

The spec is ``NAME[:N][@RANK]`` (N defaults to 1; without ``@RANK`` every rank counts its own
hits); the rank is the global one (``RANK``, as torchrun sets it). Unset, :func:`reach` costs one
comparison. The process writes one line to stderr (``failpoint NAME #N: SIGKILL of rank R``)
and kills itself: no ``finally`` runs, no buffer is flushed, exactly as when the kernel or a
scheduler kills it. Any rank, any thread.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

ENV = "DIFFCKPT_FAILPOINT"
POINTS = ("segment-write", "replay", "plus-hand-over", "iteration-end", "base-kept")

_SPEC = re.compile(r"(?P<name>[a-z-]+)(?::(?P<n>\d+))?(?:@(?P<rank>\d+))?")


def _parse(spec: str) -> tuple[str, int, int | None] | None:
    if not spec:
        return None
    m = _SPEC.fullmatch(spec.strip())
    if m is None or m["name"] not in POINTS or (m["n"] is not None and int(m["n"]) < 1):
        raise ValueError(f"{ENV}={spec!r}: expected NAME[:N][@RANK] with NAME one of {POINTS}")
    return m["name"], int(m["n"] or 1), None if m["rank"] is None else int(m["rank"])


_armed = _parse(os.environ.get(ENV, ""))
_hits = 0
_lock = threading.Lock()


DELAY_ENV = "DIFFCKPT_DELAY"
DELAYS = ("merge", "keeper-merge", "base-write")
_DELAY_SPEC = re.compile(r"(?P<name>[a-z-]+):(?P<s>\d+(?:\.\d+)?)(?:@(?P<rank>\d+))?")


def _parse_delay(spec: str) -> tuple[str, float, int | None] | None:
    if not spec:
        return None
    m = _DELAY_SPEC.fullmatch(spec.strip())
    if m is None or m["name"] not in DELAYS:
        raise ValueError(
            f"{DELAY_ENV}={spec!r}: expected NAME:SECONDS[@RANK] with NAME one of {DELAYS}"
        )
    return m["name"], float(m["s"]), None if m["rank"] is None else int(m["rank"])


_delay = _parse_delay(os.environ.get(DELAY_ENV, ""))


def delay(name: str) -> None:
    """This process is at delay point ``name``: sleep there if the spec says so."""
    if _delay is None or _delay[0] != name:
        return
    if _delay[2] is not None and _delay[2] != int(os.environ.get("RANK", "0")):
        return
    time.sleep(_delay[1])


def reach(name: str) -> None:
    """This process is at fail point ``name``: die here if the spec says so."""
    global _hits
    if _armed is None or _armed[0] != name:
        return
    _, nth, rank = _armed
    me = int(os.environ.get("RANK", "0"))
    if rank is not None and rank != me:
        return
    with _lock:
        _hits += 1
        if _hits != nth:
            return
    os.write(2, f"failpoint {name} #{nth}: SIGKILL of rank {me}\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)
