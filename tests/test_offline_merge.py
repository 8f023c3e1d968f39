"""``megatron-diffckpt merge``: a base plus differentials into a new stock base, offline.

A ``--diffckpt-mode lowdiff`` run is killed (SIGKILL) after its base at 5; ``merge`` writes a base
at 8 from base 5 and the differentials 6-8 in one process, without megatron. Stock training
(differential checkpointing off) resumed from the merged base must equal an uninterrupted run
bit for bit: parameters, main parameters, Adam moments, step, and every loss after 8 (so the
scheduler, the consumed samples and the RNG states of dropout were merged too). Real processes.
"""

from __future__ import annotations

import json

import pytest
import torch
from launch import (
    TINY_GPT,
    assert_same_state,
    load_dumps,
    run_cli,
    run_gpt,
    run_until_killed,
    tracker_at,
)

from megatron_diffckpt import offline_merge
from megatron_diffckpt.shard_map import SHARD_MAP_FILE, read_shard_map

TOTAL = 12
BASE_INTERVAL = 5
KILL_AFTER = 9
MERGE_AT = 8

DP2 = ("rank_0_0_0", "rank_0_0_1")
LAYOUTS = {  # flags, --diffckpt-mode, the two ranks' diff-log folders
    "tp1-pp1-dp2-bf16": (
        "--use-distributed-optimizer --overlap-grad-reduce --bf16",
        "lowdiff",
        DP2,
    ),
    "tp2-pp1-dp1": (
        "--tensor-model-parallel-size 2 --use-distributed-optimizer",
        "lowdiff",
        ("rank_0_0_0", "rank_1_0_0"),
    ),
    "tp1-pp2-dp1": (
        "--pipeline-model-parallel-size 2 --use-distributed-optimizer",
        "lowdiff",
        ("rank_0_0_0", "rank_0_1_0"),
    ),
    # LowDiff+: the merger's dense records are differentials of the same kind.
    "tp1-pp1-dp2-plus": ("--use-distributed-optimizer --overlap-grad-reduce", "lowdiff-plus", DP2),
    # mixture of experts, two of the four experts on each rank
    "moe-ep2-dp2": (
        "--use-distributed-optimizer --overlap-grad-reduce --num-experts 4 --moe-router-topk 2 "
        "--moe-token-dispatcher-type alltoall --disable-bias-linear --expert-model-parallel-size 2",
        "lowdiff",
        DP2,
    ),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_merged_base_resumes_like_uninterrupted_training(tmp_path, layout):
    flags, mode, rank_dirs = LAYOUTS[layout]
    common = [*TINY_GPT, *flags.split(), "--lr-decay-iters", "100"]
    ckpt = tmp_path / "ckpt"
    diff = ["--diffckpt-mode", mode, "--save", str(ckpt), "--save-interval", "5"]
    run_gpt(2, *common, "--train-iters", str(TOTAL), "--dump-state", str(tmp_path / "straight"))
    # SIGKILL once the base is published (LowDiff+ publishes it later) and both ranks'
    # differentials of MERGE_AT are durable.
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    segment = f"seg_{MERGE_AT:010d}_{MERGE_AT:010d}.bin"
    segments = [ckpt / "diffckpt" / name / segment for name in rank_dirs]
    waited = [tracker_at(ckpt, BASE_INTERVAL), *segments]
    run_until_killed([*common, "--train-iters", "1000", *diff], KILL_AFTER, waited)
    assert tracker.read_text() == str(BASE_INTERVAL)
    maps = sorted((ckpt / "diffckpt").glob(f"rank_*/{SHARD_MAP_FILE}"))
    assert len(maps) == 2

    merged = tmp_path / "merged"
    proc = run_cli("merge", str(ckpt), "--iteration", str(MERGE_AT), "--out", str(merged))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"merged base {BASE_INTERVAL} and 6 differential(s) of 2 rank(s)" in proc.stdout
    steps = 6 * (2 if "moe" in layout else 1)  # a step per rank, iteration and optimizer
    assert f"[replay 6-8 on 2 ranks] {steps}/{steps} steps" in proc.stderr  # the progress line
    assert (merged / "latest_checkpointed_iteration.txt").read_text() == str(MERGE_AT)
    assert sorted(p.name for p in merged.iterdir()) == [
        "iter_0000008",
        "latest_checkpointed_iteration.txt",
    ]

    resumed = run_gpt(
        2,
        *common,
        "--train-iters",
        str(TOTAL),
        "--load",
        str(merged),
        "--dump-state",
        str(tmp_path / "resumed"),
    )
    assert f"at iteration {MERGE_AT}" in resumed.stdout + resumed.stderr
    straight = load_dumps(tmp_path / "straight", 2)
    after = load_dumps(tmp_path / "resumed", 2)
    for rank in range(2):
        assert after[rank]["losses"] == straight[rank]["losses"][MERGE_AT:]
        assert_same_state(straight[rank], after[rank], rank)


@pytest.mark.distributed
def test_merge_refuses_what_it_cannot_do_and_names_why(tmp_path):
    common = [*TINY_GPT, "--use-distributed-optimizer", "--lr-decay-iters", "100"]
    ckpt = tmp_path / "ckpt"
    diff = ["--diffckpt-mode", "lowdiff", "--save", str(ckpt), "--save-interval", "5"]
    durable = [ckpt / "diffckpt" / name / "seg_0000000008_0000000008.bin" for name in DP2]
    run_until_killed([*common, "--train-iters", "1000", *diff], KILL_AFTER, durable)
    out = tmp_path / "merged"

    # Beyond what every rank holds: exit 1, with where each chain ends.
    proc = run_cli("merge", str(ckpt), "--iteration", "500", "--out", str(out))
    assert proc.returncode == 1
    assert "reach iteration 500" in proc.stderr and "rank_0_0_0" in proc.stderr
    # A base already: nothing to merge.
    proc = run_cli("merge", str(ckpt), "--iteration", "5", "--out", str(out))
    assert proc.returncode == 1 and "is a base already" in proc.stderr
    # Never into the folder it reads.
    proc = run_cli("merge", str(ckpt), "--out", str(ckpt))
    assert proc.returncode == 1 and "another folder" in proc.stderr
    # A leftover of an interrupted merge is never published, and a new merge replaces it.
    (out / "iter_0000007.merging").mkdir(parents=True)
    (out / "iter_0000007.merging" / "junk").write_text("x")
    proc = run_cli("merge", str(ckpt), "--iteration", "7", "--out", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "iter_0000007",
        "latest_checkpointed_iteration.txt",
    ]
    assert not (out / "iter_0000007" / "junk").exists()
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "7"
    # Never overwrites.
    proc = run_cli("merge", str(ckpt), "--iteration", "7", "--out", str(out))
    assert proc.returncode == 1 and "exists" in proc.stderr
    # An older iteration into the same folder: written, but the tracker never moves back.
    proc = run_cli("merge", str(ckpt), "--iteration", "6", "--out", str(out), "--quiet")
    assert proc.returncode == 0 and "tracker names iteration 7; left there" in proc.stdout
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "7"
    assert (out / "iter_0000006" / "metadata.json").exists()
    # Default target: the newest iteration every rank reaches.
    proc = run_cli("merge", str(ckpt), "--out", str(tmp_path / "newest"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    newest = int((tmp_path / "newest" / "latest_checkpointed_iteration.txt").read_text())
    assert newest >= KILL_AFTER - 1

    # A missing rank, and a missing shard map: exit 1 naming what is missing.
    rank1 = ckpt / "diffckpt" / "rank_0_0_1"
    shard_map = read_shard_map(str(rank1))
    (rank1 / SHARD_MAP_FILE).rename(tmp_path / "map.json")
    proc = run_cli("merge", str(ckpt), "--iteration", "7", "--out", str(tmp_path / "x"))
    assert proc.returncode == 1 and "shard map" in proc.stderr and "rank_0_0_1" in proc.stderr
    rank1.rename(tmp_path / "rank_0_0_1")
    proc = run_cli("merge", str(ckpt), "--iteration", "7", "--out", str(tmp_path / "x"))
    assert proc.returncode == 1 and "DP=2" in proc.stderr
    assert shard_map.parallel == (1, 1, 2) and shard_map.rank == (0, 0, 1)


def test_shard_map_round_trips_and_rejects_a_foreign_file(tmp_path):
    from megatron_diffckpt.shard_map import (
        InnerEntry,
        ParamEntry,
        ShardMap,
        ShardMapError,
        TensorSlice,
        write_shard_map,
    )

    entry = ParamEntry(
        6,
        "optimizer.b0.param",
        12,
        (TensorSlice("decoder.layers.w", (1, 0, 2), (3, 2), 1, (0, 0, 1)),),
        (0, 6),
        "bfloat16",
    )
    smap = ShardMap("abc", (0, 1, 2), (1, 2, 3), (None, InnerEntry("AdamW", "k/s", ((entry,),))))
    assert write_shard_map(str(tmp_path), smap) is True
    assert write_shard_map(str(tmp_path), smap) is False  # unchanged: not rewritten
    assert read_shard_map(str(tmp_path)) == smap
    assert entry.state_key("exp_avg") == "optimizer.b0.exp_avg"
    assert TensorSlice("k", (1, 0, 2), (3, 2), 1, (0,)).index() == (1, slice(0, 3), slice(2, 4))
    assert not TensorSlice("k", (0,), (3,), 0, (1, 0, 0)).saved_by_data_parallel_ranks()
    (tmp_path / SHARD_MAP_FILE).write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ShardMapError, match="not a shard map"):
        read_shard_map(str(tmp_path))
    (tmp_path / SHARD_MAP_FILE).write_text("{")
    with pytest.raises(ShardMapError, match="malformed"):
        read_shard_map(str(tmp_path))


def test_a_run_trained_with_a_fused_optimizer_is_refused():
    from megatron_diffckpt.shard_map import InnerEntry

    entry = InnerEntry("FusedAdam", "k", ())
    with pytest.raises(offline_merge.MergeError, match="FusedAdam.*--load"):
        offline_merge._optimizer_for(0, entry, {}, [])
    assert torch.optim.AdamW is offline_merge._OPTIMIZERS["AdamW"]


def test_rng_states_move_to_the_chain_and_a_cpu_mode_device_state_follows_the_cpu_one():
    cpu_state = torch.get_rng_state()
    new = {"torch": torch.full_like(cpu_state, 7), "tracker": {"model-parallel-rng": cpu_state}}
    saved = {
        "random_rng_state": (3, (1, 2), None),
        "torch_rng_state": cpu_state,
        "cuda_rng_state": cpu_state.clone(),  # CPU mode: the device generator is the CPU one
        "rng_tracker_states": {"model-parallel-rng": torch.zeros(3), "other": torch.ones(2)},
    }
    out = offline_merge._update_rng([saved], new)[0]  # Megatron-LM saves a list
    assert torch.equal(out["torch_rng_state"], new["torch"])
    assert torch.equal(out["cuda_rng_state"], new["torch"])
    assert out["random_rng_state"] == (3, (1, 2), None)  # not in the chain: unchanged
    assert torch.equal(out["rng_tracker_states"]["model-parallel-rng"], cpu_state)
    assert torch.equal(out["rng_tracker_states"]["other"], torch.ones(2))
    # A real device state (another generator) is not the CPU one's to overwrite.
    gpu_like = {**saved, "cuda_rng_state": torch.zeros(16, dtype=torch.uint8)}
    assert torch.equal(offline_merge._update_rng(gpu_like, new)["cuda_rng_state"], torch.zeros(16))
