#!/usr/bin/env bash
# The main demo: a tiny GPT trains on the shipped corpus on 2 processes (CPU with gloo when there
# is no GPU), saves stock megatron dist checkpoints, stops at iteration 20 as if the job had ended,
# restarts from the newest checkpoint in new processes, and finishes at iteration 40.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="${DEMO_DIR:-$repo/runs/demo}"
rm -rf "$out"
mkdir -p "$out"
ckpt="$out/checkpoints"
flags=(--train-iters 40 --save "$ckpt" --save-interval 10 --async-save)

echo "== part 1: iterations 1-20, checkpoints every 10 (async), stop at 20 =="
"$here/run_local.sh" "${flags[@]}" --exit-interval 20 2>&1 | tee "$out/part1.log" \
    | grep --line-buffered -E "^\[rank0\].*(iteration +[0-9]+/|checkpoint (of|from|to)|CPU mode)"

echo
echo "== part 2: new processes resume from $(cat "$ckpt/latest_checkpointed_iteration.txt") =="
"$here/run_local.sh" "${flags[@]}" --load "$ckpt" 2>&1 | tee "$out/part2.log" \
    | grep --line-buffered -E "^\[rank0\].*(iteration +[0-9]+/|checkpoint (of|from|to))"

loss() { grep -hE "iteration +$1/" "$out"/part*.log | sed -E 's/.*lm loss: ([^ ]+).*/\1/' | head -1; }
echo
echo "== summary =="
echo "checkpoints: $(cd "$ckpt" && ls -d iter_* | tr '\n' ' ')(latest: $(cat "$ckpt/latest_checkpointed_iteration.txt"))"
echo "lm loss: iteration 5 $(loss 5) -> iteration 20 $(loss 20) -> iteration 40 $(loss 40)"
echo "elapsed time per iteration (ms), per log interval: $(grep -hoE "elapsed time per iteration \(ms\): [0-9.]+" "$out"/part*.log | awk '{printf "%s ", $NF}')"
echo "training blocked by each checkpoint save (ms): $(grep -hoE "training blocked [0-9.]+" "$out"/part*.log | awk '{printf "%s ", $NF}')"
python3 - "$(loss 5)" "$(loss 40)" <<'PY'
import sys
first, last = map(float, sys.argv[1:])
print("loss fell" if last < first else "LOSS DID NOT FALL")
sys.exit(0 if last < first else 1)
PY
echo "logs: $out/part1.log $out/part2.log"
