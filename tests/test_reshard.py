"""Resume under another tensor, pipeline or data-parallel layout through ``merge --reshardable``.

A LowDiff job (bases every 5) is killed by SIGKILL after iteration 7; ``megatron-diffckpt merge
--reshardable`` writes the state at the newest iteration every rank holds (base 5 plus the
differentials after it) with the optimizer state in model space, and the job resumes from it
under another layout. After loading, every model tensor, main parameter and Adam moment,
assembled into whole tensors from the ranks' pieces (``--dump-model-space``), is ``torch.equal``
to an uninterrupted run's at the same iteration assembled the same way; training then goes on,
its losses within 2% of the uninterrupted run's (the RNG states of another TP/PP layout are not
loaded, so dropout draws differ). Also: (TP 2) to (DP 2); the merged checkpoint holds no bucket
padding; a ``dp_reshardable`` base under another TP size is refused in one line naming the merge;
the top-k exchange's residuals are dropped with a note. Real processes (gloo).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from launch import TINY_GPT, recovered_iteration, run_cli, run_gpt, run_until_killed

from megatron_diffckpt.dist_ckpt_io import read_metadata

COMMON = [*TINY_GPT, "--use-distributed-optimizer", "--lr-decay-iters", "100"]
KILL_AFTER = 7
MORE = 3  # iterations trained after the resume
LAYOUTS = {  # name: (processes, flags)
    "tp1-pp1-dp2": (2, []),
    "tp2-pp1-dp1": (2, ["--tensor-model-parallel-size", "2"]),
    "tp1-pp2-dp1": (2, ["--pipeline-model-parallel-size", "2"]),
    "tp1-pp1-dp1": (1, []),
}


def _assemble(folder: Path, nproc: int) -> dict[str, torch.Tensor]:
    """Whole tensors from the ranks' model-space pieces; NaN where no rank had a piece."""
    out: dict[str, torch.Tensor] = {}
    for rank in range(nproc):
        pieces = torch.load(folder / f"model_space_{rank}.pt")
        for key, shape, offset, local_shape, (start, end), values in pieces:
            whole = out.setdefault(key, torch.full(shape, float("nan"), dtype=values.dtype))
            head = len(offset) - len(local_shape)  # megatron's prepended axes (stacked layers)
            index = tuple(offset[:head]) + tuple(
                slice(o, o + s) for o, s in zip(offset[head:], local_shape, strict=True)
            )
            local = whole[index].reshape(-1)
            local[start:end] = values
            whole[index] = local.view(local_shape)
    return out


def _assert_same_model_space(expected: dict, got: dict) -> None:
    assert expected.keys() == got.keys()
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in got)
    for key, value in expected.items():
        assert not torch.isnan(got[key]).any(), f"{key}: no rank holds part of it"
        assert torch.equal(value, got[key]), key


def _losses(proc) -> dict[int, float]:
    log = proc.stdout + proc.stderr
    return {int(i): float(v) for i, v in re.findall(r"iteration +(\d+)/.*?lm loss: (\S+) \|", log)}


def _source(tmp: Path, nproc: int, flags: list[str]) -> tuple[Path, int, dict, dict]:
    """Train under a layout, SIGKILL after KILL_AFTER, merge --reshardable: (the merged folder,
    T, the uninterrupted run's model space at T, its losses)."""
    ckpt, merged, straight = tmp / "ckpt", tmp / "merged", tmp / "straight"
    job = [*COMMON, *flags, "--save", str(ckpt), "--save-interval", "5",
           "--diffckpt-mode", "lowdiff", "--train-iters", "20"]  # fmt: skip
    assert nproc == 2
    run_until_killed(job, kill_after=KILL_AFTER)
    merge = run_cli("merge", str(ckpt), "--out", str(merged), "--reshardable", "--quiet")
    assert merge.returncode == 0, merge.stdout + merge.stderr
    assert "optimizer format fully_reshardable" in merge.stdout, merge.stdout
    target = int(re.search(r"\(iteration (\d+),", merge.stdout).group(1))
    assert 5 < target <= KILL_AFTER
    proc = run_gpt(nproc, *COMMON, *flags, "--train-iters", str(target + MORE),
                   "--dump-state", str(straight), "--dump-state-at", str(target),
                   "--dump-model-space")  # fmt: skip
    return merged, target, _assemble(straight / f"iter_{target:07d}", nproc), _losses(proc)


@pytest.fixture(scope="module")
def from_dp2(tmp_path_factory):
    return _source(tmp_path_factory.mktemp("from_dp2"), *LAYOUTS["tp1-pp1-dp2"])


def _resume(merged: Path, tmp: Path, target: int, nproc: int, flags: list[str]):
    """Resume a copy of ``merged`` under a layout (``--load`` and ``--save`` the same folder):
    its model space at T, and the run."""
    ckpt, dumps = tmp / "resumed", tmp / "dumps"
    shutil.copytree(merged, ckpt)
    proc = run_gpt(nproc, *COMMON, *flags, "--load", str(ckpt), "--save", str(ckpt),
                   "--save-interval", "5", "--diffckpt-mode", "lowdiff",
                   "--train-iters", str(target + MORE), "--dump-state", str(dumps),
                   "--dump-state-at", str(target), "--dump-model-space")  # fmt: skip
    assert recovered_iteration(proc) == target
    return _assemble(dumps / f"iter_{target:07d}", nproc), proc


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp2-pp1-dp1", "tp1-pp2-dp1", "tp1-pp1-dp1"])
def test_a_merged_reshardable_state_resumes_exactly_under_another_layout(
    tmp_path, from_dp2, layout
):
    merged, target, expected, straight_losses = from_dp2
    nproc, flags = LAYOUTS[layout]
    got, proc = _resume(merged, tmp_path, target, nproc, flags)
    _assert_same_model_space(expected, got)
    log = proc.stdout + proc.stderr
    if layout != "tp1-pp1-dp1":  # another TP or PP size: the RNG states are not this layout's
        assert "its RNG states are not loaded" in log, log[-3000:]
    losses = _losses(proc)
    assert sorted(losses) == list(range(target + 1, target + MORE + 1)), log[-3000:]
    for it, loss in losses.items():
        assert abs(loss - straight_losses[it]) <= 0.02 * straight_losses[it], (it, loss)
    # Training under the new layout goes on saving its own bases (dp_reshardable, this layout).
    assert (tmp_path / "resumed" / "latest_checkpointed_iteration.txt").read_text() == str(
        target + MORE
    )


@pytest.mark.distributed
def test_tensor_parallel_to_data_parallel_and_no_padding_in_the_merged_checkpoint(tmp_path):
    merged, target, expected, _ = _source(tmp_path / "src", *LAYOUTS["tp2-pp1-dp1"])
    tensors = read_metadata(str(merged / f"iter_{target:07d}")).state_dict_metadata
    assert not any(k.startswith("optimizer.distributed.") for k in tensors)  # no flat buckets
    state = [k for k in tensors if k.startswith("optimizer.state.")]
    assert len(state) == 3 * sum(1 for k in tensors if f"optimizer.state.param.{k}" in tensors)
    for key in state:  # exactly the model tensors' shapes: nothing padded
        model_key = key.split(".", 3)[3]
        assert tensors[key].size == tensors[model_key].size, key
    got, _ = _resume(merged, tmp_path, target, *LAYOUTS["tp1-pp1-dp2"])
    _assert_same_model_space(expected, got)


@pytest.mark.distributed
def test_a_dp_reshardable_base_under_another_tensor_parallel_size_is_refused_in_one_line(
    tmp_path,
):
    ckpt = tmp_path / "ckpt"
    run_gpt(2, *COMMON, "--train-iters", "2", "--save", str(ckpt), "--save-interval", "2",
            "--diffckpt-mode", "lowdiff")  # fmt: skip
    proc = run_gpt(2, *COMMON, "--tensor-model-parallel-size", "2", "--train-iters", "4",
                   "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "2",
                   "--diffckpt-mode", "lowdiff", check=False)  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "exitcode  : 2" in log, log[-3000:]
    error = re.search(r"pretrain_gpt.py: error: (.*)", log)
    assert error, log[-3000:]
    assert "was saved under TP=1 PP=1 in the distributed optimizer's dp_reshardable" in error[1]
    assert f"megatron-diffckpt merge {ckpt} --iteration 2 --reshardable --out DIR2" in error[1]
    assert not re.search(r"\[rank\d\]: Traceback", log), log[-3000:]


@pytest.mark.distributed
def test_the_topk_residuals_are_dropped_with_a_note(tmp_path):
    ckpt, merged = tmp_path / "ckpt", tmp_path / "merged"
    run_gpt(2, *COMMON, "--train-iters", "3", "--save", str(ckpt), "--save-interval", "2",
            "--diffckpt-mode", "lowdiff", "--diffckpt-compressor", "topk")  # fmt: skip
    merge = run_cli("merge", str(ckpt), "--out", str(merged), "--reshardable", "--quiet")
    assert merge.returncode == 0, merge.stdout + merge.stderr
    assert "note: dropped the error-feedback residuals" in merge.stdout
    tensors = read_metadata(str(merged / "iter_0000003")).state_dict_metadata
    assert not any("diffckpt_error_feedback" in k for k in tensors)


MOE = "--num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall".split()
MOE += ["--disable-bias-linear"]


EP2 = ["--expert-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def from_moe_ep2(tmp_path_factory):
    """A mixture of experts (4 experts, top-2, alltoall, two experts on each rank): its ranks
    step two optimizers, the dense one over DP 2 and the experts' over their expert-data-parallel
    groups of one rank."""
    return _source(tmp_path_factory.mktemp("from_moe_ep2"), 2, [*MOE, *EP2])


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [2, 1], ids=["ep1-dp2", "ep1-dp1"])
def test_a_mixture_of_experts_merged_at_ep2_resumes_exactly_at_ep1(tmp_path, from_moe_ep2, nproc):
    """The two optimizers' state in model space (unprefixed keys, one param-groups entry per
    inner optimizer in ``common.pt``) loads into EP=1's one optimizer, every expert on every
    rank: every model tensor, main parameter and Adam moment ``torch.equal`` to the
    uninterrupted EP=2 run's at T; losses after it within 2%."""
    merged, target, expected, straight_losses = from_moe_ep2
    tensors = read_metadata(str(merged / f"iter_{target:07d}")).state_dict_metadata
    assert not any(k.startswith("chained_") for k in tensors), sorted(tensors)  # no flat buckets
    experts = [k for k in tensors if k.startswith("optimizer.state.param.") and ".experts." in k]
    assert len(experts) == 2, sorted(tensors)  # fc1 and fc2 of the stacked layers' experts
    got, proc = _resume(merged, tmp_path, target, nproc, MOE)
    _assert_same_model_space(expected, got)
    losses = _losses(proc)
    assert sorted(losses) == list(range(target + 1, target + MORE + 1)), proc.stderr[-3000:]
    for it, loss in losses.items():
        assert abs(loss - straight_losses[it]) <= 0.02 * straight_losses[it], (it, loss)


@pytest.mark.distributed
def test_a_mixture_of_experts_merged_at_ep1_resumes_exactly_at_ep2(tmp_path):
    """The other way: EP=1's one optimizer (experts among the dense parameters' groups) into
    EP=2's two, the experts' optimizer taking its param groups from their dense twins."""
    merged, target, expected, _ = _source(tmp_path / "src", 2, MOE)
    got, _ = _resume(merged, tmp_path, target, 2, [*MOE, *EP2])
    _assert_same_model_space(expected, got)
