"""Megatron-LM's own GPT pretraining (``megatron.training``) with differential checkpointing.

Needs a Megatron-LM checkout of the installed megatron-core's release in ``MEGATRON_LM`` and the
packages of ``requirements/megatron-lm.txt``; ``make test`` (and so CI) finds the shared checkout
beside the repository, ``make megatron-lm-test`` runs these alone. Without a checkout every test
here skips and says so.

Megatron-LM's ``pretrain_gpt.py`` runs on 2 CPU processes (gloo, CPU mode), for three layouts
(DP 2 with overlapped reduction and async save, TP 2 in bf16, PP 2), against an uninterrupted
stock run of the same job that saves every iteration:

- LowDiff: killed with SIGKILL after its base at 5; the restart replays the differentials and
  trains to 12; its final checkpoint (every tensor of Megatron-LM's own save: model, main
  parameters, Adam moments; its RNG states and optimizer step) and its losses equal the
  uninterrupted run's, ``torch.equal``. The killed run's folder also merges offline into a stock
  base equal to the uninterrupted run's at 8, which stock Megatron-LM resumes.
- LowDiff+: its base at 10, written from the host replica through Megatron-LM's save path,
  equals stock Megatron-LM's save at 10 tensor by tensor (so the replica equals the training
  state); killed while merging after 11, stock Megatron-LM resumes from its base exactly, merge
  gives the state at the newest differential, and the restart recovers and ends equal to the
  uninterrupted run.
- LowDiff with the top-k exchange (DP 2): killed after 8; the state at the recovered iteration
  (merged offline, and the loss the restart computes from it) equals the uninterrupted
  compressed run's, and training after it stays within 2% (the error-feedback residuals come
  from the base).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import (
    LAUNCH,
    REPO,
    RUN_TIMEOUT_S,
    _env,
    assert_help_lists_every_flag,
    outliving_a_killed_rank,
    run_cli,
    run_gpt,
    run_script,
    run_until_killed,
    tracker_at,
)

from megatron_diffckpt.patches.base import installed_megatron_core_version, release_order

MEGATRON_LM = os.environ.get("MEGATRON_LM", "")
SCRIPT = REPO / "examples" / "gpt" / "pretrain_gpt_diffckpt.py"
_NEEDED = ("six", "regex", "yaml", "pydantic", "triton")
_MISSING = [m for m in _NEEDED if not importlib.util.find_spec(m)]

pytestmark = pytest.mark.skipif(
    not (MEGATRON_LM and (Path(MEGATRON_LM) / "megatron" / "training").is_dir()) or _MISSING,
    reason="needs a Megatron-LM checkout in MEGATRON_LM and requirements/megatron-lm.txt "
    f"(missing: {_MISSING or 'MEGATRON_LM'}): `make megatron-lm-test MEGATRON_LM=<checkout>`",
)

TOTAL = 12
KILL_AFTER = 8
GPT = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 "
    "--lr-warmup-iters 2 --lr-decay-iters 100 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 256 --log-interval 1 --eval-iters 0 --eval-interval 1000 --seed 1234 "
    "--use-distributed-optimizer"
).split()
# Megatron-LM saves asynchronously only with its persistent worker (without it, it warns and saves
# synchronously); from 0.19 on its async save goes through NVIDIA's resiliency extension unless
# megatron-core's own strategy is named (the extension is not installed here).
ASYNC_SAVE = "--async-save --use-persistent-ckpt-worker" + (
    " --async-strategy mcore" if release_order(installed_megatron_core_version()) >= (0, 19) else ""
)
LAYOUTS = {  # flags, the two ranks' diff-log folders
    "dp2-async-save": (f"--overlap-grad-reduce {ASYNC_SAVE}", ("rank_0_0_0", "rank_0_0_1")),
    "tp2-bf16": ("--tensor-model-parallel-size 2 --bf16", ("rank_0_0_0", "rank_1_0_0")),
    "pp2": ("--pipeline-model-parallel-size 2", ("rank_0_0_0", "rank_0_1_0")),
    # mixture of experts, the experts replicated over data parallelism (EP=1)
    "moe-ep1-dp2": (
        "--overlap-grad-reduce --num-experts 4 --moe-router-topk 2 "
        "--moe-token-dispatcher-type alltoall --disable-bias-linear",
        ("rank_0_0_0", "rank_0_0_1"),
    ),
    "moe-ep2-dp2": (  # two experts on each rank
        "--overlap-grad-reduce --num-experts 4 --moe-router-topk 2 "
        "--moe-token-dispatcher-type alltoall --disable-bias-linear "
        "--expert-model-parallel-size 2",
        ("rank_0_0_0", "rank_0_0_1"),
    ),
}


def _losses(log: str) -> dict[int, str]:
    """``iteration -> lm loss`` as Megatron-LM logs it."""
    return {
        int(m.group(1)): m.group(2)
        for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|", log)
    }


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "dtype") and hasattr(a, "shape"):  # numpy arrays (NumPy's RNG state)
        return bool((a == b).all())
    return a == b


def _state_regions(diff_dir: Path) -> dict[str, torch.Tensor]:
    """Per flat optimizer tensor, the positions that hold state (not bucket padding, which
    megatron saves uninitialised), from the ranks' shard maps."""
    from megatron_diffckpt.shard_map import STATE_NAMES, read_shard_map

    regions: dict[str, list[tuple[int, int]]] = {}
    for rank_dir in sorted(diff_dir.glob("rank_*")):
        for inner in read_shard_map(str(rank_dir)).inner:
            for entry in (e for group in inner.groups for e in group):
                for key in (entry.main_key, *(entry.state_key(n) for n in STATE_NAMES)):
                    regions.setdefault(key, []).append((entry.main_offset, entry.numel))
    return regions


def _assert_same_checkpoint(expected: Path, got: Path, diff_dir: Path | None) -> None:
    """Every tensor (model; main parameters and Adam moments where they hold state), the RNG
    states and the optimizer's param groups (step; the learning rate and weight decay there are
    not compared: a merged base holds the last step's, a saved one the next step's, and loading
    sets them from the scheduler's step count) of two checkpoints are equal. The distributed
    optimizer's flat buckets are compared where ``diff_dir``'s shard maps place state."""
    from megatron_diffckpt.dist_ckpt_io import load_object, read_entries

    a, b = read_entries(str(expected)), read_entries(str(got))
    regions = _state_regions(diff_dir) if diff_dir is not None else None
    assert a.keys() == b.keys() and any("exp_avg_sq" in k for k in a)
    for key, value in a.items():
        if torch.is_tensor(value) and key.startswith("optimizer.") and regions is not None:
            assert key in regions, key
            for start, n in regions[key]:
                assert torch.equal(value[start : start + n], b[key][start : start + n]), key
        elif torch.is_tensor(value):
            assert torch.equal(value, b[key]), key
        elif key.startswith("rng_state"):
            assert _same(load_object(value), load_object(b[key])), key
        elif key.endswith(".optimizer/shard_0_1"):
            groups = [load_object(x)["param_groups"] for x in (value, b[key])]
            for g in (*groups[0], *groups[1]):
                g.pop("lr"), g.pop("weight_decay")
            assert groups[0] == groups[1], key


def _run(*args: str, torchrun: bool = False) -> str:
    proc = run_gpt(2, *args, script=SCRIPT, torchrun=torchrun)
    return proc.stdout + proc.stderr


def test_help_lists_every_diffckpt_flag_beside_megatron_lms():
    """Megatron-LM's in-process restart wrapper parses the flags before ``pretrain()``, without
    the ``--diffckpt-*`` ones: the entry shows Megatron-LM's help with them."""
    proc = run_script("--help", script=SCRIPT)
    assert_help_lists_every_flag(proc)
    assert "--tensor-model-parallel-size" in proc.stdout


@pytest.mark.distributed
def test_drift_checks_pass_against_the_checkout():
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
        "from megatron_diffckpt import cpu_mode; cpu_mode.enable()\n"
        f"sys.path.append({MEGATRON_LM!r})\n"
        "from megatron_diffckpt.integrations import megatron_lm as megatron_training\n"
        "megatron_training.check_drift(); cpu_mode._training_patches().check_drift()\n"
        "print('drift ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300
    )
    assert "drift ok" in proc.stdout, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory):
    """Per layout, on first use: an uninterrupted stock run of TOTAL iterations that saves every
    iteration (saving changes no training state), and its losses."""
    done: dict[str, tuple[Path, dict[int, str]]] = {}

    def get(layout: str) -> tuple[Path, dict[int, str]]:
        if layout not in done:
            flags, _ = LAYOUTS[layout]
            out = tmp_path_factory.mktemp(f"straight-{layout}")
            log = _run(*GPT, *flags.split(), "--train-iters", str(TOTAL), "--save", str(out),
                       "--save-interval", "1")  # fmt: skip
            losses = _losses(log)
            assert sorted(losses) == list(range(1, TOTAL + 1))
            del losses[2]  # Megatron-LM's second log line averages iterations 1 and 2
            done[layout] = (out, losses)
        return done[layout]

    return get


def _assert_stock_resumes_as_from(
    gpt: list[str], load: Path, straight: Path, at: int, tmp, reference: bool = True
):
    """Stock Megatron-LM (differential checkpointing off) resumes from ``load``'s newest base
    (at ``at``): it loads it and trains on; with ``reference``, exactly as from the uninterrupted
    run's own save at ``at``: the same loss at ``at + 1``. (Not the uninterrupted run's loss:
    building the data iterators after a load draws from torch's generator, so a stock resume on
    CPU, where dropout draws from it too, differs from straight training; the integration
    restores the generators, stock does not.)"""
    folders = [load]
    if reference:
        folders.append(tmp / f"stock-{at}")
        shutil.copytree(straight / f"iter_{at:07d}", folders[1] / f"iter_{at:07d}")
        (folders[1] / "latest_checkpointed_iteration.txt").write_text(str(at))
    losses = []
    for folder in folders:
        log = _run(*gpt, "--train-iters", str(TOTAL), "--exit-interval", str(at + 1),
                   "--load", str(folder))  # fmt: skip
        assert re.search(rf"loaded checkpoint from .* at iteration {at}", log), log[-3000:]
        assert f"consumed samples: {8 * (at + 1):12d}" in log
        losses.append(_losses(log))
    assert sorted(losses[0]) == [at + 1] and losses[0] == losses[-1]


def _kill_after(args: list[str], ckpt: Path, rank_dirs, at: int, *also) -> None:
    """Train to TOTAL and SIGKILL every process once ``at`` is logged, the ranks' differentials
    of ``at`` are durable and ``also`` exist (paths) or hold (conditions)."""
    durable = [ckpt / "diffckpt" / name / f"seg_{at:010d}_{at:010d}.bin" for name in rank_dirs]
    run_until_killed([*args, "--train-iters", str(TOTAL)], at, [*durable, *also], SCRIPT)


def _assert_merge_equals(ckpt: Path, at: int, straight: Path, tmp: Path) -> Path:
    """``megatron-diffckpt merge`` of ``ckpt`` at ``at`` equals the uninterrupted run's save at
    ``at``; returns the merged folder."""
    merged = tmp / "merged"
    proc = run_cli("merge", str(ckpt), "--iteration", str(at), "--out", str(merged), "--quiet")
    assert proc.returncode == 0, proc.stderr
    name = f"iter_{at:07d}"
    _assert_same_checkpoint(straight / name, merged / name, ckpt / "diffckpt")
    return merged


def _recover(args: list[str], ckpt: Path, base: str) -> tuple[int, dict[int, str], str]:
    """Restart with ``--load ckpt``: the iteration it recovered to from ``base``, the losses it
    logged after it, and its log."""
    log = _run(*args, "--train-iters", str(TOTAL), "--load", str(ckpt))
    recovered = re.search(rf"recovered to iteration (\d+) \(base {base}\)", log)
    assert recovered, log[-4000:]
    start = int(recovered.group(1))
    return start, _resumed_losses(log, start), log


def _assert_same_losses(got: dict[int, str], expected: dict[int, str], trained: bool = True):
    """The losses both runs logged for the same iterations are equal (as printed); ``trained``:
    the resumed run logged some (not when it recovered onto its last iteration)."""
    common = [i for i in got if i in expected]
    assert common or not trained
    assert {i: got[i] for i in common} == {i: expected[i] for i in common}


def _resumed_losses(log: str, start: int) -> dict[int, str]:
    """The losses a resumed run logged, less the line Megatron-LM averages: a process's first
    log line does not reset its accumulators, so with --log-interval 1 its second line averages
    the losses of its first two iterations (its own logging, with or without this package; the
    uninterrupted runs' line at 2 is left out for the same reason)."""
    losses = _losses(log)
    assert sorted(losses) == list(range(start + 1, TOTAL + 1)), log[-3000:]
    losses.pop(start + 2, None)
    return losses


@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_lowdiff_sigkill_then_recovery_then_merge_equal_uninterrupted_training(
    tmp_path, layout, straight_runs
):
    flags, rank_dirs = LAYOUTS[layout]
    gpt = [*GPT, *flags.split()]
    straight, expected_losses = straight_runs(layout)

    ckpt = tmp_path / "ckpt"
    diff = ["--save", str(ckpt), "--save-interval", "5", "--diffckpt-mode", "lowdiff"]
    # Killed once base 5 is the tracker's: an async save is finalized some iterations after it
    # was scheduled (when every rank's writer is done), on a loaded machine after 8.
    _kill_after([*gpt, *diff], ckpt, rank_dirs, KILL_AFTER, tracker_at(ckpt, 5))
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert len(list((ckpt / "diffckpt").glob("rank_*/shard_map.json"))) == 2

    # Offline: base 5 + differentials 6-8 into a stock base equal to the one training saved at 8,
    merged = _assert_merge_equals(ckpt, 8, straight, tmp_path)
    # ...which stock Megatron-LM (differential checkpointing off) resumes from.
    _assert_stock_resumes_as_from(gpt, merged, straight, 8, tmp_path)

    # Restart with --load: Megatron-LM loads base 5, the hooks replay up to the newest
    # iteration both ranks hold, and training goes on to TOTAL.
    start, losses, log = _recover([*gpt, *diff], ckpt, "5")
    assert ("scheduled an async checkpoint save" in log) == ("--async-save" in gpt)
    # Observability: Megatron-LM's timer for the differential, and the manager's metrics.
    assert "diffckpt-diff" in log
    assert re.search(r"diffckpt at iteration 12 \| recoverable lag: \d+ \| diff bytes per", log)
    assert start >= KILL_AFTER - 1
    _assert_same_losses(losses, expected_losses)
    final = f"iter_{TOTAL:07d}"
    _assert_same_checkpoint(straight / final, ckpt / final, ckpt / "diffckpt")


@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_lowdiff_plus_bases_equal_stock_saves_and_recovery_is_exact(
    tmp_path, layout, straight_runs
):
    flags, rank_dirs = LAYOUTS[layout]
    gpt = [*GPT, *flags.split()]
    straight, expected_losses = straight_runs(layout)

    ckpt = tmp_path / "ckpt"
    plus = ["--save", str(ckpt), "--save-interval", "5", "--diffckpt-mode", "lowdiff-plus"]
    # SIGKILL (the merger runs all the time) after 11, once the replica's base 10 is complete.
    _kill_after([*gpt, *plus], ckpt, rank_dirs, 11, ckpt / "iter_0000010" / "metadata.json")
    tracker = (ckpt / "latest_checkpointed_iteration.txt").read_text()
    assert tracker in ("5", "10")  # killed before or after the tracker moved to 10

    # The bases the replica wrote through Megatron-LM's save path are stock Megatron-LM's saves of
    # the training state, tensor by tensor.
    for base in sorted({"10", tracker}):
        name = f"iter_{int(base):07d}"
        _assert_same_checkpoint(straight / name, ckpt / name, ckpt / "diffckpt")
    # Stock Megatron-LM (differential checkpointing off) resumes from the replica's bases (no
    # reference resume: what it loads, tensors and RNG states, equals stock's save, and Megatron-LM
    # wrote the rest itself; a merged base, whose common state the merge writes, has one above).
    _assert_stock_resumes_as_from(gpt, ckpt, straight, int(tracker), tmp_path, reference=False)
    # Offline merge of the LowDiff+ run: the state at 11 from the newest base and the dense
    # differentials the merger logged.
    _assert_merge_equals(ckpt, 11, straight, tmp_path)

    # Restart with LowDiff+: base + differentials, then training to TOTAL; its final base (from
    # the replica again) equals the uninterrupted run's.
    start, losses, log = _recover([*gpt, *plus], ckpt, tracker)
    assert start >= 11
    _assert_same_losses(losses, expected_losses, trained=start < TOTAL)
    assert start == TOTAL or "merge backlog" in log  # the metrics line, when it trained on
    if layout == "pp2" and TOTAL - start >= 2:  # copies issued while a stage waits on its peer
        traces = sorted((ckpt / "diffckpt" / "trace").glob("rank_*.json"))
        shares = [json.loads(t.read_text())["summary"]["share_in_bubbles"] for t in traces]
        assert len(shares) == 2 and max(shares) > 0, shares
    final = f"iter_{TOTAL:07d}"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(TOTAL)
    _assert_same_checkpoint(straight / final, ckpt / final, ckpt / "diffckpt")


def _killed_under_the_launcher(args: list[str], failpoint: str, delay: str = "") -> str:
    """Train to TOTAL under the node launcher with a keeper and one torchrun restart, rank 1
    killed at ``failpoint`` (``NAME:N@1``), ``delay`` the delay point's spec (``DIFFCKPT_DELAY``);
    the log from the kill on (the restarted attempt's lines come after it)."""
    cmd = [str(LAUNCH), "--keeper-memory", "64", "--standalone"]
    cmd += ["--nproc-per-node", "2", "--max-restarts", "1", str(SCRIPT), *args]
    cmd += ["--train-iters", str(TOTAL)]
    env = dict(_env(), DIFFCKPT_FAILPOINT=failpoint, DIFFCKPT_DELAY=delay)
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=RUN_TIMEOUT_S)  # fmt: skip
    log = proc.stdout
    assert proc.returncode == 0, log[-4000:]
    name, nth = failpoint.split("@")[0].split(":")
    return log[log.index(f"failpoint {name} #{nth}: SIGKILL of rank 1") :]


@pytest.mark.distributed
@pytest.mark.parametrize("base", [5, 0], ids=["base-5-published", "base-5-unpublished"])
def test_lowdiff_plus_with_its_replica_in_the_keeper_recovers_past_the_base_exactly(
    tmp_path, straight_runs, base
):
    """Megatron-LM's loop under the node launcher with a keeper and torchrun's restarts, the
    replica in the keeper: rank 1 dies before handing iteration 9 over; the restarted ranks
    (Megatron-LM loads base 5, or base 0 when base 5 was still being written at the kill: its
    write slowed on purpose) take the keepers' replicas at 8, and the final checkpoint (its
    files written by the keepers) and the losses equal the uninterrupted run's. The diff log
    the keepers wrote (6 and 7 before the kill, 8 as the recovery settled, on after it) merges
    offline into a base equal to the uninterrupted run's save at 8."""
    layout = "dp2-async-save"
    gpt = [*GPT, *LAYOUTS[layout][0].split()]
    straight, expected_losses = straight_runs(layout)
    ckpt = tmp_path / "ckpt"
    plus = ["--save", str(ckpt), "--load", str(ckpt), "--save-interval", "5"]
    plus += ["--diffckpt-mode", "lowdiff-plus"]  # --diffckpt-keeper auto: the replica there
    plus += ["--diffckpt-option", "keeper_writes_bases=true"]
    # base 5 published before the kill at 9 on a machine that keeps up; with rank 0's base
    # writes slowed by 10 s (base 0's too, which base 5 waits for), base 5 never is
    slow = "" if base == 5 else "base-write:10@0"
    restarted = _killed_under_the_launcher([*gpt, *plus], "plus-hand-over:9@1", slow)
    kept = "recovery: iteration 8 from the replica in the node's keeper"
    assert kept in restarted, restarted[-4000:]
    loaded = re.findall(r"recovered to iteration 8 \(base (\d+)\)", restarted)
    if base == 5:  # published in time on a loaded machine too? not guaranteed: say which
        assert loaded and loaded[0] in ("0", "5"), restarted[-6000:]
    else:
        assert loaded == ["0", "0"], restarted[-6000:]
    # the keepers wrote the final base's files (compared below)
    assert f"base of iteration {TOTAL} published (written by the node's keeper" in restarted
    assert "writes its base's files itself" not in restarted
    _assert_same_losses(_resumed_losses(restarted, 8), expected_losses)
    final = f"iter_{TOTAL:07d}"
    _assert_same_checkpoint(straight / final, ckpt / final, ckpt / "diffckpt")
    _assert_merge_equals(ckpt, 8, straight, tmp_path)


@pytest.mark.distributed
@pytest.mark.parametrize("kept", ["base", "replica"])
def test_lowdiff_recovers_from_the_keepers_base_newer_than_the_one_megatron_lm_loaded(
    tmp_path, straight_runs, kept
):
    """LowDiff in Megatron-LM's loop under the node launcher with a keeper, asynchronous saves:
    rank 1 dies right after its keeper acknowledged base 10, before Megatron-LM finalized the
    save. The restarted ranks (Megatron-LM loads base 5) take the keepers' base 10 in place of
    base 5 (nothing to replay: 10 is the newest iteration both ranks ended), or with
    ``--diffckpt-keeper auto`` alone (the replica) the keepers' replicas at 10, and the final
    checkpoint and the losses equal the uninterrupted run's. The keepers write the diff log
    either way."""
    layout = "dp2-async-save"
    gpt = [*GPT, *LAYOUTS[layout][0].split()]
    straight, expected_losses = straight_runs(layout)
    ckpt = tmp_path / "ckpt"
    diff = ["--save", str(ckpt), "--load", str(ckpt), "--save-interval", "5"]
    diff += ["--diffckpt-mode", "lowdiff"]
    diff += [] if kept == "replica" else ["--diffckpt-option", "keeper_replica=false"]
    restarted = _killed_under_the_launcher([*gpt, *diff], "base-kept:2@1")
    loaded = re.search(r"loaded checkpoint from .* at iteration (\d+)", restarted)
    # base 10 is never finalized: the killed rank could not take part
    assert loaded is not None and loaded[1] == "5", restarted[-4000:]
    served = {
        "base": r"base of iteration 10 from the node's keeper in [\d.]+ s",
        "replica": r"iteration 10 from the replica in the node's keeper in [\d.]+ s \(nothing "
        r"replayed;",
    }[kept]
    assert re.search(rf"recovery: {served} \(?storage's newest base: 5, not read\)", restarted), (
        restarted[-4000:]
    )
    assert "replayed 0 differential(s)" in restarted
    assert re.search(r"recovered to iteration 10 \(base 5\)", restarted)
    if kept == "base":  # the keepers wrote the restarted ranks' diff log (its segments exist)
        assert "keeper: writes the diff log of rank_0_0_1 from iteration 11" in restarted
        assert sorted((ckpt / "diffckpt" / "rank_0_0_1").glob("seg_*"))
    _assert_same_losses(_resumed_losses(restarted, 10), expected_losses)
    final = f"iter_{TOTAL:07d}"
    _assert_same_checkpoint(straight / final, ckpt / final, ckpt / "diffckpt")


@pytest.mark.distributed
def test_recovered_onto_its_last_iteration_the_job_still_ends_with_its_final_base(
    tmp_path, straight_runs
):
    """Megatron-LM saves at the end of training only off multiples of --save-interval: a job
    killed after its last iteration (10) but before base 10 was published recovers to 10 and
    saves that base, from the replica, equal to stock Megatron-LM's save at 10."""
    flags, rank_dirs = LAYOUTS["dp2-async-save"]
    straight, _ = straight_runs("dp2-async-save")
    ckpt = tmp_path / "ckpt"
    args = [*GPT, *flags.split(), "--save", str(ckpt), "--save-interval", "5",
            "--diffckpt-mode", "lowdiff-plus"]  # fmt: skip
    durable = [ckpt / "diffckpt" / n / "seg_0000000010_0000000010.bin" for n in rank_dirs]
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    run_until_killed([*args, "--train-iters", "10"], 10, [*durable, tracker_at(ckpt, 5)], SCRIPT)
    base = tracker.read_text()
    log = _run(*args, "--train-iters", "10", "--load", str(ckpt))
    assert re.search(rf"recovered to iteration 10 \(base {base}\)", log), log[-3000:]
    if base == "5":  # killed before base 10 was published (the usual case)
        assert "saving the base of iteration 10 (the recovered iteration)" in log
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "10"
    _assert_same_checkpoint(straight / "iter_0000010", ckpt / "iter_0000010", ckpt / "diffckpt")


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["lowdiff", "lowdiff-plus"])
def test_killed_before_its_first_interval_base_the_job_recovers_from_its_start(
    tmp_path, mode, straight_runs
):
    """A job from scratch saves its starting point (base 0) as it starts: killed after
    iteration 2, long before its first --save-interval base, it loses at most B iterations
    (LowDiff) or B + --diffckpt-option max_pending (LowDiff+), and ends equal to uninterrupted
    training."""
    flags, rank_dirs = LAYOUTS["dp2-async-save"]
    straight, expected_losses = straight_runs("dp2-async-save")
    ckpt = tmp_path / "ckpt"
    args = [*GPT, *flags.split(), "--save", str(ckpt), "--save-interval", "10",
            "--diffckpt-mode", mode]  # fmt: skip
    killed = run_until_killed(
        [*args, "--train-iters", str(TOTAL)], 2, [tracker_at(ckpt, 0)], SCRIPT
    )
    last = max(int(i) for i in re.findall(r"iteration +(\d+)/", killed))
    start, losses, _ = _recover(args, ckpt, "0")
    assert last - start <= (1 if mode == "lowdiff" else 3), (last, start)
    _assert_same_losses(losses, expected_losses)
    final = f"iter_{TOTAL:07d}"
    _assert_same_checkpoint(straight / final, ckpt / final, ckpt / "diffckpt")


@pytest.mark.distributed
def test_topk_exchange_sigkill_then_recovery_of_the_state_at_t(tmp_path):
    """LowDiff with compressed training: the state at the recovered iteration is exact."""
    gpt = [*GPT, "--overlap-grad-reduce", "--diffckpt-compressor", "topk",
           "--diffckpt-topk-ratio", "0.1"]  # fmt: skip
    straight = tmp_path / "straight"  # compressed training, no differentials
    log = _run(*gpt, "--train-iters", str(TOTAL), "--save", str(straight), "--save-interval", "1")
    expected_losses = _losses(log)
    assert sorted(expected_losses) == list(range(1, TOTAL + 1))

    ckpt = tmp_path / "ckpt"
    diff = ["--save", str(ckpt), "--save-interval", "5", "--diffckpt-mode", "lowdiff"]
    _kill_after([*gpt, *diff], ckpt, ("rank_0_0_0", "rank_0_0_1"), KILL_AFTER)
    # The differentials are the sparse optimizer input: far smaller than the dense shard.
    segment = (ckpt / "diffckpt" / "rank_0_0_0" / "seg_0000000008_0000000008.bin").stat().st_size
    assert segment < 0.5 * _shard_bytes(ckpt / "diffckpt" / "rank_0_0_0")

    _assert_merge_equals(ckpt, 8, straight, tmp_path)  # the state at 8: base 5 + 6-8

    start, losses, _ = _recover([*gpt, *diff], ckpt, "5")
    assert start >= KILL_AFTER
    # The first iteration after recovery computes its loss from the recovered state: exact.
    assert losses[start + 1] == expected_losses[start + 1]
    # After it the residuals (the base's, not T's) make training differ, slightly.
    for i, value in losses.items():
        assert abs(float(value) - float(expected_losses[i])) <= 0.02 * float(expected_losses[i])


def _shard_bytes(rank_dir: Path) -> int:
    """Bytes of this rank's dense fp32 optimizer-shard gradient (from its shard map)."""
    from megatron_diffckpt.shard_map import read_shard_map

    return 4 * sum(
        e.numel for inner in read_shard_map(str(rank_dir)).inner for g in inner.groups for e in g
    )


@pytest.mark.distributed
def test_recovery_is_exact_with_megatrons_plain_optimizer_too(tmp_path):
    """Without --use-distributed-optimizer: recovery is exact; merge refuses (no shard map)."""
    gpt = [*GPT, "--overlap-grad-reduce"]
    gpt.remove("--use-distributed-optimizer")
    straight, ckpt = tmp_path / "straight", tmp_path / "ckpt"
    log = _run(*gpt, "--train-iters", str(TOTAL), "--save", str(straight), "--save-interval", "6")
    expected_losses = _losses(log)
    diff = ["--save", str(ckpt), "--save-interval", "5", "--diffckpt-mode", "lowdiff"]
    _kill_after([*gpt, *diff], ckpt, ("rank_0_0_0", "rank_0_0_1"), KILL_AFTER)
    assert not list((ckpt / "diffckpt").glob("rank_*/shard_map.json"))
    proc = run_cli("merge", str(ckpt), "--out", str(tmp_path / "merged"))
    assert proc.returncode == 1 and "shard map" in proc.stderr

    start, losses, _ = _recover([*gpt, *diff], ckpt, "5")
    _assert_same_losses(losses, expected_losses)
    final = f"iter_{TOTAL:07d}"
    _assert_same_checkpoint(straight / final, ckpt / final, None)


@pytest.mark.distributed
def test_auto_tune_moves_megatron_lms_save_interval(tmp_path):
    """--diffckpt-auto-tune in Megatron-LM's loop: decisions logged with their inputs, and
    Megatron-LM's saves follow the agreed F (its --save-interval)."""
    ckpt = tmp_path / "ckpt"
    log = _run(*GPT, "--train-iters", "24", "--save", str(ckpt), "--save-interval", "3",
               "--diffckpt-mode", "lowdiff", "--diffckpt-auto-tune", "--diffckpt-option",
               "retune_interval=4", "--diffckpt-mtbf-hours", "1000")  # fmt: skip
    assert re.search(r"auto-tune at iteration 4: proposes F 3 -> \d+, B 1 -> \d+ .* from: ", log)
    changes = {
        int(m[1]): int(m[2])
        for m in re.finditer(r"auto-tune at iteration (\d+): F \d+ -> (\d+)", log)
    }
    assert changes, "the tuner never changed F"
    saved = sorted({int(m) for m in re.findall(r"saved checkpoint from iteration +(\d+) ", log)})
    expected, f = [0], 3  # a job from scratch saves its starting point
    for it in range(1, 25):  # Megatron-LM's rule, with the interval decided after the step
        f = changes.get(it, f)
        if it % f == 0 or it == 24:
            expected.append(it)
    assert saved == expected, (saved, expected, changes)


@pytest.mark.distributed
def test_a_base_of_another_model_is_refused_in_one_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    _run(*GPT, "--train-iters", "2", "--save", str(ckpt), "--save-interval", "2")
    wider = [*GPT, "--train-iters", "4", "--load", str(ckpt)]
    wider[wider.index("--hidden-size") + 1] = "128"
    proc = run_gpt(2, *wider, script=SCRIPT, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "exitcode: 2" in log, log[-3000:]
    error = r"pretrain_gpt_diffckpt.py: error: \S+ holds another model than this run builds: "
    assert re.search(error + r"\S+ is \[\d+, 64\] there, \[\d+, 128\] here", log), log[-3000:]
    assert "megatron/core/dist_checkpointing" not in log.split("exitcode: 2")[0]


@pytest.mark.distributed
@pytest.mark.parametrize("checkout", [None, "not-a-checkout"])
def test_without_a_megatron_lm_checkout_every_rank_says_so_in_one_line(tmp_path, checkout):
    """Under torchrun, which runs the ranks unbuffered: each rank's line whole, exit code 2."""
    env = {k: v for k, v in _env().items() if k != "MEGATRON_LM"}
    if checkout is not None:
        env["MEGATRON_LM"] = str(tmp_path / checkout)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(SCRIPT), *GPT]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    said = (
        "set MEGATRON_LM to a Megatron-LM checkout (the folder holding pretrain_gpt.py and "
        "megatron/training)"
        if checkout is None
        else f"MEGATRON_LM={tmp_path / checkout} is not a Megatron-LM checkout"
    )
    lines = [line for line in proc.stderr.splitlines() if "pretrain_gpt_diffckpt.py: " in line]
    assert lines == [f"pretrain_gpt_diffckpt.py: {said}"] * 2, proc.stderr[-3000:]
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.distributed
def test_unsupported_settings_are_refused_with_the_flag_to_change(tmp_path):
    gpt = list(GPT)
    gpt.remove("--use-distributed-optimizer")
    proc = run_gpt(2, *gpt, "--train-iters", "2", "--save", str(tmp_path), "--save-interval", "5",
                   "--diffckpt-mode", "lowdiff-plus", script=SCRIPT, check=False)  # fmt: skip
    assert proc.returncode != 0
    assert "needs --use-distributed-optimizer" in proc.stdout + proc.stderr


@pytest.mark.distributed
@pytest.mark.parametrize("when_full", ["skip", "block"])
def test_a_full_save_skips_its_bases_or_stops_in_one_line(tmp_path, tmpfs, when_full):
    """``--save`` on a 1 MiB tmpfs: no base fits, and base 0 fails inside megatron's write on
    every rank (in the finalize step of Megatron-LM's ``--async-save`` with skip; in its
    synchronous save with block). skip: one warning, training to the end; block: one line, exit
    2; either way no partial base, and with space the same command trains and ``verify``
    passes. Under torchrun, as a user sees it."""
    save = tmpfs("save", "1m")
    flags = ["--overlap-grad-reduce", *ASYNC_SAVE.split()] if when_full == "skip" else []
    args = [*GPT, *flags, "--save", str(save), "--load", str(save), "--save-interval", "4",
            "--diffckpt-mode", "lowdiff", "--diffckpt-when-full", when_full,
            "--train-iters", "6"]  # fmt: skip
    proc = run_gpt(2, *args, script=SCRIPT, check=False, torchrun=True)
    log = proc.stdout + proc.stderr
    if when_full == "skip":
        assert proc.returncode == 0, log[-4000:]
        warned = re.findall(
            r"WARNING:\S+storage under \S+ is full \(.*?\): base (\d+) was NOT", log
        )
        assert warned == ["0"], log[-4000:]  # one warning, on rank 0
    else:
        assert proc.returncode != 0 and "exitcode  : 2" in log, log[-4000:]
        error = r"pretrain_gpt_diffckpt.py: error: base 0 cannot be written under \S+ \("
        assert re.search(error, log), log[-4000:]
    # One line, no traceback of a rank (torchrun's own, of the exit code 2, starts in runpy).
    tracebacks = re.findall(r"Traceback \(most recent call last\):\n\s*File \"([^\"]+)\"", log)
    assert set(tracebacks) <= {"<frozen runpy>"}, log[-4000:]
    assert not list(save.glob("iter_*")), list(save.iterdir())
    tmpfs.grow(save)
    _run(*args, torchrun=True)
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "6"
    verify = run_cli("verify", str(save))
    assert verify.returncode == 0, verify.stdout + verify.stderr


@pytest.mark.distributed
def test_a_merged_reshardable_state_resumes_under_another_layout(tmp_path, straight_runs):
    """SIGKILL of a DP 2 run after iteration 8, `merge --reshardable`, and Megatron-LM's own
    load under TP 2 (it reads the optimizer format from the checkpoint): training goes on, its
    losses within 2% of the uninterrupted DP 2 run's (Megatron-LM drops the RNG states of
    another TP/PP layout, so dropout draws differ). A dp_reshardable base under TP 2 is refused
    in one line naming that merge."""
    flags, rank_dirs = LAYOUTS["dp2-async-save"]
    straight, expected = straight_runs("dp2-async-save")
    ckpt, merged = tmp_path / "ckpt", tmp_path / "merged"
    args = [*GPT, *flags.split(), "--save", str(ckpt), "--save-interval", "5",
            "--diffckpt-mode", "lowdiff"]  # fmt: skip
    _kill_after(args, ckpt, rank_dirs, KILL_AFTER)
    merge = run_cli("merge", str(ckpt), "--iteration", str(KILL_AFTER), "--out", str(merged),
                    "--reshardable", "--quiet")  # fmt: skip
    assert merge.returncode == 0, merge.stdout + merge.stderr
    # Megatron-LM pads the vocabulary to a multiple of 128 x TP by default: under TP 2 the
    # same padded size (384) takes --make-vocab-size-divisible-by 64.
    tp2 = [*GPT, "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64",
           "--save", str(merged), "--load", str(merged), "--save-interval", "5",
           "--diffckpt-mode", "lowdiff"]  # fmt: skip
    log = _run(*tp2, "--train-iters", str(TOTAL))
    assert "RNG state will be ignored" in log, log[-3000:]
    assert re.search(rf"loaded checkpoint from .* at iteration {KILL_AFTER}", log), log[-3000:]
    losses = _resumed_losses(log, KILL_AFTER)
    for it, loss in losses.items():
        assert abs(float(loss) - float(expected[it])) <= 0.02 * float(expected[it]), (it, loss)
    assert (merged / "latest_checkpointed_iteration.txt").read_text() == str(TOTAL)

    stock = tmp_path / "stock"  # the uninterrupted run's own base at 8: dp_reshardable
    shutil.copytree(straight / f"iter_{KILL_AFTER:07d}", stock / f"iter_{KILL_AFTER:07d}")
    (stock / "latest_checkpointed_iteration.txt").write_text(str(KILL_AFTER))
    tp2 = [str(stock) if a == str(merged) else a for a in tp2]  # --save and --load
    proc = run_gpt(2, *tp2, "--train-iters", str(TOTAL), script=SCRIPT, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "exitcode  : 2" in log, log[-3000:]
    assert re.search(r"pretrain_gpt_diffckpt.py: error: \S+ was saved under TP=1 PP=1 .*"
                     rf"megatron-diffckpt merge {stock} --iteration {KILL_AFTER} --reshardable",
                     log), log[-3000:]  # fmt: skip


@pytest.mark.distributed
def test_a_mixture_of_experts_merged_at_ep2_resumes_at_ep1(tmp_path, straight_runs):
    """SIGKILL of a MoE run at EP=2 (two optimizers per rank: dense over DP 2, experts over
    expert-data-parallel groups of one) after iteration 8, `merge --reshardable`, and
    Megatron-LM's own load at EP=1 (one optimizer, every expert on every rank): it loads the
    merged state at 8 and trains on, its losses within 2% of the uninterrupted EP=2 run's."""
    flags, rank_dirs = LAYOUTS["moe-ep2-dp2"]
    _, expected = straight_runs("moe-ep2-dp2")
    ckpt, merged = tmp_path / "ckpt", tmp_path / "merged"
    args = [*GPT, *flags.split(), "--save", str(ckpt), "--save-interval", "5",
            "--diffckpt-mode", "lowdiff"]  # fmt: skip
    _kill_after(args, ckpt, rank_dirs, KILL_AFTER)
    merge = run_cli("merge", str(ckpt), "--iteration", str(KILL_AFTER), "--out", str(merged),
                    "--reshardable", "--quiet")  # fmt: skip
    assert merge.returncode == 0, merge.stdout + merge.stderr
    ep1 = [*GPT, *LAYOUTS["moe-ep1-dp2"][0].split(), "--save", str(merged), "--load",
           str(merged), "--save-interval", "5", "--diffckpt-mode", "lowdiff"]  # fmt: skip
    log = _run(*ep1, "--train-iters", str(TOTAL))
    assert re.search(rf"loaded checkpoint from .* at iteration {KILL_AFTER}", log), log[-3000:]
    losses = _resumed_losses(log, KILL_AFTER)
    for it, loss in losses.items():
        assert abs(float(loss) - float(expected[it])) <= 0.02 * float(expected[it]), (it, loss)
    assert (merged / "latest_checkpointed_iteration.txt").read_text() == str(TOTAL)


@pytest.mark.distributed
def test_a_write_refused_on_one_rank_stops_megatron_lms_loop_in_one_line_per_rank(
    tmp_path, straight_runs
):
    """Megatron-LM's loop, LowDiff (TP 2, synchronous saves) under the launcher with one
    torchrun restart: where rank 0's file of base 10 goes, a folder stands (a write refused on
    one rank). Both ranks stop within seconds in one line naming rank 0 and its error; once
    the obstacle is gone the restart recovers, and the final checkpoint equals the
    uninterrupted run's."""
    from test_faults import stop_then_restart

    gpt = [*GPT, *LAYOUTS["tp2-bf16"][0].split()]
    straight, _ = straight_runs("tp2-bf16")
    ckpt = tmp_path / "ckpt"
    args = [*gpt, "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "5"]
    args += ["--diffckpt-mode", "lowdiff", "--train-iters", str(TOTAL)]
    blocker = ckpt / "iter_0000010" / "__0_0.distcp"
    stop_then_restart(
        args, lambda _pid: blocker.mkdir(parents=True), lambda: shutil.rmtree(blocker.parent),
        script=SCRIPT,
    )  # fmt: skip
    final = f"iter_{TOTAL:07d}"
    _assert_same_checkpoint(straight / final, ckpt / final, ckpt / "diffckpt")


@pytest.mark.distributed
def test_a_rank_killed_mid_training_leaves_its_peer_in_megatron_lms_loop_one_line(
    tmp_path, straight_runs
):
    """Megatron-LM's loop, LowDiff (TP 2) under the launcher with one torchrun restart: rank 1
    SIGKILLed from outside after iteration 7. Rank 0, whose next tensor-parallel collective
    finds its peer gone inside Megatron-LM's training step, ends in one line (not gloo's
    traceback); the restart recovers, and the final checkpoint equals the uninterrupted
    run's."""
    from test_faults import kill_a_rank_then_restart

    gpt = [*GPT, *LAYOUTS["tp2-bf16"][0].split()]
    straight, _ = straight_runs("tp2-bf16")
    ckpt = tmp_path / "ckpt"
    args = [*gpt, "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "5"]
    args += ["--diffckpt-mode", "lowdiff", "--train-iters", str(TOTAL)]
    kill_a_rank_then_restart(args, script=SCRIPT)
    final = f"iter_{TOTAL:07d}"
    _assert_same_checkpoint(straight / final, ckpt / final, ckpt / "diffckpt")


@pytest.mark.distributed
def test_no_process_of_a_killed_job_with_asynchronous_saves_outlives_torchrun(tmp_path):
    """Megatron-LM's loop, LowDiff, asynchronous saves through Megatron-LM's persistent worker
    (megatron-core 0.19 forks it from ``multiprocessing``'s fork server, and forks its writer's
    results manager while Megatron-LM initializes, before the manager starts), under plain
    torchrun: rank 1 SIGKILLed once base 4 is published, while its worker has a process of its
    own (0.16: a file writer the worker forked, which outlived the worker before and waited on
    its queues forever; 0.19: the worker). 10 s after torchrun exits nothing the job started is
    alive (the fork server and the worker included), and the named semaphores of the worker's
    queues are gone from /dev/shm (the ranks' resource trackers removed them)."""
    ckpt = tmp_path / "ckpt"
    args = [*GPT, *ASYNC_SAVE.split(), "--train-iters", "1000", "--save", str(ckpt)]
    args += ["--save-interval", "2", "--diffckpt-mode", "lowdiff"]
    left = outliving_a_killed_rank(SCRIPT, args, tracker_at(ckpt, 4), helpers_at_work=True)
    assert not left, f"{len(left)} process(es) or semaphore(s) of the killed job left: {left}"
