"""Integrations with whole training loops, built on the manager and the hook points of
:mod:`megatron_diffckpt.patches`: :mod:`~megatron_diffckpt.integrations.megatron_lm` for
Megatron-LM's ``megatron.training``."""
