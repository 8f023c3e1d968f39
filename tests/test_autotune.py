"""The online tuner: what it measures, what it proposes, and a real run that follows it."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace

import pytest
import torch
from launch import (
    TINY_GPT,
    assert_same_state,
    load_dumps,
    recovered_iteration,
    run_gpt,
    run_until_killed,
)

from megatron_diffckpt import recovery
from megatron_diffckpt.autotune import (
    DECISION_FILE,
    PAUSED_BASES_TO_DROP,
    Decision,
    OnlineTuner,
    TunerSettings,
    load_decision,
    save_decision,
)
from megatron_diffckpt.manager.tuning import retune
from megatron_diffckpt.tuning import CostInputs, optimize

# rank, first iteration of a pause of LowDiff+'s merger (max_merge_wait_ms)
PAUSED = r"\[rank(\d+)\].*iterations from (\d+) on are not merged until the next base"
SETTINGS = TunerSettings(mtbf_s=1800.0, host_memory_budget=1e9, max_pending=2)


def _fed_tuner(**overrides) -> OnlineTuner:
    tuner = OnlineTuner(SETTINGS, full_interval=100, batch_size=1)
    for i in range(10):
        tuner.observe_iteration(1.0 + 0.01 * (i % 3), 0.02, 0.05)
        tuner.observe_write(records=1, nbytes=1_000_000, write_s=0.01, sync_s=0.05)
    tuner.observe_base(stall_s=5.0, persist_s=20.0)
    for name, value in overrides.items():
        setattr(tuner, name, value)
    return tuner


def test_inputs_are_the_medians_of_what_was_measured():
    inputs = _fed_tuner().inputs()
    assert inputs.iteration_s == pytest.approx(1.01)
    assert (inputs.diff_s, inputs.diff_bytes) == (0.02, 1_000_000)
    assert inputs.write_bandwidth == pytest.approx(1e8)
    assert inputs.write_latency_s == 0.05
    assert (inputs.base_stall_s, inputs.base_persist_s) == (5.0, 20.0)
    # Without a recovery in this run: load ~ persist, replay ~ one optimizer step.
    assert (inputs.base_load_s, inputs.replay_s) == (20.0, 0.05)
    assert inputs.mtbf_s == 1800.0


def test_recovery_measurements_replace_the_estimates():
    tuner = _fed_tuner()
    tuner.observe_recovery(base_load_s=3.0, replay_s_per_diff=0.2, restart_s=45.0)
    inputs = tuner.inputs()
    assert (inputs.base_load_s, inputs.replay_s, inputs.restart_s) == (3.0, 0.2, 45.0)


def test_proposal_is_the_cost_models_optimum():
    tuner = _fed_tuner()
    expected = optimize(tuner.inputs())
    assert tuner.propose(50) == (expected.full_interval, expected.batch_size, 1, 0, 1)
    assert tuner.last_plan == expected


def test_no_proposal_without_measurements():
    tuner = OnlineTuner(SETTINGS, full_interval=100, batch_size=4)
    assert tuner.propose(50) == (100, 4, 1, 0, 1)
    assert tuner.inputs() is None
    for _ in range(10):  # iterations and writes, but no base yet: its cost is not assumed
        tuner.observe_iteration(1.0, 0.02, 0.05)
        tuner.observe_write(records=1, nbytes=1_000_000, write_s=0.01, sync_s=0.05)
    assert tuner.inputs() is None
    tuner.observe_base(stall_s=1.0, persist_s=2.0)
    assert tuner.inputs() is not None


def test_a_slow_writer_gets_bigger_batches():
    tuner = OnlineTuner(SETTINGS, full_interval=100, batch_size=1)
    for _ in range(10):
        tuner.observe_iteration(1.0, 0.02, 0.05)
        tuner.observe_write(records=1, nbytes=1_000_000, write_s=0.01, sync_s=3.0)
    tuner.observe_base(stall_s=5.0, persist_s=20.0)
    _, batch, *_ = tuner.propose(10)
    inputs: CostInputs = tuner.inputs()
    assert batch > 1
    assert (inputs.write_latency_s + batch * 0.01) / batch <= inputs.iteration_s + 0.02


def _plus_tuner(write_s: float, bound_merge_wait: bool = False) -> OnlineTuner:
    """LowDiff+ at 7B parameters on DP=8: a 3.5 GB dense differential per rank, 2 s iterations,
    a base from the replica that stalls nothing and persists in 10 s."""
    settings = TunerSettings(mtbf_s=6.3e3 * 3600, host_memory_budget=16e9, max_pending=2)
    settings = replace(settings, plus=True, bound_merge_wait=bound_merge_wait)
    tuner = OnlineTuner(settings, full_interval=100, batch_size=1)
    for _ in range(10):
        tuner.observe_iteration(2.0, 0.001, 0.05)
        tuner.observe_write(records=1, nbytes=3_500_000_000, write_s=write_s, sync_s=0.05)
    tuner.observe_base(stall_s=0.0, persist_s=10.0)
    return tuner


def test_lowdiff_plus_turns_the_diff_log_off_only_where_storage_cannot_take_it():
    fast = _plus_tuner(write_s=0.5)  # 7 GB/s: the log keeps up
    assert fast.propose(50)[2] == 1
    slow = _plus_tuner(write_s=2.8)  # 1.25 GB/s: 2.85 s to write what 2 s of training make
    full_interval, _, diff_log, *_ = slow.propose(50)
    assert diff_log == 0 and full_interval == 5  # bases as often as they persist (10 s / 2 s)
    # Replay is an optimizer step plus reading the differential back.
    assert slow.inputs().replay_s == pytest.approx(0.05 + 2.8)
    slow.apply(full_interval, 1, diff_log=False)
    fast.apply(10, 1, diff_log=False)  # once off, off for the run, whatever it measures
    assert not fast.diff_log and fast.propose(60)[2] == 0


def test_lowdiff_plus_counts_the_wait_for_its_merger_with_the_log_and_without():
    """The merger keeps training waiting 0.3 s per iteration on average (in bursts, when the
    slots are full): with bases only the replica still merges, so that wait stays in the plan."""
    tuner = _plus_tuner(write_s=2.8)
    for i in range(tuner.settings.window):  # the window: only these count
        tuner.observe_iteration(2.0, 0.001, 0.05, merge_wait_s=0.6 if i % 2 else 0.0)
    assert tuner.inputs().merge_wait_s == pytest.approx(0.3)
    full_interval, _, diff_log, *_ = tuner.propose(50)
    assert diff_log == 0 and tuner.last_plan.step_s >= 2.0 + 0.3
    assert tuner.last_plan.overhead >= 0.15
    quiet = _plus_tuner(write_s=2.8)
    quiet.propose(50)
    assert quiet.last_plan.overhead < 0.01


def _lagging(tuner: OnlineTuner, wait_s: float, every: int = 2) -> OnlineTuner:
    for i in range(tuner.settings.window):
        tuner.observe_iteration(2.0, 0.001, 0.05, merge_wait_s=0.0 if i % every else wait_s)
    return tuner


def test_lowdiff_plus_bounds_the_wait_for_a_merger_that_cannot_keep_up():
    """A merger that keeps training waiting 0.6 s every other iteration: the tuner bounds the
    wait at half the median wait (300 ms); its plan pays the bound and a base stall per base
    interval instead of 0.3 s per iteration. One way: a bounded run stays bounded, whatever it
    measures next (its waits are the bound's, once per pause)."""
    tuner = _lagging(_plus_tuner(write_s=0.5, bound_merge_wait=True), 0.6)
    unbounded = _lagging(_plus_tuner(write_s=0.5), 0.6)  # the user's bound, or the keeper's
    f, _, diff_log, bound_ms, _ = tuner.propose(50)
    assert (diff_log, bound_ms) == (1, 300)
    assert tuner.last_plan.step_s < 2.0 + 0.01  # no wait every iteration
    assert unbounded.propose(50)[3] == 0 and unbounded.last_plan.step_s >= 2.0 + 0.3
    assert tuner.last_plan.wall_per_iteration_s < unbounded.last_plan.wall_per_iteration_s
    tuner.apply(f, 1, True, bound_ms)
    _lagging(tuner, 0.0)  # no wait since: the bound stays
    assert tuner.propose(60)[3] == 300
    tuner.apply(f, 1, True, 0)
    assert tuner.merge_wait_ms == 300


def test_lowdiff_plus_leaves_a_merger_that_keeps_up_unbounded():
    """No wait, or a rare short one (a base's persist slowing the merger: 10 ms once in 50
    iterations, 0.2 ms per iteration): a bound would save less than it costs."""
    assert _plus_tuner(write_s=0.5, bound_merge_wait=True).propose(50)[3] == 0
    rare = _lagging(_plus_tuner(write_s=0.5, bound_merge_wait=True), 0.01, every=50)
    assert rare.propose(50)[3] == 0


def test_lowdiff_plus_drops_a_replica_whose_merges_paused_in_two_base_intervals_in_a_row():
    """Bounded, the merger paused in the newest base interval: kept (one pause may pass); in
    the two newest: dropped, with the log on. Never where the settings forbid it (the keeper's
    replica), nor together with the log's stop (bases only needs the replica's bases). One way,
    and saved with the decision for a restart."""
    tuner = _lagging(_plus_tuner(write_s=0.5, bound_merge_wait=True), 0.6)
    tuner.settings = replace(tuner.settings, drop_replica=True)
    f, b, log, bound_ms, kept = tuner.propose(50)
    assert (log, kept) == (1, 1) and bound_ms > 0
    tuner.apply(f, b, True, bound_ms)
    tuner.observe_paused_bases(1)
    assert tuner.propose(60)[4] == 1
    tuner.observe_paused_bases(PAUSED_BASES_TO_DROP)
    assert tuner.propose(70)[4] == 0
    keeper = _lagging(_plus_tuner(write_s=0.5, bound_merge_wait=True), 0.6)  # drop_replica off
    keeper.observe_paused_bases(5)
    assert keeper.propose(70)[4] == 1
    slow = _plus_tuner(write_s=2.8)  # the log goes: the replica stays
    slow.settings = replace(slow.settings, drop_replica=True)
    slow.observe_paused_bases(5)
    assert slow.propose(50)[2:5:2] == (0, 1)
    tuner.apply(f, b, True, bound_ms, replica=False)
    tuner.observe_paused_bases(0)
    assert not tuner.replica and tuner.propose(80)[4] == 0
    tuner.apply(f, b, True, bound_ms, replica=True)
    assert not tuner.replica


def test_a_decision_without_the_replica_is_saved_and_resumed(tmp_path, caplog):
    save_decision(str(tmp_path), Decision(7, 2, True, 40, 150, replica=False))
    with caplog.at_level(logging.INFO):
        decided = load_decision(str(tmp_path))
    assert decided == Decision(7, 2, True, 40, 150, False)
    assert "merge wait bounded at 150 ms, LowDiff+ without a replica" in caplog.text
    older = tmp_path / "older"  # a decision file written before the replica was a choice
    older.mkdir()
    (older / DECISION_FILE).write_text(
        '{"full_interval": 7, "batch_size": 2, "diff_log": true, "iteration": 40}'
    )
    assert load_decision(str(older)).replica
    (older / DECISION_FILE).write_text('{"full_interval": 7, "batch_')  # cut short by hand
    with caplog.at_level(logging.WARNING):
        assert load_decision(str(older)) is None
    assert "is unreadable" in caplog.text and "the tuner starts afresh" in caplog.text


@pytest.mark.distributed
def test_training_follows_the_agreed_decisions(tmp_path):
    """A real run: the decisions are logged with their inputs, and bases follow the tuned F."""
    ckpt = tmp_path / "ckpt"
    common = [
        *TINY_GPT,
        "--use-distributed-optimizer",
        "--lr-decay-iters",
        "100",
        "--save",
        str(ckpt),
        "--save-interval",
        "3",
        "--diffckpt-mode",
        "lowdiff",
        "--diffckpt-auto-tune",
        "--diffckpt-option",
        "retune_interval=4",
        "--diffckpt-mtbf-hours",
        "1000",  # failures so rare that a long F pays
    ]
    proc = run_gpt(2, *common, "--train-iters", "24")
    log = proc.stdout + proc.stderr
    proposal = re.compile(
        r"auto-tune at iteration 4: proposes F 3 -> \d+, B 1 -> \d+ .* from: "
        r"iteration [\d.]+ s, diff [\d.]+ s and \d+ bytes"
    )
    assert proposal.search(log), log[-3000:]
    decisions = [
        (int(m[1]), int(m[2]))
        for m in re.finditer(r"auto-tune at iteration (\d+): F \d+ -> (\d+), B", log)
    ]
    assert decisions, "the tuner never changed F"
    saved = sorted({int(m) for m in re.findall(r"saved checkpoint from iteration (\d+) ", log)})
    # Replay Megatron's loop with the agreed F: a base F iterations after the newest one.
    expected, last, f = [0], 0, 3  # a job from scratch saves its starting point
    changes = dict(decisions)
    for it in range(1, 25):
        f = changes.get(it, f)  # decided in end_iteration, before the loop asks for a base
        if it - last >= f or it == 24:
            expected.append(it)
            last = it
    assert saved == expected, (saved, expected, decisions)
    # A restarted job resumes with the newest agreed decision instead of relearning it.
    state = json.loads((ckpt / "diffckpt" / "autotune.json").read_text())
    assert (state["full_interval"], state["iteration"]) == (decisions[-1][1], decisions[-1][0])
    resumed = run_gpt(2, *common, "--train-iters", "26", "--load", str(ckpt))
    assert f"auto-tune: resuming with F {state['full_interval']}, B {state['batch_size']}" in (
        resumed.stdout + resumed.stderr
    )


@pytest.mark.distributed
def test_lowdiff_plus_auto_tune_keeps_a_log_that_keeps_up(tmp_path):
    """A real LowDiff+ run with the tuner: its decisions weigh the diff log against bases only,
    keep the log (the tiny model's differentials are small for the local disk), and a restart
    recovers the last iteration from it."""
    ckpt = tmp_path / "ckpt"
    common = [*TINY_GPT, "--use-distributed-optimizer", "--lr-decay-iters", "100",
              "--save", str(ckpt), "--save-interval", "3", "--diffckpt-mode", "lowdiff-plus",
              "--diffckpt-auto-tune", "--diffckpt-option", "retune_interval=4"]  # fmt: skip
    proc = run_gpt(2, *common, "--train-iters", "12")
    log = proc.stdout + proc.stderr
    assert re.search(
        r"auto-tune at iteration 4: proposes F 3 -> \d+, B 1 -> \d+ \(predicted overhead .*; "
        r"LowDiff\+ with the diff log \(predicted overhead with the log [\d.]+%, bases only "
        r"[\d.]+%\)\) from:",
        log,
    ), log[-3000:]
    assert "stops writing the diff log" not in log
    resumed = run_gpt(2, *common, "--train-iters", "13", "--load", str(ckpt))
    assert recovered_iteration(resumed) == 12


@pytest.mark.distributed
def test_lowdiff_plus_auto_tune_bounds_the_wait_for_a_slow_merger(tmp_path, monkeypatch):
    """A real LowDiff+ run whose rank 0 merger sleeps 0.4 s per merge (iterations take about
    50 ms): at its first decision the tuner bounds training's wait for it, both ranks agree,
    and rank 0's merger then skips to the next base (staged from the training state) while the
    diff log goes on; the bound is saved with the decision, a restart resumes with it and
    recovers the last iteration from base and log, and training is that of a run without
    LowDiff+, bit for bit."""
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv("DIFFCKPT_DELAY", "merge:0.4@0")
    model = [*TINY_GPT, "--use-distributed-optimizer", "--lr-decay-iters", "100"]
    common = [*model, "--save", str(ckpt), "--save-interval", "3", "--diffckpt-mode",
              "lowdiff-plus", "--diffckpt-auto-tune", "--diffckpt-option",
              "retune_interval=4"]  # fmt: skip
    proc = run_gpt(2, *common, "--train-iters", "12", "--dump-state", str(tmp_path / "plus"))
    log = proc.stdout + proc.stderr
    agreed = re.search(r"\[rank0\].*auto-tune at iteration 4: F 3 -> \d+, B 1 -> \d+, merge "
                       r"wait bounded at (\d+) ms \(agreed by all ranks\)", log)  # fmt: skip
    assert agreed, log[-4000:]
    bound_ms = int(agreed[1])
    assert re.search(r"\[rank0\].*auto-tune at iteration 4: proposes .*; training's wait for the "
                     r"merger bounded at \d+ ms", log)  # fmt: skip
    bounded = re.findall(r"\[rank(\d)\].*auto-tune at iteration 4: training waited [\d.]+ ms "
                         r"per iteration for this rank's merger; from now on it waits at most "
                         r"(\d+) ms", log)  # fmt: skip
    assert sorted(bounded) == [("0", str(bound_ms)), ("1", str(bound_ms))], log[-4000:]
    paused = [int(m[1]) for m in re.findall(PAUSED, log) if m[0] == "0"]
    assert paused and min(paused) > 4, log[-4000:]  # after the decision, not before
    state = json.loads((ckpt / "diffckpt" / "autotune.json").read_text())
    assert state["merge_wait_ms"] == bound_ms
    resumed = run_gpt(2, *common, "--train-iters", "13", "--load", str(ckpt))
    out = resumed.stdout + resumed.stderr
    assert f"merge wait bounded at {bound_ms} ms (decided at iteration" in out, out[-3000:]
    assert recovered_iteration(resumed) == 12
    monkeypatch.delenv("DIFFCKPT_DELAY")
    run_gpt(2, *model, "--train-iters", "12", "--dump-state", str(tmp_path / "plain"))
    plain, plus = load_dumps(tmp_path / "plain", 2), load_dumps(tmp_path / "plus", 2)
    for rank in range(2):
        assert plus[rank]["losses"] == plain[rank]["losses"]
        assert_same_state(plain[rank], plus[rank], rank)


@pytest.mark.distributed
def test_lowdiff_plus_auto_tune_drops_a_replica_that_only_costs(tmp_path, monkeypatch):
    """A real LowDiff+ run whose rank 0 merger sleeps 0.4 s per merge, with F capped at 6
    (``max_full_interval``): the tuner bounds the wait at iteration 4, rank 0's merges then
    pause in every base interval, and once they paused in two in a row the tuner drops the
    replica on every rank (each says why, and what it freed); from then on nothing pauses, the
    log line says there is no replica, and every base is staged from the training state. The
    job, SIGKILLed after that, restarts without a replica (the decision was saved), recovers
    past its newest base from the log written without one, and ends bit for bit where a run
    without checkpointing ends."""
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv("DIFFCKPT_DELAY", "merge:0.4@0")
    model = [
        *TINY_GPT,
        "--use-distributed-optimizer",
        "--lr-decay-iters",
        "100",
        "--train-iters",
        "36",
    ]
    common = [*model, "--save", str(ckpt), "--save-interval", "3", "--diffckpt-mode",
              "lowdiff-plus", "--diffckpt-auto-tune", "--diffckpt-option",
              "retune_interval=4,max_full_interval=6"]  # fmt: skip
    log = run_until_killed(common, kill_after=30)
    dropped = re.findall(
        r"\[rank(\d)\].*auto-tune at iteration (\d+): LowDiff\+ drops its replica \((this "
        r"rank's|another rank's) merges paused in each of its last 2 base intervals.*; "
        r"([\d.]+) MB of host memory freed",
        log,
    )
    assert sorted(m[0] for m in dropped) == ["0", "1"], log[-5000:]
    assert {m[2] for m in dropped} == {"this rank's", "another rank's"}
    at = int(dropped[0][1])
    assert all(int(m[1]) == at for m in dropped) and all(float(m[3]) > 0 for m in dropped)
    assert re.search(
        rf"\[rank0\].*auto-tune at iteration {at}: F \d+ -> \d+, B \d+ -> \d+, "
        r"merge wait bounded at \d+ ms, LowDiff\+ without a replica \(agreed",
        log,
    )
    paused = [int(m[1]) for m in re.findall(PAUSED, log) if m[0] == "0"]
    assert len(paused) >= 2 and max(paused) <= at, log[-5000:]  # none after the drop
    assert re.search(
        r"\[rank0\].* iteration +(2\d|30)/ .*\| merge backlog: none \(no replica\) \|", log
    )
    state = json.loads((ckpt / "diffckpt" / "autotune.json").read_text())
    assert (state["replica"], state["iteration"]) == (False, at)
    newest = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert newest > at
    resumed = run_gpt(2, *common, "--load", str(ckpt), "--dump-state", str(tmp_path / "plus"))
    out = resumed.stdout + resumed.stderr
    assert f"LowDiff+ without a replica (decided at iteration {at})" in out, out[-3000:]
    assert "no replica (the auto-tuner's decision): bases staged from the training state" in out
    assert recovered_iteration(resumed) > newest  # replayed from the log written without one
    monkeypatch.delenv("DIFFCKPT_DELAY")
    run_gpt(2, *model, "--dump-state", str(tmp_path / "plain"))
    plain, plus = load_dumps(tmp_path / "plain", 2), load_dumps(tmp_path / "plus", 2)
    for rank in range(2):
        assert_same_state(plain[rank], plus[rank], rank)


class _Strategy:
    """What :func:`retune` calls of LowDiff+'s strategy, recorded."""

    def __init__(self, paused_bases: int):
        self.has_replica, self.paused_bases, self.calls = True, paused_bases, []

    def bound_merge_wait(self, seconds: float) -> None:
        self.calls.append(("bound", seconds))

    def stop_diff_log(self) -> None:
        self.calls.append(("stop log",))

    def drop_replica(self) -> int:
        self.calls.append(("drop",))
        return 1_000_000


@pytest.mark.parametrize(
    ("peer", "calls", "replica"),
    [
        ((6, 1, 1, -300, 1), [("drop",)], False),  # any rank's drop: dropped everywhere
        ((6, 1, 0, -300, 1), [("stop log",)], True),  # the peer stops the log: kept
    ],
)
def test_retune_drops_the_replica_where_any_rank_does_unless_the_log_stops(
    tmp_path, monkeypatch, peer, calls, replica
):
    """This rank proposes the drop (its merges paused in two base intervals in a row, the
    bound set); the agreement is the MIN with the peer's proposal. A drop anywhere drops the
    replica everywhere; a peer's stop of the diff log keeps it (bases only are the replica's
    bases). The agreed decision is saved for a restart."""

    def agree(values, what):
        return [min(a, b) for a, b in zip(values, peer, strict=True)]

    monkeypatch.setattr(recovery, "all_reduce_min", agree)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    tuner = _lagging(_plus_tuner(write_s=0.5, bound_merge_wait=True), 0.6)
    tuner.settings = replace(tuner.settings, drop_replica=True)
    tuner.apply(6, 1, True, 300)
    strategy = _Strategy(paused_bases=PAUSED_BASES_TO_DROP)
    retune(tuner, 40, 6, None, strategy, str(tmp_path))
    assert strategy.calls == calls
    assert tuner.replica is replica
    assert load_decision(str(tmp_path)).replica is replica
