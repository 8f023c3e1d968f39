"""``python -m megatron_diffckpt.keeper``: the keeper process (the launcher starts it)."""

import sys

from megatron_diffckpt.keeper.server import main

sys.exit(main())
