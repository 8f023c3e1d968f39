"""The sparse all-reduce: what every rank ends up with, across real processes (gloo).

Each rank compresses its own gradient; the result must be the sum (or mean) of exactly the
entries the ranks kept, and each residual must hold exactly what its rank did not send.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_diffckpt.compression import TopKCompressor
from megatron_diffckpt.exchange import ErrorFeedbackResiduals, SparseAllReduce

WORLD = 3  # an odd group: the addition order matters, and the test fixes it


def _grad(rank: int, step: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(numel, generator=g)


def _worker(rank: int, init_file: str, out_dir: str, ratio: float, async_op: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    exchange = SparseAllReduce(TopKCompressor(ratio))
    sizes = {"a": 1000, "b": 37}
    results = []
    for step in range(3):
        buckets = {k: _grad(rank, step, n) + (0 if k == "a" else 100) for k, n in sizes.items()}
        before = {k: exchange.residuals.get(k, b).clone() for k, b in buckets.items()}
        pending = exchange.start(list(buckets.items()), None, average=True, async_op=async_op)
        pending.wait()
        results.append(
            {
                "reduced": {k: b.clone() for k, b in buckets.items()},
                "residual_before": before,
                "residual_after": exchange.residuals.state_dict(),
            }
        )
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _run(tmp_path, ratio: float, async_op: bool) -> list[list[dict]]:
    mp.spawn(
        _worker,
        args=(str(tmp_path / "init"), str(tmp_path), ratio, async_op),
        nprocs=WORLD,
        join=True,
    )
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


@pytest.mark.distributed
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_every_rank_gets_the_mean_of_the_kept_entries(tmp_path, async_op):
    ratio = 0.05
    out = _run(tmp_path, ratio, async_op)
    sizes = {"a": 1000, "b": 37}
    for step in range(3):
        for key, numel in sizes.items():
            expected = torch.zeros(numel)
            for rank in range(WORLD):
                grad = _grad(rank, step, numel) + (0 if key == "a" else 100)
                acc = grad + out[rank][step]["residual_before"][key]
                after = out[rank][step]["residual_after"][key]
                sent = acc - after
                kept = after == 0
                # The residual is the accumulated gradient minus exactly k sent entries.
                assert int((sent != 0).sum()) == TopKCompressor(ratio).k(numel)
                assert torch.equal(torch.where(kept, acc, after), acc)
                # The kept entries are the largest in magnitude.
                assert acc[kept].abs().min() >= acc[~kept].abs().max()
                expected += torch.where(kept, acc, torch.zeros(()))
            expected /= WORLD
            for rank in range(WORLD):
                got = out[rank][step]["reduced"][key]
                assert torch.equal(got, out[0][step]["reduced"][key]), "ranks disagree"
                torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.distributed
def test_ratio_one_is_a_plain_mean(tmp_path):
    out = _run(tmp_path, 1.0, False)
    for step in range(3):
        expected = sum(_grad(r, step, 1000) for r in range(WORLD)) / WORLD
        torch.testing.assert_close(out[0][step]["reduced"]["a"], expected, rtol=1e-6, atol=1e-6)
        assert not out[0][step]["residual_after"]["a"].any()


def test_residuals_round_trip_and_refuse_another_layout():
    r = ErrorFeedbackResiduals()
    like = torch.zeros(10)
    r.get("x", like).add_(torch.arange(10.0))
    state = r.state_dict()
    state["x"].zero_()  # a copy: saving never races with training
    assert r.get("x", like).sum() == 45
    fresh = ErrorFeedbackResiduals()
    fresh.load_state_dict(r.state_dict())
    assert torch.equal(fresh.get("x", like), torch.arange(10.0))
    with pytest.raises(ValueError, match="residual 'x' is 10"):
        fresh.get("x", torch.zeros(11))
    with pytest.raises(ValueError, match="not a flat tensor"):
        fresh.load_state_dict({"y": torch.zeros(2, 2)})
