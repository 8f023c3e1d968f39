"""Top-k with error feedback: what is kept, that nothing is lost, and shard restriction."""

from __future__ import annotations

import pytest
import torch

from megatron_diffckpt.compression import (
    CompressedGrad,
    IdentityCompressor,
    TopKCompressor,
    make_compressor,
)


def test_topk_keeps_the_largest_magnitudes():
    grad = torch.tensor([0.1, -5.0, 0.3, 4.0, -0.2, 0.0, 3.0, -0.05])
    c = TopKCompressor(0.25, error_feedback=False).compress(grad, None)
    assert c.indices.tolist() == [1, 3]  # ceil(0.25 * 8) = 2, in increasing order
    assert torch.equal(c.values, torch.tensor([-5.0, 4.0]))
    assert c.nbytes() == 2 * 4 + 2 * 4


def test_error_feedback_partitions_exactly_and_delays_nothing_forever():
    g = torch.Generator().manual_seed(0)
    comp = TopKCompressor(0.01)
    residual = torch.zeros(10_000)
    sent = torch.zeros(10_000)
    total = torch.zeros(10_000)
    for _ in range(20):
        grad = torch.randn(10_000, generator=g)
        before = residual.clone()
        c = comp.compress(grad, residual)
        assert c.values.numel() == 100
        # Compression only splits grad + residual into what is sent and what is kept back.
        assert torch.equal(c.to_dense() + residual, grad + before)
        assert torch.all(residual[c.indices.long()] == 0)
        sent += c.to_dense()
        total += grad
    torch.testing.assert_close(sent + residual, total)


def test_ratio_one_sends_everything_exactly():
    grad = torch.randn(257)
    residual = torch.zeros(257)
    c = TopKCompressor(1.0).compress(grad, residual)
    assert torch.equal(c.to_dense(), grad) and torch.equal(residual, torch.zeros(257))


def test_identity_is_dense():
    grad = torch.randn(4, 5)
    c = IdentityCompressor().compress(grad, None)
    assert c.indices is None and torch.equal(c.to_dense(), grad.reshape(-1))


def test_compression_is_deterministic():
    grad = torch.randn(5000)
    a = TopKCompressor(0.02).compress(grad, torch.zeros(5000))
    b = TopKCompressor(0.02).compress(grad, torch.zeros(5000))
    assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"values": torch.zeros(2, 2), "indices": None, "numel": 4}, "1-D"),
        ({"values": torch.zeros(2), "indices": torch.tensor([0, 1]), "numel": 4}, "int32"),
        (
            {
                "values": torch.zeros(2),
                "indices": torch.tensor([0, 9], dtype=torch.int32),
                "numel": 4,
            },
            "out of range",
        ),
        ({"values": torch.zeros(3), "indices": None, "numel": 4}, "dense values"),
    ],
)
def test_invalid_records_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CompressedGrad(**kwargs)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        TopKCompressor(0.0)
    with pytest.raises(ValueError, match="choose 'topk' or 'none'"):
        make_compressor("zip")
    with pytest.raises(ValueError, match="residual"):
        TopKCompressor(0.1).compress(torch.randn(10), None)
