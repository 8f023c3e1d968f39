"""Hook points of LowDiff+'s bubble scheduling: where a pipeline stage waits on a peer.

With PP > 1 a stage idles while it waits for a neighbouring stage: in a pipeline receive
(``P2PCommunicator._communicate`` with ``recv_prev``/``recv_next``; the 1F1B warm-up, steady
state and cool-down all go through it) and, at the end of the iteration, in the all-reduce of the
word-embedding gradient shared by the first and last stages (``finalize_model_grads``'s
``_allreduce_word_embedding_grads``, which the last stage enters while the first still runs its
last backward). Both are wrapped in :meth:`BucketSnapshotter.bubble`: snapshot copies queued
while the stage computed are issued when the wait begins, and the wait's interval goes into the
stage's trace.

The wrappers are class/module-wide but inert until :func:`activate` registers a snapshotter.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_diffckpt.patches.base import MethodPatch, PatchSet
from megatron_diffckpt.snapshot import BucketSnapshotter

_active: list[BucketSnapshotter] = []


def _communicate_wrapper(original: Callable) -> Callable:
    def _communicate(self, *, recv_prev, recv_next, **kwargs):
        if not _active or not (recv_prev or recv_next):
            return original(self, recv_prev=recv_prev, recv_next=recv_next, **kwargs)
        with _active[0].bubble():
            return original(self, recv_prev=recv_prev, recv_next=recv_next, **kwargs)

    return _communicate


def _embedding_allreduce_wrapper(original: Callable) -> Callable:
    def _allreduce_word_embedding_grads(*args, **kwargs):
        if not _active:
            return original(*args, **kwargs)
        with _active[0].bubble():
            return original(*args, **kwargs)

    return _allreduce_word_embedding_grads


PATCHES = PatchSet(
    (
        MethodPatch(
            target="megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator._communicate",
            expected_signature=(
                "(self, *, tensor_send_next: Optional[torch.Tensor], tensor_send_prev: "
                "Optional[torch.Tensor], recv_prev: bool, recv_next: bool, tensor_shape: "
                "Union[List[int], torch.Size], wait_on_reqs: bool = True) -> "
                "Tuple[torch.Tensor, torch.Tensor]"
            ),
            make_wrapper=_communicate_wrapper,
            purpose="issue LowDiff+ snapshot copies while a pipeline stage waits on a receive",
        ),
        MethodPatch(
            target=(
                "megatron.core.distributed.finalize_model_grads:_allreduce_word_embedding_grads"
            ),
            expected_signature=(
                "(model: List[torch.nn.modules.module.Module], config: "
                "megatron.core.transformer.transformer_config.TransformerConfig, embd_group: "
                "Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, pp_group: "
                "Optional[torch.distributed.distributed_c10d.ProcessGroup] = None)"
            ),
            make_wrapper=_embedding_allreduce_wrapper,
            purpose="issue LowDiff+ snapshot copies while the last stage waits on the first",
        ),
    )
)
check_drift = PATCHES.check_drift
apply = PATCHES.apply
revert = PATCHES.revert


def activate(snapshotter: BucketSnapshotter) -> None:
    """Treat pipeline waits as bubbles for ``snapshotter``. Any rank; applies the patches."""
    PATCHES.apply()
    _active[:] = [snapshotter]


def deactivate() -> None:
    _active.clear()
