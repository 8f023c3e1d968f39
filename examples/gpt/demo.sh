#!/usr/bin/env bash
# The main demo. A tiny GPT trains on the shipped corpus on 2 processes (CPU with gloo when there
# is no GPU) with LowDiff: the data-parallel gradients are exchanged top-k compressed (1%, error
# feedback; COMPRESSOR=none keeps megatron's dense reduction) and every iteration's optimizer input
# is written as a differential (--diffckpt-mode lowdiff), with a stock megatron dist checkpoint
# (base, saved asynchronously) every 10 iterations. One rank is killed with SIGKILL at a random
# iteration; torchrun tears the job down; new processes load the newest base, replay the
# differentials every rank holds durably, and finish. The recovered state is compared, tensor by
# tensor, with an uninterrupted run of the same job at the same iteration, and so is the final one.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
out="${DEMO_DIR:-$repo/runs/demo}"
iters=40
kill_at="${KILL_AT:-$((12 + RANDOM % 20))}"
compressor="${COMPRESSOR:-topk}"
rm -rf "$out"
mkdir -p "$out"
ckpt="$out/checkpoints"
show() { grep --line-buffered -E "^\[rank0\].*(iteration +[0-9]*[05]/|checkpoint (of|from|to)|recover|replayed|CPU mode)" || true; }
train=(--train-iters "$iters" --log-interval 1 --overlap-grad-reduce
       --diffckpt-compressor "$compressor" --diffckpt-topk-ratio 0.01)
job=("${train[@]}" --save "$ckpt" --save-interval 10 --async-save
     --diffckpt-mode lowdiff --diffckpt-batch-size 1 --diffckpt-keep-bases 2)

echo "== 1. LowDiff training ($compressor exchange); one rank gets SIGKILL at iteration $kill_at (or, if later, once base 10 is published) =="
"$here/run_local.sh" "${job[@]}" > "$out/crashed.log" 2>&1 &
launcher=$!
# Kill once iteration $kill_at has run and base 10 is published (the job's base 0, saved as it
# starts, would do as well; after base 10 the restart shows a shorter replay).
until grep -qE "iteration +$kill_at/" "$out/crashed.log" 2>/dev/null \
        && grep -q "saved checkpoint from iteration 10 " "$out/crashed.log"; do
    kill -0 "$launcher" 2>/dev/null || { tail -30 "$out/crashed.log"; exit 1; }
    sleep 0.05
done
workers=($(pgrep -P "$(pgrep -P "$launcher" -f "torch.distributed.run|megatron_diffckpt.torchrun" || echo "$launcher")" || true))
[ "${#workers[@]}" -gt 0 ] || workers=($(pgrep -f "$here/pretrain_gpt.py" | grep -v "^$launcher$"))
victim="${workers[$((RANDOM % ${#workers[@]}))]}"
kill -9 "$victim"
wait "$launcher" || true
show < "$out/crashed.log"
echo "killed pid $victim (SIGKILL); the job ended at: $(grep -oE "iteration +[0-9]+/" "$out/crashed.log" | tail -1)"
echo "base on disk: iteration $(cat "$ckpt/latest_checkpointed_iteration.txt")"
"$python" -m megatron_diffckpt.cli inspect "$ckpt" | sed 's/^/  /'

recoverable="$("$python" -m megatron_diffckpt.cli inspect "$ckpt" --json | "$python" -c "import json, sys; print(json.load(sys.stdin)['recoverable_iteration'])")"

echo
echo "== 2. restart: load the base, replay the differentials up to iteration $recoverable, finish =="
"$here/run_local.sh" "${job[@]}" --load "$ckpt" --dump-state "$out/recovered" \
    --dump-state-at "$recoverable" 2>&1 | tee "$out/recovered.log" | show
echo "after the run (retention keeps 2 bases and the differentials after the older one):"
"$python" -m megatron_diffckpt.cli inspect "$ckpt" | sed 's/^/  /'


echo
echo "== 3. reference: the same job, $iters iterations without interruption =="
"$here/run_local.sh" "${train[@]}" --dump-state "$out/reference" --dump-state-at "$recoverable" \
    2>&1 | tee "$out/reference.log" | show

echo
echo "== summary =="
recovered="$(grep -oE "recovered to iteration [0-9]+" "$out/recovered.log" | grep -oE "[0-9]+$")"
echo "killed after iteration $(grep -oE "iteration +[0-9]+/" "$out/crashed.log" | tail -1 | grep -oE "[0-9]+"); recovered to iteration $recovered (base $(grep -oE "base at iteration [0-9]+" "$out/recovered.log" | grep -oE "[0-9]+$") + $(grep -oE "[0-9]+ differential\(s\) to replay" "$out/recovered.log" | grep -oE "^[0-9]+") differentials)"
loss() { grep -hE "iteration +$1/" "$2" | sed -E 's/.*lm loss: ([^ ]+).*/\1/' | head -1; }
echo "lm loss of the uninterrupted run: iteration 5 $(loss 5 "$out/reference.log") -> iteration $iters $(loss "$iters" "$out/reference.log")"
"$python" - "$out" "$recovered" "$compressor" <<'PY'
import glob, os, sys
import torch
out, t, compressor = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def compare(ref_dir, rec_dir):
    """(tensors equal, tensors, largest parameter difference) over every rank's dump."""
    same, total, worst = 0, 0, 0.0
    for path in sorted(glob.glob(os.path.join(ref_dir, "rank_*.pt"))):
        a = torch.load(path, weights_only=True)
        b = torch.load(os.path.join(rec_dir, os.path.basename(path)), weights_only=True)
        pairs = [(a["params"][k], b["params"][k]) for k in a["params"]]
        worst = max([worst] + [(x - y).abs().max().item() for x, y in pairs])
        pairs += [(x[k], y[k]) for x, y in zip(a["optimizer"], b["optimizer"]) for k in x]
        same += sum(torch.equal(x, y) for x, y in pairs)
        total += len(pairs)
    return same, total, worst

at = f"iter_{t:07d}"
same, total, _ = compare(os.path.join(out, "reference", at), os.path.join(out, "recovered", at))
exact_at_t = same == total
print(f"state at the recovered iteration {t} equals the uninterrupted run's: "
      f"{'YES' if exact_at_t else 'NO'} ({same} of {total} tensors torch.equal: parameters, "
      "main params, exp_avg, exp_avg_sq, step)")
same, total, worst = compare(os.path.join(out, "reference"), os.path.join(out, "recovered"))
ref = torch.load(os.path.join(out, "reference", "rank_0.pt"), weights_only=True)["losses"]
rec = torch.load(os.path.join(out, "recovered", "rank_0.pt"), weights_only=True)["losses"]
final_equal = same == total and ref[-len(rec):] == rec
print(f"final state equals the uninterrupted run's: {'YES' if final_equal else 'NO'} "
      f"({same} of {total} tensors torch.equal)")
if compressor != "none":
    print(f"  expected with top-k: the error-feedback residuals come from the base, so training "
          f"after iteration {t} differs by what they held (largest parameter difference "
          f"{worst:.2e}; final loss {rec[-1]:.4f} vs {ref[-1]:.4f} uninterrupted)")
sys.exit(0 if exact_at_t and (final_equal or compressor != "none") else 1)
PY
echo "logs: $out/*.log"
