"""``megatron-diffckpt inspect`` and ``verify`` on a real diff log, intact and damaged."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

from megatron_diffckpt.autotune import Decision, save_decision
from megatron_diffckpt.checkpoint_layout import publish_iteration
from megatron_diffckpt.cli import main
from megatron_diffckpt.storage import DiffLogWriter, DiffRecord, SegmentIdentity


def _folder(tmp_path, iterations=8, base=4):
    for it in (base,):
        d = tmp_path / f"iter_{it:07d}"
        d.mkdir()
        (d / "metadata.json").write_text("{}")
    publish_iteration(str(tmp_path), base)
    for dp in (0, 1):
        w = DiffLogWriter(
            str(tmp_path / "diffckpt"), SegmentIdentity("r", 0, 0, dp, "h"), "none", batch_size=2
        )
        for i in range(1, iterations + 1 - dp):  # rank dp=1 is one iteration behind
            w.append(DiffRecord(i, {}, {"g": torch.ones(8) * i}))
        w.close()
    return tmp_path


def test_inspect_reports_the_recoverable_iteration(tmp_path, capsys):
    _folder(tmp_path)
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["latest_base"] == 4
    assert info["recoverable_iteration"] == 7  # the minimum over ranks: 8 and 7
    assert [r["chain_end"] for r in info["ranks"]] == [8, 7]
    assert info["diff_bytes"] > 0
    assert main(["inspect", str(tmp_path)]) == 0
    assert "recoverable iteration T: 7" in capsys.readouterr().out


def test_inspect_shows_the_auto_tuners_decision(tmp_path, capsys):
    _folder(tmp_path)
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["auto_tune"] is None
    save_decision(str(tmp_path / "diffckpt"), Decision(6, 1, True, 16, 163, replica=False))
    assert main(["inspect", str(tmp_path)]) == 0
    assert (
        "auto-tune decision: F 6, B 1, merge wait bounded at 163 ms, LowDiff+ without a replica "
        "(decided at iteration 16)" in capsys.readouterr().out
    )
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["auto_tune"]["replica"] is False


def test_verify_passes_clean_and_fails_on_a_flipped_bit(tmp_path, capsys):
    _folder(tmp_path)
    assert main(["verify", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().endswith("ok")
    seg = tmp_path / "diffckpt" / "rank_0_0_1" / "seg_0000000005_0000000006.bin"
    data = bytearray(seg.read_bytes())
    data[-10] ^= 0x40
    seg.write_bytes(bytes(data))
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED rank_0_0_1/seg_0000000005_0000000006.bin: checksum mismatch" in out
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    # Iteration 6 of rank 1 is damaged: every rank can recover to 5, no further.
    assert json.loads(capsys.readouterr().out)["recoverable_iteration"] == 5


def test_incomplete_base_is_a_note_not_damage(tmp_path, capsys):
    _folder(tmp_path)
    (tmp_path / "iter_0000006").mkdir()
    assert main(["verify", str(tmp_path)]) == 0
    assert "note: iter_0000006: incomplete" in capsys.readouterr().out


def test_exit_codes_of_the_installed_command(tmp_path):
    missing = subprocess.run(
        [sys.executable, "-m", "megatron_diffckpt.cli", "inspect", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "no such directory" in missing.stderr
    empty = subprocess.run(
        [sys.executable, "-m", "megatron_diffckpt.cli", "inspect", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert empty.returncode == 1 and "recoverable iteration T: None" in empty.stdout
    usage = subprocess.run(
        [sys.executable, "-m", "megatron_diffckpt.cli", "bogus"], capture_output=True, text=True
    )
    assert usage.returncode == 2


def test_tune_plans_every_strategy_from_8_to_16k_gpus(capsys):
    assert main(["tune", "--sweep", "--tensor-parallel", "8", "--pipeline-parallel", "1",
                 "--json"]) == 0  # fmt: skip
    rows = json.loads(capsys.readouterr().out)
    gpus = sorted({r["gpus"] for r in rows})
    assert gpus[0] == 8 and gpus[-1] == 16384
    assert {r["strategy"] for r in rows} == {
        "LowDiff",
        "LowDiff+ (diff log)",
        "LowDiff+ (bases only)",
        "LowDiff, dense",
        "LowDiff+ (bounded wait)",
        "LowDiff + keepers",
        "LowDiff + keeper replicas",
        "LowDiff+ in keepers",
        "full checkpointing",
    }
    by_gpus = {g: [r for r in rows if r["gpus"] == g] for g in gpus}
    # The Llama 3 405B failure rate: 16,384 GPUs fail every ~3.1 h.
    assert by_gpus[16384][0]["mtbf_hours"] == pytest.approx(54 * 24 * 16384 / 419 / 16384)
    # Bigger jobs fail more often: the base interval shrinks and the expected loss grows.
    full = [r for r in rows if r["strategy"] == "full checkpointing"]
    assert [r["full_interval"] for r in full] == sorted(
        (r["full_interval"] for r in full), reverse=True
    )
    assert [r["lost_hours"] for r in full] == sorted(r["lost_hours"] for r in full)
    # With the keepers serving half the failures from host memory, each system loses less;
    # the replicas only where each node's host steps its shards within an iteration (70B on
    # 8 or 16 GPUs: 70 or 35B parameters per node, 22 or 11 s at 100 GB/s, per 10 s iteration).
    for g in gpus:
        lost = {r["strategy"]: r["lost_hours"] for r in by_gpus[g]}
        assert lost["LowDiff + keepers"] < lost["LowDiff"]
        assert lost["LowDiff+ in keepers"] < lost["LowDiff+ (bases only)"]
        keeps_up = by_gpus[g][0]["host_merge_s"] <= 10.0
        assert keeps_up == (g >= 32), g
        assert (lost["LowDiff + keeper replicas"] < lost["LowDiff + keepers"]) == keeps_up, g
        if not keeps_up:  # training at the host's pace: LowDiff+ without a replica is not
            assert lost["LowDiff, dense"] < lost["LowDiff+ (bases only)"] / 100


def test_tune_with_the_keepers_ring_loses_less_than_without(capsys):
    def lost(*extra: str) -> dict[tuple[int, str], float]:
        assert main(["tune", "--sweep", "--tensor-parallel", "8", "--pipeline-parallel", "1",
                     "--json", *extra]) == 0  # fmt: skip
        return {(r["gpus"], r["strategy"]): r["lost_hours"] for r in json.loads(
            capsys.readouterr().out)}  # fmt: skip

    ring, local = lost(), lost("--peer-share", "0")
    for (gpus, strategy), hours in ring.items():
        if strategy in ("LowDiff + keepers", "LowDiff + keeper replicas"):
            # no write batch lost with a node; its replicas' copies (16 bytes per shard
            # parameter) come from the peer faster than storage's base and F/2 replays
            assert hours < local[gpus, strategy], gpus
        elif strategy == "LowDiff+ in keepers":
            # The node's replicas (840 GB for 70B on 8 GPUs) over the 100 Gb/s peer link against
            # storage's share of 100 GB/s: the peer is slower at 8 GPUs, faster from 128 on.
            assert (hours < local[gpus, strategy]) == (gpus >= 128), gpus
        else:
            assert hours == local[gpus, strategy], gpus  # storage alone: the ring changes nothing
    assert main(["tune", "--kept-share", "0.8", "--peer-share", "0.3"]) == 2
    assert "peer_share must be in [0, 1 - kept_share]" in capsys.readouterr().err


def test_tune_refuses_a_layout_that_does_not_divide(capsys):
    assert main(["tune", "--gpus", "100", "--tensor-parallel", "8"]) == 2
    assert "not a multiple of TP x PP" in capsys.readouterr().err


def _dcp_base(root, iteration: int, tensors: dict, common: dict) -> None:
    """A base as torch_dist writes it: a DCP checkpoint, common.pt, metadata.json last."""
    import torch.distributed.checkpoint as dcp

    d = root / f"iter_{iteration:07d}"
    with warnings.catch_warnings():  # "assuming ... a single process": it is one
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(tensors, checkpoint_id=str(d), no_dist=True)
    torch.save(common, d / "common.pt")
    (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')


def test_export_writes_one_file_with_every_tensor_and_the_common_state(tmp_path, capsys):
    tensors = {"decoder.weight": torch.arange(12.0).view(3, 4), "opt.exp_avg": torch.ones(5)}
    _dcp_base(tmp_path, 4, tensors, {"iteration": 4, "opt_param_scheduler": {"num_steps": 32}})
    _dcp_base(tmp_path, 8, {k: v * 2 for k, v in tensors.items()}, {"iteration": 8})
    publish_iteration(str(tmp_path), 8)
    out = tmp_path / "export.pt"
    assert main(["export", str(tmp_path), "--iteration", "4", "--out", str(out)]) == 0
    assert "exported base 4" in capsys.readouterr().out
    exported = torch.load(out, weights_only=False)
    assert exported["format"] == "megatron-diffckpt-export-v1" and exported["iteration"] == 4
    assert exported["tensors"].keys() == tensors.keys()
    for key, value in tensors.items():
        assert torch.equal(exported["tensors"][key], value)
    assert exported["common"]["opt_param_scheduler"] == {"num_steps": 32}
    # Default: the newest base.
    assert main(["export", str(tmp_path), "--out", str(out), "--quiet"]) == 0
    assert torch.equal(
        torch.load(out, weights_only=False)["tensors"]["opt.exp_avg"], 2 * torch.ones(5)
    )
    # Not a base: exit 1, with what exists and what to do.
    assert main(["export", str(tmp_path), "--iteration", "6", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "no complete base of iteration 6" in err and "[4, 8]" in err


def test_export_reads_a_checkpoint_in_several_groups(tmp_path, monkeypatch):
    """Big checkpoints are read group by group; with one entry per group, nothing changes."""
    from megatron_diffckpt import dist_ckpt_io

    monkeypatch.setattr(dist_ckpt_io, "GROUP_BYTES", 1)
    tensors = {f"layer{i}.weight": torch.full((3, i + 1), float(i)) for i in range(4)}
    _dcp_base(tmp_path, 4, tensors, {"iteration": 4})
    out = tmp_path / "export.pt"
    assert main(["export", str(tmp_path), "--iteration", "4", "--out", str(out), "--quiet"]) == 0
    exported = torch.load(out, weights_only=False)["tensors"]
    assert exported.keys() == tensors.keys()
    assert all(torch.equal(exported[k], v) for k, v in tensors.items())


def test_prune_dry_run_lists_then_prune_removes_what_no_kept_base_replays(tmp_path, capsys):
    _folder(tmp_path, iterations=8, base=4)
    for it in (2, 6):  # an older base, and a newer one the tracker will name
        d = tmp_path / f"iter_{it:07d}"
        d.mkdir()
        (d / "metadata.json").write_text("{}")
    publish_iteration(str(tmp_path), 6)
    before = sorted(p.name for p in (tmp_path / "diffckpt" / "rank_0_0_0").iterdir())
    assert main(["prune", str(tmp_path), "--keep", "2", "--dry-run"]) == 0
    listed = capsys.readouterr().out
    assert "would remove iter_0000002" in listed and "iter_0000004" not in listed
    assert sorted(p.name for p in (tmp_path / "diffckpt" / "rank_0_0_0").iterdir()) == before
    assert main(["prune", str(tmp_path), "--keep", "2"]) == 0
    assert not (tmp_path / "iter_0000002").exists() and (tmp_path / "iter_0000004").exists()
    kept = sorted(p.name for p in (tmp_path / "diffckpt" / "rank_0_0_0").iterdir())
    # Segments ending at or before base 4 (the oldest kept) go; the rest stay.
    segments = [n for n in before if n.startswith("seg_")]
    assert kept == ["owner"] + [n for n in segments if int(n.split("_")[2].split(".")[0]) > 4]
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    assert main(["prune", str(tmp_path), "--keep", "0"]) == 2
