"""LowDiff+ end to end: real megatron-core on CPU processes (gloo).

- The host replica, merged from bucket snapshots, equals the training state bit for bit
  (``torch.equal``) for (TP, PP, DP) = (1, 1, 2) in bf16, (2, 1, 1), (1, 2, 1), with gradient
  clipping active; with PP = 2 the trace shows snapshot copies issued inside pipeline bubbles,
  and training itself is unchanged.
- A base written by the merger is a stock dist checkpoint: the example's plain loader
  (``dist_checkpointing.load`` with megatron's own sharded state dicts) loads it with
  differential checkpointing off, and training resumed from it equals straight training.
- SIGKILL while training (merges in flight) and SIGKILL while a base is being written: the newest
  published base is intact, and base + differentials recover the exact state.
"""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch
from launch import (
    OPTIMIZER_STATE,
    TINY_GPT,
    assert_same_state,
    load_dumps,
    recovered_iteration,
    run_gpt,
    run_script,
    run_until_killed,
    tracker_at,
)

from megatron_diffckpt import cli

LAYOUTS = {
    "tp1-pp1-dp2-bf16": "--overlap-grad-reduce --bf16",
    "tp2-pp1-dp1": "--tensor-model-parallel-size 2",
    "tp1-pp2-dp1": "--pipeline-model-parallel-size 2 --overlap-grad-reduce",
}
# rank, first iteration of a pause of the merger (max_merge_wait_ms)
PAUSED = r"\[rank(\d+)\].*iterations from (\d+) on are not merged until the next base"
# A clip far below the gradient norm (~0.8): every step scales its gradients.
COMMON = [*TINY_GPT, "--use-distributed-optimizer", "--clip-grad", "0.05", "--lr-decay-iters", "50"]


def _plus(ckpt, interval: int, *extra: str) -> list[str]:
    return [
        "--save",
        str(ckpt),
        "--diffckpt-mode",
        "lowdiff-plus",
        "--diffckpt-full-interval",
        str(interval),
        *extra,
    ]


def _assert_replica_equals_training(dump, nproc: int = 2) -> None:
    for rank in range(nproc):
        trained = torch.load(dump / f"rank_{rank}.pt", weights_only=True)
        replica = torch.load(dump / "replica" / f"rank_{rank}.pt", weights_only=True)
        assert len(trained["optimizer"]) == len(replica["optimizer"]) > 0
        for i, (a, b) in enumerate(zip(trained["optimizer"], replica["optimizer"], strict=True)):
            for key in OPTIMIZER_STATE:
                assert torch.equal(a[key], b[key]), f"rank {rank}: replica entry {i} {key} differs"


@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_replica_equals_the_training_state(tmp_path, capsys, layout):
    args = [*COMMON, *LAYOUTS[layout].split(), "--train-iters", "6"]
    ckpt = tmp_path / "ckpt"
    tb = ["--tensorboard-dir", str(tmp_path / "tb")]
    proc = run_gpt(2, *args, *_plus(ckpt, 3), *tb, "--dump-state", str(tmp_path / "plus"))
    log = proc.stdout + proc.stderr
    assert "LowDiff+: merged through iteration 6" in log
    # Observability: the manager's metrics in the log line, Megatron's timers, TensorBoard.
    assert re.search(r"recoverable lag: \d+ \| diff bytes per iteration: [\d.]+ KB \| "
                     r"writer backlog: \d+ \| merge backlog: \d+ \|", log), log[-3000:]  # fmt: skip
    assert "(min, max) time across ranks (ms):" in log and "diffckpt-diff" in log
    if importlib.util.find_spec("tensorboard") is None:
        assert "the tensorboard package is not installed" in log
    else:
        assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    _assert_replica_equals_training(tmp_path / "plus")
    # Bases 3 and 6 were written from the replica and published.
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert (ckpt / "iter_0000003" / "metadata.json").exists()

    traces = [json.loads(p.read_text()) for p in sorted((ckpt / "diffckpt" / "trace").iterdir())]
    assert len(traces) == 2 and all(t["iterations"] for t in traces)
    # The CLI reads the run: its mode, the traces, the recoverable iteration; nothing damaged.
    capsys.readouterr()
    assert cli.main(["inspect", str(ckpt), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["mode"] == "lowdiff-plus" and info["recoverable_iteration"] == 6
    assert len(info["lowdiff_plus_traces"]) == 2
    assert cli.main(["verify", str(ckpt)]) == 0
    if "pp2" not in layout:
        return
    # PP=2: copies were issued inside bubbles (waits on the other stage)...
    assert all(t["pipelined"] for t in traces)
    in_bubbles = [it["copies_issued_in_bubbles"] for t in traces for it in t["iterations"]]
    assert sum(in_bubbles) > 0
    assert max(t["summary"]["copy_seconds_in_bubbles"] for t in traces) > 0
    # ...and training is the same as without LowDiff+.
    run_gpt(2, *args, "--dump-state", str(tmp_path / "plain"))
    plain, plus = load_dumps(tmp_path / "plain", 2), load_dumps(tmp_path / "plus", 2)
    for rank in range(2):
        assert plus[rank]["losses"] == plain[rank]["losses"]
        assert_same_state(plain[rank], plus[rank], rank)


@pytest.mark.distributed
def test_merger_base_loads_with_stock_dist_checkpointing_and_resumes_exactly(tmp_path):
    # bf16: the base's model parameters are the replica's fp32 main parameters, cast as megatron
    # casts them; fp32 is covered by the SIGKILL tests, which resume from merger bases too.
    args = [*COMMON, "--overlap-grad-reduce", "--bf16", "--train-iters", "8"]
    ckpt = tmp_path / "ckpt"
    run_gpt(
        2,
        *args,
        *_plus(ckpt, 4, "--diffckpt-option", "diff_log=false"),
        "--dump-state",
        str(tmp_path / "straight"),
    )
    assert not (ckpt / "diffckpt" / "rank_0_0_0").exists()  # bases only
    # Keep only the base of iteration 4 and resume from it without differential checkpointing.
    resume = tmp_path / "resume"
    resume.mkdir()
    (resume / "iter_0000004").symlink_to(ckpt / "iter_0000004")
    (resume / "latest_checkpointed_iteration.txt").write_text("4")
    proc = run_gpt(2, *args, "--load", str(resume), "--dump-state", str(tmp_path / "resumed"))
    assert "loaded checkpoint from" in proc.stdout + proc.stderr
    straight, resumed = load_dumps(tmp_path / "straight", 2), load_dumps(tmp_path / "resumed", 2)
    for rank in range(2):
        assert resumed[rank]["losses"] == straight[rank]["losses"][4:]
        assert_same_state(straight[rank], resumed[rank], rank)
    # The distributed optimizer's dp_reshardable layout: it also loads under another DP size.
    one = run_gpt(1, *args, "--load", str(resume), "--dump-state", str(tmp_path / "dp1"))
    assert "loaded checkpoint from" in one.stdout + one.stderr
    dp1 = load_dumps(tmp_path / "dp1", 1)[0]
    assert len(dp1["losses"]) == 4 and abs(dp1["losses"][0] - straight[0]["losses"][4]) < 1e-3


def _resume_and_compare(tmp_path, args, ckpt, total: int, interval: int) -> int:
    run_gpt(2, *args, "--train-iters", str(total), "--dump-state", str(tmp_path / "straight"))
    resumed = run_gpt(
        2,
        *args,
        "--train-iters",
        str(total),
        *_plus(ckpt, interval),
        "--load",
        str(ckpt),
        "--dump-state",
        str(tmp_path / "resumed"),
    )
    recovered = recovered_iteration(resumed)
    straight, after = load_dumps(tmp_path / "straight", 2), load_dumps(tmp_path / "resumed", 2)
    for rank in range(2):
        assert after[rank]["losses"] == straight[rank]["losses"][recovered:]
        assert_same_state(straight[rank], after[rank], rank)
    _assert_replica_equals_training(tmp_path / "resumed")
    return recovered


MOE = (
    "--num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --disable-bias-linear"
)


@pytest.mark.distributed
@pytest.mark.parametrize("model", ["dense", "moe-ep1", "moe-ep2"])
def test_sigkill_while_merging_recovers_exactly_from_base_and_differentials(tmp_path, model):
    """Mixture of experts too (4 experts, top-2, experts replicated over data parallelism): the
    expert buckets' snapshots merge into the replica with the dense ones."""
    args = [*COMMON, "--overlap-grad-reduce", *(MOE.split() if model != "dense" else [])]
    args += ["--expert-model-parallel-size", "2"] if model == "moe-ep2" else []
    ckpt = tmp_path / "ckpt"
    run_until_killed(
        [*args, "--train-iters", "1000", *_plus(ckpt, 4)],
        kill_after=7,
        kill_when_exists=[tracker_at(ckpt, 4)],  # base 4 published
    )
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() in ("4", "8")
    base = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    recovered = _resume_and_compare(tmp_path, args, ckpt, total=12, interval=4)
    assert recovered > base  # the differentials after the base were replayed


@pytest.mark.distributed
def test_a_fused_replica_is_anchored_at_every_base_and_recovery_stays_exact(tmp_path):
    """``replica_kernel=fused``, the host kernel of training on GPUs, forced on the CPU: the
    replica steps with torch's fused CPU Adam, so it drifts from the training state by rounding
    (``tests/test_replica_kernel.py`` bounds it); every base re-anchors it to the training state
    first, so the bases and the diff log stay exact, and so does a recovery after SIGKILL."""
    args = [*COMMON, "--overlap-grad-reduce"]
    ckpt = tmp_path / "ckpt"
    fused = _plus(ckpt, 4, "--diffckpt-option", "replica_kernel=fused")
    killed = run_until_killed(
        [*args, "--train-iters", "1000", *fused],
        kill_after=7,
        kill_when_exists=[tracker_at(ckpt, 4)],
    )
    assert "stepped with the fused host kernel, anchored at every base" in killed
    base = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert base in (4, 8)
    recovered = _resume_and_compare(tmp_path, args, ckpt, total=12, interval=4)
    assert recovered > base


@pytest.mark.distributed
def test_sigkill_while_a_base_is_written_keeps_the_previous_base(tmp_path):
    args = [*COMMON, "--overlap-grad-reduce"]
    ckpt = tmp_path / "ckpt"
    # The base folder is created when the base is planned; the merger writes it afterwards.
    run_until_killed(
        [*args, "--train-iters", "1000", *_plus(ckpt, 4)],
        kill_when_exists=ckpt / "iter_0000008",
    )
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert not (ckpt / "iter_0000008" / "metadata.json").exists()
    recovered = _resume_and_compare(tmp_path, args, ckpt, total=12, interval=4)
    assert recovered > 4


@pytest.mark.parametrize(
    "flags, message",
    [
        ("", "needs --use-distributed-optimizer"),
        ("--use-distributed-optimizer --diffckpt-compressor topk", "without gradient compression"),
        ("--use-distributed-optimizer --ckpt-format torch_dcp", "writes torch_dist bases"),
    ],
)
def test_lowdiff_plus_flag_errors(tmp_path, flags, message):
    proc = run_script(
        "--train-iters", "2", "--save", str(tmp_path), "--save-interval", "1",
        "--diffckpt-mode", "lowdiff-plus", *flags.split(),
    )  # fmt: skip
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


@pytest.mark.distributed
def test_a_base_waits_for_a_slow_merger_at_most_the_bound(tmp_path, monkeypatch):
    """Rank 0's merger sleeps 0.4 s per merge, a base every 2 iterations, with
    ``max_merge_wait_ms=100``: base 2 comes before the merger has stepped iteration 1 and before
    its 2 slots are full; the base waits at most the bound for it, then the merger skips to
    that base (what it has not begun: iteration 1 is in its step), staged from the training
    state (without the bound on the base's wait, every base
    waited for the merger as long as it took). Training is that of a run without LowDiff+, bit
    for bit, and the replica equals it at the end."""
    args = [*COMMON, "--train-iters", "4"]
    monkeypatch.setenv("DIFFCKPT_DELAY", "merge:0.4@0")
    bounded = _plus(tmp_path / "ckpt", 2, "--diffckpt-option", "max_merge_wait_ms=100")
    proc = run_gpt(2, *args, *bounded, "--dump-state", str(tmp_path / "plus"))
    log = proc.stdout + proc.stderr
    waited = re.search(r"\[rank0\].*LowDiff\+: the merger had not merged iteration 2 100 ms "
                       r"into its base: iterations from [12] on are not merged until the next "
                       r"base", log)  # fmt: skip
    assert waited, log[-4000:]
    assert re.search(r"\[rank0\].*(iterations 1-2 were|iteration 2 was) not merged; the base of "
                     r"iteration 2 is staged from the training state", log)  # fmt: skip
    assert "iterations 2-2" not in log
    monkeypatch.delenv("DIFFCKPT_DELAY")
    run_gpt(2, *args, "--dump-state", str(tmp_path / "plain"))
    plain, plus = load_dumps(tmp_path / "plain", 2), load_dumps(tmp_path / "plus", 2)
    for rank in range(2):
        assert plus[rank]["losses"] == plain[rank]["losses"]
        assert_same_state(plain[rank], plus[rank], rank)
    _assert_replica_equals_training(tmp_path / "plus")


@pytest.mark.distributed
def test_a_merger_slower_than_training_skips_to_the_next_base_while_the_log_goes_on(
    tmp_path, monkeypatch
):
    """Rank 0's merger sleeps 0.4 s per merge (a host that cannot keep up; iterations take
    about 50 ms), with ``max_merge_wait_ms=100``: once its 2 slots are held, an iteration waits
    at most 100 ms for one, then the merger skips what it has not merged until the next base,
    which is staged from the training state and published, while the diff log goes on (every
    slot goes back once the log has read it); the log line shows the pause. Training is that
    of a run without LowDiff+, bit for bit, and a job SIGKILLed during a pause recovers exactly,
    past the iteration the pause began at (from the newest base and the log written in the
    pause)."""
    args = [*COMMON, "--overlap-grad-reduce"]
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv("DIFFCKPT_DELAY", "merge:0.4@0")
    bounded = _plus(ckpt, 6, "--diffckpt-option", "max_merge_wait_ms=100")
    proc = run_gpt(2, *args, "--train-iters", "14", *bounded,
                   "--dump-state", str(tmp_path / "plus"))  # fmt: skip
    log = proc.stdout + proc.stderr
    paused = [int(m[1]) for m in re.findall(PAUSED, log) if m[0] == "0"]
    resumed = re.findall(r"\[rank0\].*iterations? (?:\d+-)?(\d+) w(?:ere|as) not merged; "
                         r"the base of iteration (\d+) is staged from the training state",
                         log)  # fmt: skip
    assert paused and len(resumed) == len(paused), log[-4000:]
    assert [int(r[0]) for r in resumed] == [int(r[1]) for r in resumed]
    assert all(int(r[1]) in (6, 12, 14) for r in resumed)  # at the bases, or the final save
    assert re.search(r"merge backlog: \d+ \(not merged until the next base\) \|", log)
    assert all(m[0] == "0" for m in re.findall(PAUSED, log))  # rank 1 kept up
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "14"  # the final save
    run_gpt(2, *args, "--train-iters", "14", "--dump-state", str(tmp_path / "plain"))
    plain, plus = load_dumps(tmp_path / "plain", 2), load_dumps(tmp_path / "plus", 2)
    for rank in range(2):
        assert plus[rank]["losses"] == plain[rank]["losses"]
        assert_same_state(plain[rank], plus[rank], rank)
    # SIGKILL in a pause after base 6: storage holds base 6 and the log written in the pause.
    ckpt2 = tmp_path / "killed"
    out = run_until_killed(
        [
            *args,
            "--train-iters",
            "1000",
            *_plus(ckpt2, 6, "--diffckpt-option", "max_merge_wait_ms=100"),
        ],  # fmt: skip
        kill_after=11,
        kill_when_exists=[tracker_at(ckpt2, 6)],
    )
    began = [int(m[1]) for m in re.findall(PAUSED, out) if int(m[1]) > 6]
    assert began, out[-3000:]
    monkeypatch.delenv("DIFFCKPT_DELAY")
    recovered = _resume_and_compare(tmp_path, args, ckpt2, total=14, interval=6)
    assert recovered >= began[-1] and recovered > 6  # what the pause logged was replayed
