#!/usr/bin/env bash
# Tiny GPT pretraining on this machine with torchrun: GPUs when present, else CPU processes with
# gloo (megatron_diffckpt.cpu_mode). Flags after the script's name are passed to pretrain_gpt.py
# and override the defaults below (argparse keeps the last occurrence).
#
#   NPROC=2 examples/gpt/run_local.sh --train-iters 40 --save runs/ckpt --save-interval 10
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python=python3
launch=("$(dirname "$python")/megatron-diffckpt-launch")
[ -x "${launch[0]}" ] || launch=("$python" -m megatron_diffckpt.launch)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

# megatron-diffckpt-launch runs torchrun and, when it ends, stops what the ranks left running
# (megatron's checkpoint manager process outlives a killed rank).
exec "${launch[@]}" --standalone --nproc-per-node "${NPROC:-2}" \
    "$here/pretrain_gpt.py" \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 \
    --seq-length 128 --max-position-embeddings 128 \
    --micro-batch-size 8 --global-batch-size 16 \
    --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 5 \
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 \
    --use-distributed-optimizer --ckpt-format torch_dist --log-interval 5 --seed 1234 \
    "$@"
