"""The node launcher moved into the package: ``megatron-diffckpt-launch`` (a console script), or
``python -m megatron_diffckpt.launch``. This shim runs it for scripts written before."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_diffckpt.launch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
