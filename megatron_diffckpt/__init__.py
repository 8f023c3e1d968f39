"""megatron-diffckpt: per-iteration differential checkpointing for Megatron training.

The package's core (compression, storage, capture, merge, recovery, tuning) works on tensors,
shards and process groups; the hooks into megatron-core live in :mod:`megatron_diffckpt.patches`,
and :mod:`megatron_diffckpt.cpu_mode` lets megatron-core run on CPU processes (demo and CI).
Nothing here imports megatron at package import time.
"""

__version__ = "0.1.0"
