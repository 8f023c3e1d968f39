"""CPU priority of megatron-diffckpt's background threads (diff writer, replica merger, base
persister).

They run beside the training thread in the same process. On a GPU node the host cores are mostly
idle and priority does not matter; on a busy host (CPU training, data loading on every core) the
training thread should win. :func:`lower_priority` raises the calling thread's nice value by
``BACKGROUND_NICENESS`` (Linux: per thread); processes it forks (megatron's checkpoint writers)
inherit it. Raising one's own nice value needs no privilege; where it is not possible the thread
keeps its priority.
"""

from __future__ import annotations

import os
import threading

BACKGROUND_NICENESS = 10


def lower_priority(niceness: int = BACKGROUND_NICENESS) -> bool:
    """Lower the calling thread's CPU priority. Any thread; returns whether it took effect."""
    try:
        tid = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + niceness))
        return True
    except (AttributeError, OSError):
        return False
