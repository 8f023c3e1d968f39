"""torchrun as the node launcher runs it: ``python -m megatron_diffckpt.torchrun ARGS`` is
``python -m torch.distributed.run ARGS``, except for how a job whose ranks failed ends.

torchrun reports such a job as a table (each failed rank, its exit code or signal, the root
cause) carried by a ``ChildFailedError`` that it raises out of its ``main``, so the table
arrives after a traceback through torchrun's own launch code, which says nothing about the job.
Here the table is printed alone, and the exit status is 1, as torchrun's.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(sys.argv[1:] if argv is None else argv)
    except ChildFailedError as failed:  # the ranks' failure: torchrun's report, no traceback
        sys.stderr.write(f"{failed}\n")
        sys.stderr.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
