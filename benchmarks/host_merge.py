"""The host merge of LowDiff+: how fast a host steps replicas of optimizer shards, per thread and
for a node's worth of shards, against the memory-copy bound measured on the same machine.

Run (from the repository root)::

    .venv/bin/python benchmarks/host_merge.py [--shard-mparams 25] [--shards 8] [--threads 1,2]

What it measures, each the best of ``--repeats`` timed runs after a warm-up:

- **copy bound**: ``dst.copy_(src)`` of a 256 MiB fp32 tensor with T torch threads, in bytes
  moved per second (read plus write): what the host's memory delivers to one streaming copy.
  The snapshot copy (the gradient buckets into a host slot) is such a copy: its rate on a CPU
  host is this one (on a GPU node it is the device-to-host link's, not measured here).
- **update bound**: ``x.mul_(c)`` of the same tensor, in place (read plus write of the same
  lines): the pattern of Adam's step, which updates parameter and moments in place; a write
  to a line just read costs no extra read, so this bound is the higher one on most hosts.
- **kernels**: one shard of ``--shard-mparams`` million fp32 parameters (in ``--tensors``
  tensors of decreasing size, as a model's; default 48), stepped by the host replica of a
  torch ``AdamW`` with each kernel: ``exact`` with training's default CPU kernel
  (``for-loop``), ``exact`` with ``foreach=True``, ``exact`` stepped a cache-sized block at a
  time (``blocked``: the same kernel and bits, :mod:`~megatron_diffckpt.blocked_adam`, what a
  replica runs), and ``fused`` (:func:`~megatron_diffckpt.replica_merger.replica_kernel`).
  Parameters per second, and Adam's memory traffic (28 bytes per parameter: parameter, gradient
  and both moments read, three written) against both bounds at the same thread count.
- **a node's shards**: ``--shards`` shards of ``--shard-mparams`` each, stepped with the fused
  kernel from one Python thread per shard (as a keeper serves its ranks), within budgets of T
  threads (:class:`~megatron_diffckpt.merge_threads.MergeThreads`); aggregate parameters per
  second and traffic against both bounds.

Results go to ``benchmarks/results/host_merge.json`` (with the machine's CPU and torch version).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from megatron_diffckpt import blocked_adam  # noqa: E402
from megatron_diffckpt.merge_threads import MergeThreads, available_cpus  # noqa: E402
from megatron_diffckpt.replica_merger import replica_of  # noqa: E402

ADAM_BYTES = 28  # per fp32 parameter: p, g, m, v read (16), p, m, v written (12)
TENSORS = 48


def _best(fn, repeats: int) -> float:
    fn()  # warm-up: first touch of pages, kernel selection
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bounds(threads: int, repeats: int) -> tuple[float, float]:
    """Bytes per second (read plus write) a streaming copy and an in-place update move with
    ``threads`` threads."""
    torch.set_num_threads(threads)
    src = torch.rand(64 * 2**20)
    dst = torch.empty_like(src)
    copy = _best(lambda: dst.copy_(src), repeats)
    update = _best(lambda: src.mul_(1.0000001), repeats)
    nbytes = 2 * src.numel() * 4
    return nbytes / copy, nbytes / update


def _shard(params: int, seed: int, tensors: int = TENSORS) -> list[torch.Tensor]:
    """``params`` parameters in ``tensors`` tensors of decreasing size (embedding-like first)."""
    weights = [1.0 / (k + 1) ** 0.5 for k in range(tensors)]
    sizes = [max(1, int(params * w / sum(weights))) for w in weights]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) * 0.02 for n in sizes]


def _replica(params: int, seed: int, kernel: str, foreach: bool | None, tensors: int = TENSORS):
    """The host replica of a training ``AdamW`` over a shard, its state made, gradients set."""
    shard = [torch.nn.Parameter(t) for t in _shard(params, seed, tensors)]
    training = torch.optim.AdamW(shard, lr=1e-4, weight_decay=0.1, foreach=foreach)
    for p in shard:
        p.grad = torch.randn_like(p) * 1e-3
    training.step()  # moments exist
    replica = replica_of(training, kernel=kernel)
    for p, q in zip(shard, replica.param_groups[0]["params"], strict=True):
        q.grad = p.grad.clone()
    return replica, sum(p.numel() for p in shard)


KERNELS = {  # name -> (replica kernel, training's foreach, stepped a block at a time)
    "exact (for-loop)": ("exact", False, False),
    "exact (foreach)": ("exact", True, False),
    "exact (blocked)": ("exact", False, True),
    "fused": ("fused", None, False),
}


def kernels(
    params: int, threads: int, repeats: int, bound: tuple[float, float], tensors: int = TENSORS
) -> list[dict]:
    torch.set_num_threads(threads)
    rows = []
    for name, (kernel, foreach, blocked) in KERNELS.items():
        replica, n = _replica(params, 0, kernel, foreach, tensors)
        seconds = _best(functools.partial(blocked_adam.step, replica) if blocked else replica.step,
                        repeats)  # fmt: skip
        rate = n / seconds
        rows.append({"kernel": name, "threads": threads, "params": n, "step_s": seconds,
                     "gparams_per_s": rate / 1e9, "gparams_per_s_per_thread": rate / threads / 1e9,
                     "adam_gb_per_s": rate * ADAM_BYTES / 1e9,
                     "share_of_copy_bound": rate * ADAM_BYTES / bound[0],
                     "share_of_update_bound": rate * ADAM_BYTES / bound[1]})  # fmt: skip
        del replica
    return rows


def node(params: int, shards: int, threads: int, repeats: int, bound: tuple[float, float]) -> dict:
    budget = MergeThreads(threads, shards)
    replicas = [_replica(params, seed, "fused", None) for seed in range(shards)]

    def merge_all() -> None:
        def one(replica) -> None:
            with budget.merging():
                replica.step()

        workers = [threading.Thread(target=one, args=(r,)) for r, _ in replicas]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    seconds = _best(merge_all, repeats)
    total = sum(n for _, n in replicas)
    rate = total / seconds
    return {"shards": shards, "threads": threads, "budget": repr(budget), "params": total,
            "merge_s": seconds, "gparams_per_s": rate / 1e9,
            "gparams_per_s_per_thread": rate / threads / 1e9,
            "adam_gb_per_s": rate * ADAM_BYTES / 1e9,
            "share_of_copy_bound": rate * ADAM_BYTES / bound[0],
            "share_of_update_bound": rate * ADAM_BYTES / bound[1]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shard-mparams", type=float, default=25.0)
    parser.add_argument("--tensors", type=int, default=TENSORS,
                        help="how many tensors the kernels' shard is in")  # fmt: skip
    parser.add_argument("--shards", type=int, default=8, help="a node's ranks")
    parser.add_argument("--node-shard-mparams", type=float, default=6.25,
                        help="parameters of each of the node's shards (millions)")  # fmt: skip
    parser.add_argument("--threads", default=None, help="thread counts (default 1..CPUs)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "host_merge.json"))
    args = parser.parse_args()
    cpus = available_cpus()
    counts = [int(t) for t in args.threads.split(",")] if args.threads else list(range(1, cpus + 1))
    measured = {t: bounds(t, args.repeats) for t in counts}
    params = int(args.shard_mparams * 1e6)
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": cpus,
                    "torch": torch.__version__, "omp": os.environ.get("OMP_NUM_THREADS")},
        "copy_bound_gb_per_s": {str(t): b[0] / 1e9 for t, b in measured.items()},
        "update_bound_gb_per_s": {str(t): b[1] / 1e9 for t, b in measured.items()},
        "tensors": args.tensors,
        "kernels": [row for t in counts
                    for row in kernels(params, t, args.repeats, measured[t], args.tensors)],
        "node": [node(int(args.node_shard_mparams * 1e6), args.shards, t, args.repeats,
                      measured[t]) for t in counts],
    }  # fmt: skip
    print("bounds (read + write): " + ", ".join(
        f"{t} thread(s) copy {b[0] / 1e9:.1f} GB/s, in-place update {b[1] / 1e9:.1f} GB/s"
        for t, b in measured.items()))  # fmt: skip
    print(f"{'kernel':18} {'threads':>7} {'Gparam/s':>9} {'per thread':>10} {'Adam GB/s':>9} "
          f"{'of copy':>8} {'of update':>9}")  # fmt: skip
    for r in result["kernels"]:
        print(f"{r['kernel']:18} {r['threads']:>7} {r['gparams_per_s']:>9.2f} "
              f"{r['gparams_per_s_per_thread']:>10.2f} {r['adam_gb_per_s']:>9.1f} "
              f"{r['share_of_copy_bound']:>8.0%} {r['share_of_update_bound']:>9.0%}")  # fmt: skip
    for r in result["node"]:
        print(f"node: {r['shards']} shards x {args.node_shard_mparams:g}M, {r['budget']}: "
              f"{r['gparams_per_s']:.2f} Gparam/s ({r['share_of_update_bound']:.0%} of the "
              f"update bound), {r['merge_s'] * 1e3:.0f} ms per iteration")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
