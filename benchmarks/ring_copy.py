"""A kept base around the keepers' ring: how fast it reaches the next node's keeper, how fast a
fresh keeper (its node lost whole) adopts it back, and what memory each keeper needed for it.

Run (from the repository root)::

    .venv/bin/python benchmarks/ring_copy.py [--gib 0.27,1.1,2.2]

Per size, one invocation: two keeper processes in a ring on loopback (nodes 0 and 1, as the
node launcher starts them); a rank of node 1 stages a LowDiff base (a torch AdamW shard:
weights and both moments of 8 parameters, in tensors of 1/24 of the base each) into its
keeper, which copies it to node 0's keeper (``copy_s``: from the keeper's reply to the rank
until node 0 lists the copy); node 1's keeper is SIGKILLed and a fresh one started, which,
asked for the rank's bases, fetches node 0's copy into its own shared memory (``adopt_s``:
the rank's ``base_state`` call). ``peak_over_base``: each keeper's peak resident memory
(``VmHWM``: its interpreter and torch, plus whatever it maps or buffers) over the base's size;
a keeper that held a copy in its heap would be above 1. The adopted base is checked bit for bit
against the rank's. Results go to ``benchmarks/results/ring_copy.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from megatron_diffckpt.keeper import base_stager  # noqa: E402
from megatron_diffckpt.keeper.client import KeeperClient, query, stop  # noqa: E402
from megatron_diffckpt.keeper.replica_client import load_replica  # noqa: E402
from megatron_diffckpt.shared_replica import build  # noqa: E402
from megatron_diffckpt.storage.format import DiffRecord, SegmentIdentity  # noqa: E402

ME = SegmentIdentity("bench", 0, 0, 1, "layout")
PARAMS = 8


def _keeper(sock: str, ring: list[str], node: int, memory_mib: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megatron_diffckpt.keeper", "--socket", sock]
    cmd += ["--memory-mib", str(memory_mib), *ring, "--node", str(node)]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    while not os.path.exists(sock):
        if proc.poll() is not None:
            raise RuntimeError(f"keeper of node {node} exited {proc.returncode}")
        time.sleep(0.05)
    return proc


def _peak(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return 1024 * next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _shard(numel: int, seed: int) -> torch.optim.AdamW:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(numel, generator=g)) for _ in range(PARAMS)]
    opt = torch.optim.AdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn(numel, generator=g)
    opt.step()
    for p in params:
        p.grad = None
    return opt


def _wait(predicate, what: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)


def measure(gib: float, work: Path) -> dict:
    numel = int(gib * 2**30 / (12 * PARAMS))
    memory_mib = int(gib * 1024 * 2.5) + 64
    peers = work / "peers"
    ring = ["--peers", str(peers), "--nnodes", "2", "--host", "127.0.0.1"]
    a_sock, b_sock, c_sock = (str(work / f"{n}.sock") for n in "abc")
    a = _keeper(a_sock, ring, 0, memory_mib)
    b = _keeper(b_sock, ring, 1, memory_mib)
    c = None
    try:
        train = _shard(numel, seed=1)
        rank = KeeperClient(b_sock, ME)
        record = DiffRecord(5, {"scheduler_steps": 5, "consumed_samples": 40}, {})
        why = base_stager.stage_base(rank, [train], None, record)
        if why:
            raise RuntimeError(why)
        start = time.perf_counter()
        _wait(lambda: any(r["copy"] for r in query(a_sock)["bases"]), "the copy at node 0")
        copy_s = time.perf_counter() - start
        size = query(b_sock)["bases"][0]["bytes"]
        sender_peak = _peak(b.pid)
        b.send_signal(signal.SIGKILL)
        b.wait(30)
        c = _keeper(c_sock, ring, 1, memory_mib)
        start = time.perf_counter()
        offered = base_stager.offered_bases(KeeperClient(c_sock, ME))
        adopt_s = time.perf_counter() - start
        row = offered.bases[5][0]
        again = _shard(numel, seed=2)
        load_replica([again], build(row["optimizers"]))
        pairs = zip(train.param_groups[0]["params"], again.param_groups[0]["params"], strict=True)
        for pa, pb in pairs:
            same = [torch.equal(pa, pb)]
            same += [torch.equal(v, again.state[pb][k]) for k, v in train.state[pa].items()]
            if not all(same):
                raise RuntimeError("the adopted base differs from the rank's")
        peaks = {"sender": sender_peak, "receiver": _peak(a.pid), "adopter": _peak(c.pid)}
        return {
            "base_bytes": size,
            "tensor_bytes": numel * 4,
            "copy_s": copy_s,
            "copy_gib_per_s": size / 2**30 / copy_s,
            "adopt_s": adopt_s,
            "adopt_gib_per_s": size / 2**30 / adopt_s,
            "peak_bytes": peaks,
            "peak_over_base": {k: v / size for k, v in peaks.items()},
            "bit_for_bit": True,
        }
    finally:
        for sock, proc in ((a_sock, a), (c_sock, c)):
            if proc is not None:
                stop(sock)
                proc.wait(60)
        if b.poll() is None:
            b.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", default="0.27,1.1,2.2", help="base sizes in GiB, comma-separated")
    args = parser.parse_args()
    runs = {}
    for gib in (float(g) for g in args.gib.split(",")):
        with tempfile.TemporaryDirectory(prefix="ring_copy_") as work:
            runs[str(gib)] = r = measure(gib, Path(work))
        print(
            f"base {r['base_bytes'] / 2**30:.2f} GiB: to the peer {r['copy_s']:.2f} s "
            f"({r['copy_gib_per_s']:.2f} GiB/s), adopted back {r['adopt_s']:.2f} s; peak memory "
            + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in r["peak_bytes"].items())
        )
    result = {
        "runs": runs,
        "setup": {
            "command": " ".join(["python", "benchmarks/ring_copy.py", *sys.argv[1:]]),
            "torch": torch.__version__,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        },
    }
    out = RESULTS / "ring_copy.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
