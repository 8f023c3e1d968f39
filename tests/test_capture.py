"""Gradient encoding of the capture is exact, dense or sparse, down to the sign of zero."""

from __future__ import annotations

import torch

from megatron_diffckpt.capture import decode_grad, encode_grad


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_dense_gradient_round_trips():
    g = torch.randn(7, 9)
    parts = encode_grad(g)
    assert set(parts) == {"dense"}
    assert _same_bits(decode_grad(parts, g), g)


def test_sparse_gradient_is_stored_sparse_and_round_trips_with_negative_zero():
    g = torch.zeros(1000)
    g[[3, 500, 999]] = torch.tensor([1.5, -2.0, 3.0])
    g[10] = -0.0  # a set bit: must survive
    parts = encode_grad(g)
    assert set(parts) == {"values", "indices"} and parts["indices"].tolist() == [3, 10, 500, 999]
    assert _same_bits(decode_grad(parts, g), g)


def test_encoding_copies_the_gradient():
    g = torch.randn(10)
    parts = encode_grad(g)
    g.zero_()  # the grad buffer is reused by the next iteration
    assert parts["dense"].abs().sum() > 0
