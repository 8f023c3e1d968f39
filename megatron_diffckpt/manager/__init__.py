"""The manager: the one object a training loop talks to, in parts.

- :mod:`.facade`: :class:`DiffCheckpointManager`, its public calls in the order a loop makes
  them (the call sequence is in its module);
- :mod:`.recovery`: the one recovery entry point's tiers (keepers' replicas, kept bases,
  storage), :class:`~.recovery.Recovered`;
- :mod:`.metrics`: what the training log line shows;
- :mod:`.run`: the run's identity (its id, the shard layout's hash).
"""

from megatron_diffckpt.manager.facade import DiffCheckpointManager
from megatron_diffckpt.manager.metrics import format_metrics
from megatron_diffckpt.manager.recovery import Recovered
from megatron_diffckpt.manager.run import shard_layout_hash

__all__ = ["DiffCheckpointManager", "Recovered", "format_metrics", "shard_layout_hash"]
