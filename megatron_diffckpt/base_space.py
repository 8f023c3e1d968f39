"""The space under ``--save`` for bases: whether the next one fits, what a failed one means, and
``--diffckpt-when-full``'s rules (:mod:`megatron_diffckpt.out_of_space` recognises a full
filesystem; this module decides, for all ranks together).

A base that would not fit is not started (some of a save's writes happen on one rank only, and
a failure there would leave the others waiting); a base whose save failed for want of space on
any rank is given up on every rank: its partial folder removed, the newest published base and
the diff log left standing. With ``skip`` bases resume once there is space (one warning per
incident, and one when space is back); with ``block`` the job stops with
:class:`~megatron_diffckpt.out_of_space.StorageFullError`, saying what stands.

Collective rule: :meth:`BaseSpace.fits` and :meth:`BaseSpace.give_up` are called by all ranks
together; the rest by any rank.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from megatron_diffckpt import out_of_space, recovery
from megatron_diffckpt.checkpoint_layout import (
    CheckpointNotFoundError,
    checkpoint_dir,
    find_latest_iteration,
    has_tracker,
)

logger = logging.getLogger(__name__)


def warn_once_per_job(msg: str, *args: object) -> None:
    """A storage incident every rank sees: a warning on rank 0, info elsewhere (one warning per
    job, not one per rank). Any rank."""
    log = logger.warning if torch.distributed.get_rank() == 0 else logger.info
    log(msg, *args)


class BaseSpace:
    """The bases under ``save_dir`` and the space they need; ``when_full``: ``block`` or
    ``skip`` (``--diffckpt-when-full``)."""

    def __init__(self, save_dir: str, when_full: str):
        self.save_dir = save_dir
        self.when_full = when_full
        self._full_since: int | None = None  # the first base skipped in this incident

    def newest_published(self) -> int | None:
        """The base the tracker names (complete), or ``None``. Any rank."""
        if not has_tracker(self.save_dir):
            return None
        try:
            return find_latest_iteration(self.save_dir)
        except CheckpointNotFoundError:
            return None

    def newest_published_dir(self) -> Path | None:
        """The folder of the newest published base, or ``None``. Any rank."""
        newest = self.newest_published()
        return None if newest is None else checkpoint_dir(self.save_dir, newest)

    def fits(self, floor: int) -> str | None:
        """``None`` when a base fits in the space left: as big as the newest published one, or
        before the first, ``floor`` bytes (the ranks' sum); else why not. All ranks,
        collectively (rank 0 measures)."""
        unknown = 2**62  # what the other ranks contribute: the MIN is rank 0's measurement
        fits, needed, free = True, unknown, unknown
        if torch.distributed.get_rank() == 0:
            fits, needed, free = out_of_space.base_fits(
                self.save_dir, self.newest_published_dir(), floor
            )
        fits, needed, free = recovery.all_reduce_min(
            [int(fits), needed, free], what="base: does it fit?"
        )
        if fits:
            return None
        return f"{free / 2**20:.1f} MiB free, a base needs about {needed / 2**20:.1f} MiB"

    def full_reason(self, iteration: int, exc: BaseException) -> str | None:
        """Why the base of ``iteration`` failed on this rank when its storage is full (the
        error says so, or too little space is left), else ``None``. Any rank, nothing
        collective (the ranks agree on it in
        :meth:`~megatron_diffckpt.manager.DiffCheckpointManager.agree_on_base`)."""
        return out_of_space.full_reason(exc) or out_of_space.looks_full(
            self.save_dir, self.newest_published_dir(), checkpoint_dir(self.save_dir, iteration)
        )

    def give_up(self, iteration: int, reason: str, durable_iteration: int) -> None:
        """Base ``iteration`` cannot be written: clean its partial folder, then skip it (with
        a warning the first time) or stop. All ranks, collectively."""
        newest = self.newest_published()
        if torch.distributed.get_rank() == 0 and newest != iteration:
            shutil.rmtree(checkpoint_dir(self.save_dir, iteration), ignore_errors=True)
        torch.distributed.barrier()
        stand = (
            f"the newest base is {newest}, the diff log is durable to iteration {durable_iteration}"
            if newest is not None
            else "there is no base yet"
        )
        if self.when_full != "skip":
            raise out_of_space.StorageFullError(
                f"base {iteration} cannot be written under {self.save_dir} ({reason}); {stand}: "
                "free space and restart with --load, or run with --diffckpt-when-full skip"
            )
        if self._full_since is None:
            self._full_since = iteration
            warn_once_per_job(
                "storage under %s is full (%s): base %d was NOT saved, and bases are skipped "
                "until there is space again; %s (--diffckpt-when-full skip)",
                self.save_dir,
                reason,
                iteration,
                stand,
            )
        else:
            logger.info(
                "base %d skipped: storage under %s is still full (%s)",
                iteration,
                self.save_dir,
                reason,
            )

    def published(self, iteration: int) -> None:
        """A base of ``iteration`` is published: an incident of full storage is over. Any
        rank."""
        if self._full_since is not None:
            warn_once_per_job(
                "storage under %s has space again: base %d published (bases from %d on were "
                "skipped)",
                self.save_dir,
                iteration,
                self._full_since,
            )
            self._full_since = None
