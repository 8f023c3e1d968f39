"""The host replica's kernel: training's own where bit-identity is possible, torch's fused CPU Adam
where it is not, with the drift between anchors bounded against a float64 reference.

No GPU here: the fused path is forced (``kernel="fused"``) to stand for a replica of a device
optimizer, whose host kernel can never match the device's bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from megatron_diffckpt.replica_merger import refresh_replicas, replica_kernel, replica_of

N = 50_000
STEPS = 200  # iterations between two anchors (bases), a long interval for LowDiff+


def _adamw(p: torch.Tensor) -> torch.optim.AdamW:  # megatron's torch AdamW, as it configures it
    return torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def _pair(dtype=torch.float32):
    torch.manual_seed(0)
    p = torch.nn.Parameter((torch.randn(N) * 0.02).to(dtype))
    return p, _adamw(p)


def _grads():
    gen = torch.Generator().manual_seed(1)
    for step in range(1, STEPS + 1):  # shrinking gradients, as training's
        yield step, torch.randn(N, generator=gen) / step**0.5


def _step(p: torch.Tensor, opt: torch.optim.Optimizer, g: torch.Tensor) -> None:
    p.grad = g.to(p.dtype)
    opt.step()
    p.grad = None


class NotTorchAdam(torch.optim.Optimizer):
    """An optimizer of another library (transformer-engine's, apex's fused Adam), by its type."""

    def __init__(self, params):
        super().__init__(
            params, {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
        )


def test_the_kernel_is_exact_for_torch_adam_on_the_cpu_and_fused_otherwise():
    p, opt = _pair()
    assert replica_kernel(opt) == "exact"
    assert replica_kernel(opt, "fused") == "fused"
    other = NotTorchAdam([torch.nn.Parameter(torch.zeros(4))])
    assert replica_kernel(other) == "fused"
    with pytest.raises(ValueError, match="no exact host kernel for NotTorchAdam"):
        replica_kernel(other, "exact")
    with pytest.raises(ValueError, match="replica kernel must be one of"):
        replica_kernel(opt, "fast")
    fused = replica_of(other, kernel="auto")
    assert type(fused) is torch.optim.AdamW and fused.param_groups[0]["fused"] is True
    assert fused.param_groups[0]["betas"] == (0.9, 0.95)
    # megatron's own group options stay: a base written from the replica saves the groups,
    # and megatron's load of the distributed optimizer looks wd_mult up in them
    p, opt = _pair()
    opt.param_groups[0].update(wd_mult=1.0, lr_mult=1.0, is_expert_parallel=False, foreach=True)
    group = replica_of(opt, kernel="fused").param_groups[0]
    assert (group["wd_mult"], group["lr_mult"], group["is_expert_parallel"]) == (1.0, 1.0, False)
    assert group["fused"] is True and not group["foreach"]


def test_the_exact_replica_stays_bit_identical_to_training():
    p, opt = _pair()
    _step(p, opt, torch.ones(N))  # the state exists when the replica is anchored
    replica = replica_of(opt)
    r = replica.param_groups[0]["params"][0]
    for _, g in _grads():
        _step(p, opt, g)
        _step(r, replica, g)
    assert torch.equal(r, p)
    assert torch.equal(replica.state[r]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])


def test_the_fused_replica_drifts_by_rounding_only_and_its_anchor_removes_the_drift():
    p, opt = _pair()
    ref, ref_opt = _pair(torch.float64)  # the exact arithmetic both kernels round
    _step(p, opt, torch.ones(N))
    _step(ref, ref_opt, torch.ones(N))
    replica = replica_of(opt, kernel="fused")
    r = replica.param_groups[0]["params"][0]
    assert replica.param_groups[0]["fused"] is True
    ulp = torch.finfo(torch.float32).eps * float(p.detach().abs().max())
    for _, g in _grads():
        _step(p, opt, g)
        _step(r, replica, g)
        _step(ref, ref_opt, g)
    pd, rd, refd = p.detach(), r.detach(), ref.detach()
    training_error = float((pd.double() - refd).abs().max())
    replica_error = float((rd.double() - refd).abs().max())
    drift = float((rd - pd).abs().max())
    assert not torch.equal(r, p)  # a different kernel: it does round differently
    # No less accurate than the kernel it stands for, and a few units in the last place from
    # it after STEPS iterations (rounding that does not accumulate into a bias).
    assert replica_error <= 1.05 * training_error + ulp, (replica_error, training_error)
    assert drift <= 16 * ulp, (drift, ulp)
    moment = opt.state[p]["exp_avg"]
    assert float((replica.state[r]["exp_avg"] - moment).abs().max()) <= 16 * (
        torch.finfo(torch.float32).eps * float(moment.abs().max())
    )
    # A base re-anchors it: equal again, and still the fused kernel.
    (replica,) = refresh_replicas([opt], [replica])
    assert torch.equal(r, p) and torch.equal(replica.state[r]["exp_avg"], moment)
    assert replica.param_groups[0]["fused"] is True
