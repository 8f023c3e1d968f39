"""The keepers' shared-memory folders (``/dev/shm``): where they go, whose each is (an owner file
beside it names the keeper's process and start time), and their removal, also of folders that
keepers killed without removing them left behind. Any process (the keeper, the launcher).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile

import psutil

from megatron_diffckpt.durable_io import publish_file

logger = logging.getLogger(__name__)


def shared_memory_root() -> str:
    """Where keepers' shared-memory folders go: ``/dev/shm`` (memory) where there is one."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


SHM_PREFIX = "diffckpt-keeper-"
"""How a keeper's shared-memory folder is named (the launcher's and the default alike)."""
OWNER = ".owner"
"""Beside a keeper's shared-memory folder, its name with this suffix: the keeper's process id
and start time."""


def _process_tag(pid: int) -> str | None:
    """``pid`` and its start time (a reused process id reads as another process); ``None``:
    no such process."""
    try:
        return f"{pid} {psutil.Process(pid).create_time():.3f}"
    except psutil.Error:
        return None


def claim_shm(folder: str) -> None:
    """Mark ``folder`` as this keeper's (:data:`OWNER`)."""
    tag = _process_tag(os.getpid())
    publish_file(folder.rstrip("/") + OWNER, lambda f: f.write(tag.encode()))


def remove_shm(folder: str) -> None:
    """Remove a keeper's shared-memory folder and its owner file."""
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(folder.rstrip("/") + OWNER)


def sweep_stale_shm(root: str, keep: str) -> list[str]:
    """Remove the shared-memory folders in ``root`` that keepers of this user left when they
    died without removing them (SIGKILL, a node lost with its launcher): memory nobody frees
    otherwise until the host reboots. A folder is stale when its :data:`OWNER` names a process
    that no longer runs; one without an owner file, another user's, or ``keep`` (this keeper's)
    is left alone. The folders removed."""
    removed = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if not (name.startswith(SHM_PREFIX) and name.endswith(OWNER)):
            continue
        folder = os.path.join(root, name.removesuffix(OWNER))
        if os.path.abspath(folder) == os.path.abspath(keep):
            continue
        try:
            if os.stat(os.path.join(root, name)).st_uid != os.getuid():
                continue
            with open(os.path.join(root, name)) as f:
                tag = f.read().strip()
            pid = int(tag.split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if _process_tag(pid) != tag:
            remove_shm(folder)
            removed.append(folder)
    return removed
