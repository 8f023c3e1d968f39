"""Gradient compression for LowDiff: top-k with error feedback, and the identity.

With compression on, each data-parallel rank sends only the ``k = ceil(ratio * numel)`` entries of
largest magnitude of (its gradient + its error-feedback residual), and keeps the rest as the new
residual, so nothing is dropped, only delayed. The aggregated sparse gradient every rank then feeds
to its optimizer is exactly what the diff log stores: the differential checkpoint costs no extra
computation.

Invariant (checked by the tests with ``torch.equal``): for every step,
``compressed.to_dense() + residual_after == grad + residual_before`` element for element, because
compression only partitions the accumulated tensor, it never rounds it.

The residual is local training state that no gradient can rebuild: it is saved with every base
(see DESIGN.md, invariant 6).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class CompressedGrad:
    """A flat gradient of ``numel`` elements in sparse form.

    Attributes:
        values: the kept entries, 1-D.
        indices: their positions, 1-D ``int32``, strictly increasing; ``None`` means dense
            (``values`` holds all ``numel`` entries).
        numel: the length of the dense gradient.
    """

    values: torch.Tensor
    indices: torch.Tensor | None
    numel: int

    def __post_init__(self) -> None:
        if self.values.dim() != 1:
            raise ValueError(f"values must be 1-D, got shape {tuple(self.values.shape)}")
        if self.indices is None:
            if self.values.numel() != self.numel:
                raise ValueError(
                    f"dense values have {self.values.numel()} entries, numel is {self.numel}"
                )
            return
        if self.indices.dtype != torch.int32 or self.indices.dim() != 1:
            raise ValueError("indices must be a 1-D int32 tensor")
        if self.indices.numel() != self.values.numel():
            raise ValueError(f"{self.indices.numel()} indices for {self.values.numel()} values")
        # The range check reads two entries: on a device that would synchronise the stream in
        # the middle of the backward pass, so it applies to host tensors (records read back).
        if (
            self.indices.numel()
            and self.indices.device.type == "cpu"
            and (int(self.indices[0]) < 0 or int(self.indices[-1]) >= self.numel)
        ):
            raise ValueError(f"indices out of range [0, {self.numel})")

    def nbytes(self) -> int:
        """Bytes of the payload (values and indices)."""
        n = self.values.numel() * self.values.element_size()
        return n + (0 if self.indices is None else self.indices.numel() * 4)

    def to_dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense gradient (zeros where no entry was kept)."""
        dtype = dtype or self.values.dtype
        if self.indices is None:
            return self.values.to(dtype, copy=True)
        dense = torch.zeros(self.numel, dtype=dtype, device=self.values.device)
        dense[self.indices.long()] = self.values.to(dtype)
        return dense


class Compressor(Protocol):
    """Turns a gradient (plus this rank's residual) into what is sent and stored."""

    name: str

    def compress(self, grad: torch.Tensor, residual: torch.Tensor | None) -> CompressedGrad:
        """Compress flat ``grad``; update ``residual`` in place (error feedback) when given."""
        ...


class IdentityCompressor:
    """No compression: the dense gradient; the residual stays zero."""

    name = "none"

    def compress(self, grad: torch.Tensor, residual: torch.Tensor | None) -> CompressedGrad:
        flat = grad.reshape(-1)
        return CompressedGrad(flat.clone(), None, flat.numel())


class TopKCompressor:
    """Keep the ``ceil(ratio * numel)`` largest-magnitude entries of ``grad + residual``.

    Args:
        ratio: the kept fraction, in (0, 1].
        error_feedback: keep the dropped entries in ``residual`` for the next step.
    """

    def __init__(self, ratio: float, error_feedback: bool = True):
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"top-k ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio
        self.error_feedback = error_feedback
        self.name = f"topk:{ratio:g}" + ("" if error_feedback else ":no-ef")

    def k(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def compress(self, grad: torch.Tensor, residual: torch.Tensor | None) -> CompressedGrad:
        flat = grad.reshape(-1)
        numel = flat.numel()
        if numel == 0:
            return CompressedGrad(flat.clone(), torch.empty(0, dtype=torch.int32), 0)
        if self.error_feedback:
            if residual is None or residual.numel() != numel:
                raise ValueError("error feedback needs a residual shaped like the gradient")
            acc = flat + residual.reshape(-1)
        else:
            acc = flat.clone()
        _, idx = torch.topk(acc.abs(), self.k(numel), sorted=False)
        idx, _ = torch.sort(idx)  # canonical order: same input, same bytes
        values = acc[idx]
        if self.error_feedback:
            acc[idx] = 0
            residual.copy_(acc.view_as(residual))
        return CompressedGrad(values, idx.to(torch.int32), numel)


def make_compressor(name: str, ratio: float = 0.01, error_feedback: bool = True) -> Compressor:
    """``"topk"`` or ``"none"``; raises ``ValueError`` naming the choices otherwise."""
    if name == "topk":
        return TopKCompressor(ratio, error_feedback)
    if name == "none":
        return IdentityCompressor()
    raise ValueError(f"unknown compressor {name!r}: choose 'topk' or 'none'")
