"""torch's CPU Adam stepped a block at a time (:mod:`megatron_diffckpt.blocked_adam`): the same bits
as the optimizer's own step, whatever the sizes, options, threads and block, and the optimizer's
own step wherever the blocks could not mirror it."""

from __future__ import annotations

import gc

import pytest
import torch

from megatron_diffckpt import blocked_adam

# sizes around the blocks: one block, one element over, a tail of one, less than a vector
SIZES = [(300, 7), (1024,), (1025,), (3,), (4097,), (2 * 1024 + 1, 5)]


def _params(seed: int = 0, dtype=torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=gen) * 0.02).to(dtype) for s in SIZES]


def _pair(cls=torch.optim.AdamW, dtype=torch.float32, **options):
    """Two optimizers over equal copies of the same parameters, their state created by one
    ordinary step each (as a replica's is, copied from training)."""
    opts = []
    for _ in range(2):
        params = _params(dtype=dtype)
        opt = cls([{"params": params[:3], **options}, {"params": params[3:], "lr": 3e-4}])
        _set_grads(opt, seed=99)
        opt.step()
        opts.append(opt)
    return opts


def _set_grads(opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype) / (1 + seed % 7)


def _assert_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    for ga, gb in zip(a.param_groups, b.param_groups, strict=True):
        for pa, pb in zip(ga["params"], gb["params"], strict=True):
            assert torch.equal(pa, pb)
            sa, sb = a.state[pa], b.state[pb]
            assert sorted(sa) == sorted(sb)
            for key in sa:
                assert torch.equal(sa[key], sb[key]), key


def _run(own: torch.optim.Optimizer, blocked: torch.optim.Optimizer, steps: int, block: int):
    for i in range(steps):
        for opt in (own, blocked):
            _set_grads(opt, seed=i)
            for g, group in enumerate(opt.param_groups):  # a schedule, as megatron's
                group["lr"] = 1e-3 * (0.9**i) / (g + 1)
        own.step()
        blocked_adam.step(blocked, block=block)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("block", [1024, 100, 131072])
@pytest.mark.parametrize(
    "cls,options",
    [
        (torch.optim.AdamW, {"weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}),
        (torch.optim.Adam, {"weight_decay": 0.01}),  # L2 decay, added to the gradient
        (torch.optim.AdamW, {"amsgrad": True, "weight_decay": 0.1}),
        (torch.optim.AdamW, {"maximize": True}),
    ],
    ids=["adamw", "adam-l2", "amsgrad", "maximize"],
)
def test_blocks_step_the_same_bits_as_the_optimizers_own_step(cls, options, block, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        own, blocked = _pair(cls, **options)
        _run(own, blocked, steps=6, block=block)
    finally:
        torch.set_num_threads(before)
    _assert_equal(own, blocked)
    assert float(blocked.state[blocked.param_groups[0]["params"][0]]["step"]) == 7


def test_float64_and_bf16_parameters_too():
    for dtype in (torch.float64, torch.bfloat16):
        own, blocked = _pair(dtype=dtype, weight_decay=0.1)
        _run(own, blocked, steps=3, block=1000)
        _assert_equal(own, blocked)


def test_a_replica_anchored_in_place_or_into_new_tensors_steps_from_its_new_state():
    own, blocked = _pair(weight_decay=0.1)
    _run(own, blocked, steps=2, block=512)
    # anchored in place (refresh_replicas into existing tensors): the same views see it
    source = torch.optim.AdamW(_params(seed=5)[:3], weight_decay=0.1)
    _set_grads(source, seed=3)
    source.step()
    source.step()
    for opt in (own, blocked):
        for p, q in zip(
            opt.param_groups[0]["params"], source.param_groups[0]["params"], strict=True
        ):
            p.copy_(q)
            for key, value in source.state[q].items():
                opt.state[p][key].copy_(value)
    _run(own, blocked, steps=2, block=512)
    _assert_equal(own, blocked)
    # anchored into new tensors: the blocks are made again over them
    for opt in (own, blocked):
        p = opt.param_groups[1]["params"][0]
        opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].clone() * 0.5
        opt.state[p]["step"] = torch.tensor(40.0)
    _run(own, blocked, steps=2, block=512)
    _assert_equal(own, blocked)
    assert float(blocked.state[blocked.param_groups[1]["params"][0]]["step"]) == 42


def test_parameters_without_a_gradient_are_left_as_the_own_step_leaves_them():
    own, blocked = _pair(weight_decay=0.1)
    for opt in (own, blocked):
        _set_grads(opt, seed=4)
        opt.param_groups[0]["params"][1].grad = None
    own.step()
    blocked_adam.step(blocked, block=256)
    _assert_equal(own, blocked)
    skipped = blocked.param_groups[0]["params"][1]
    assert float(blocked.state[skipped]["step"]) == 1


def test_what_the_blocks_cannot_mirror_steps_with_the_optimizers_own_step():
    # the first step creates the state (no state to mirror yet); foreach and fused are other
    # kernels; SGD another optimizer: each steps as its own step() does, bit for bit
    cases = [
        lambda ps: torch.optim.AdamW(ps, weight_decay=0.1),  # no state yet
        lambda ps: torch.optim.AdamW(ps, foreach=True),
        lambda ps: torch.optim.AdamW(ps, fused=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    ]
    for make in cases:
        own, blocked = make(_params()), make(_params())
        for i in range(3):
            _set_grads(own, seed=i)
            _set_grads(blocked, seed=i)
            own.step()
            blocked_adam.step(blocked, block=256)
        _assert_equal(own, blocked)
    # a gradient laid out otherwise than its parameter (a transposed view): its own step
    own, blocked = _pair()
    for opt in (own, blocked):
        _set_grads(opt, seed=1)
        p = opt.param_groups[0]["params"][0]
        p.grad = p.grad.t().contiguous().t()  # the same values, not contiguous
    own.step()
    blocked_adam.step(blocked, block=256)
    _assert_equal(own, blocked)
    assert blocked not in blocked_adam._SHADOWS


def test_the_shadow_goes_with_its_optimizer():
    own, blocked = _pair()
    _run(own, blocked, steps=1, block=256)
    assert blocked in blocked_adam._SHADOWS
    gc.collect()  # other tests' optimizers in reference cycles go first, not in the count
    held = len(blocked_adam._SHADOWS)  # other tests' optimizers may still be alive
    del blocked
    gc.collect()
    assert len(blocked_adam._SHADOWS) == held - 1
