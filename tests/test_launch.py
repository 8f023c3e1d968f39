"""``megatron-diffckpt-launch``'s own arguments: its leading flags are taken, torchrun's are left
as they are, and bad input stops it in one line before anything starts (the launches with a
keeper are tested in test_keeper*.py, test_megatron_lm.py and test_slurm.py)."""

from __future__ import annotations

import subprocess

import pytest
from launch import LAUNCH

from megatron_diffckpt.launch import launcher_options, node_of, node_ranks

TORCHRUN = ["--standalone", "--nproc-per-node", "2", "train.py", "--keeper-memory", "1"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--keeper-memory", "64", *TORCHRUN],
        ["--keeper-memory=64", *TORCHRUN],
    ],
)
def test_its_leading_flags_are_taken_and_torchruns_left_as_they_are(argv):
    opts, rest = launcher_options(argv)
    assert opts == {"--keeper-memory": "64"} and rest == TORCHRUN


def test_the_ring_folder_comes_with_the_cap():
    opts, rest = launcher_options(["--keeper-memory", "8", "--keeper-peers=/p", *TORCHRUN])
    assert opts == {"--keeper-memory": "8", "--keeper-peers": "/p"} and rest == TORCHRUN


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--keeper-peers", "/p", *TORCHRUN], "--keeper-peers needs --keeper-memory"),
        (["--keeper-memory", "0", *TORCHRUN], "--keeper-memory takes a positive size in MiB"),
        (["--keeper-memory", "lots"], "--keeper-memory takes a positive size in MiB, got lots"),
        (["--keeper-memory"], "--keeper-memory needs a value"),
        (["--diffckpt-keeper-memory", "64"],
         "--diffckpt-keeper-memory was retired; use --keeper-memory"),
        (["--keeper-memory", "8", "--diffckpt-keeper-peers", "/p"],
         "--diffckpt-keeper-peers was retired; use --keeper-peers"),
        (["--keeper-merge-threads", "4", *TORCHRUN],
         "--keeper-merge-threads needs --keeper-memory"),
        (["--keeper-memory", "8", "--keeper-merge-threads", "0", *TORCHRUN],
         "--keeper-merge-threads takes a number of threads, got 0"),
    ],
)  # fmt: skip
def test_bad_input_stops_it_in_one_line(argv, said):
    with pytest.raises(SystemExit) as stop:
        launcher_options(argv)
    assert str(stop.value).startswith("megatron-diffckpt-launch: ") and said in str(stop.value)
    assert "\n" not in str(stop.value)


def test_the_node_comes_from_torchruns_flags_before_the_script():
    assert node_of(["--nnodes", "1:4", "--node-rank=2", "train.py", "--node-rank", "9"]) == (2, 4)


def test_the_keepers_merge_threads_and_the_nodes_ranks_come_with_it(monkeypatch):
    opts, rest = launcher_options(["--keeper-memory", "8", "--keeper-merge-threads=6", *TORCHRUN])
    assert opts == {"--keeper-memory": "8", "--keeper-merge-threads": "6"} and rest == TORCHRUN
    assert node_ranks(TORCHRUN) == 2
    assert node_ranks(["--nproc_per_node=8", "train.py", "--nproc-per-node", "3"]) == 8
    assert node_ranks(["train.py"]) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert node_ranks(["--nproc-per-node", "gpu", "train.py"]) == 4


def test_the_console_script_shows_its_help_and_refuses_a_retired_flag():
    shown = subprocess.run([str(LAUNCH), "--help"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "--keeper-memory MIB" in shown.stdout
    refused = subprocess.run([str(LAUNCH), "--diffckpt-keeper-memory", "64"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines() == [
        "megatron-diffckpt-launch: --diffckpt-keeper-memory was retired; use --keeper-memory"
    ]


@pytest.mark.distributed
def test_a_job_whose_ranks_failed_ends_with_torchruns_report_and_no_traceback(tmp_path):
    """Two ranks, rank 1 exits 3 and rank 0 is SIGKILLed, no restart: the launcher exits 1 with
    torchrun's report (both ranks, rank 1's exit code, the root cause) and no traceback
    through torchrun's own code."""
    script = tmp_path / "fails.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "if os.environ['RANK'] == '1':\n    sys.exit(3)\n"
        "time.sleep(0.2)\nos.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run(
        [str(LAUNCH), "--standalone", "--nproc-per-node", "2", "--max-restarts", "0", str(script)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "fails.py FAILED" in out and "Root Cause (first observed failure)" in out, out
    assert "exitcode  : 3" in out, out
    assert "Traceback" not in out, out
