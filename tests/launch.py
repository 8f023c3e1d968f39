"""Start the GPT example as real processes (torchrun, gloo) and read back what it wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
PRETRAIN_GPT = REPO / "examples" / "gpt" / "pretrain_gpt.py"
# A distributed run that hangs (an async-save worker error shows up as a hang) must fail the test.
RUN_TIMEOUT_S = 300

# A tiny GPT that still exercises dropout (so the RNG states must round-trip) and tied embeddings.
TINY_GPT = tuple(
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --lr-warmup-iters 2 "
    "--log-interval 1".split()
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_gpt(nproc: int, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``pretrain_gpt.py`` on ``nproc`` CPU processes; output captured, bounded in time."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(PRETRAIN_GPT),
        *args,
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- output tail ---\n"
            + (proc.stdout + proc.stderr)[-6000:]
        )
    return proc


def run_script(*args: str, world_size: int = 1) -> subprocess.CompletedProcess:
    """Run ``pretrain_gpt.py`` as one plain process: argument errors come before any rank starts."""
    env = _env()
    env["WORLD_SIZE"] = str(world_size)
    return subprocess.run(
        [sys.executable, str(PRETRAIN_GPT), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )


def load_dumps(path: Path, nproc: int) -> list[dict]:
    """The per-rank states that ``--dump-state`` wrote."""
    return [torch.load(path / f"rank_{r}.pt", weights_only=True) for r in range(nproc)]


OPTIMIZER_STATE = ("main_param", "exp_avg", "exp_avg_sq", "step")


def assert_same_state(expected: dict, got: dict, rank: int) -> None:
    """Two ``--dump-state`` dumps of one rank hold bit-identical parameters and optimizer state
    (main params, exp_avg, exp_avg_sq, step): ``torch.equal``, tensor by tensor."""
    assert expected["params"].keys() == got["params"].keys()
    for name, value in expected["params"].items():
        assert torch.equal(value, got["params"][name]), f"rank {rank}: parameter {name}"
    assert len(expected["optimizer"]) == len(got["optimizer"]) > 0
    for i, (a, b) in enumerate(zip(expected["optimizer"], got["optimizer"], strict=True)):
        for key in OPTIMIZER_STATE:
            assert torch.equal(a[key], b[key]), f"rank {rank}: optimizer entry {i} {key}"
