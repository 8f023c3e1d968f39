"""Command-line flags of the GPT pretraining example: Megatron-LM's names for the common subset.

Defaults follow Megatron-LM where it has one; the model defaults are a tiny GPT that trains on two
CPU processes in seconds per iteration.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from megatron_diffckpt.checkpoint_layout import (
    TRACKER_FILENAME,
    CheckpointNotFoundError,
    find_latest_iteration,
    has_tracker,
)
from megatron_diffckpt.config import DiffCkptConfig
from megatron_diffckpt.errors import DiffCkptUsageError

_LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")


def _positive(kind: type):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="GPT pretraining on megatron-core (Megatron-LM flag names).",
        allow_abbrev=False,
    )
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=_positive(int), default=1)
    g.add_argument("--pipeline-model-parallel-size", type=_positive(int), default=1)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument(
        "--expert-model-parallel-size",
        type=_positive(int),
        default=1,
        help="Ranks the experts of each MoE layer are split over (within data parallelism).",
    )

    g = p.add_argument_group("mixture of experts (Megatron-LM's flags and defaults)")
    g.add_argument(
        "--num-experts",
        type=_positive(int),
        default=None,
        help="Experts per MLP layer (megatron's local MoE layer); none: a dense MLP.",
    )
    g.add_argument("--moe-router-topk", type=_positive(int), default=2)
    g.add_argument(
        "--moe-token-dispatcher-type", choices=("allgather", "alltoall"), default="allgather"
    )
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=_positive(int), default=2)
    g.add_argument("--hidden-size", type=_positive(int), default=64)
    g.add_argument("--num-attention-heads", type=_positive(int), default=4)
    g.add_argument("--ffn-hidden-size", type=_positive(int), default=None)
    g.add_argument("--seq-length", type=_positive(int), default=64)
    g.add_argument("--max-position-embeddings", type=_positive(int), default=None)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument(
        "--disable-bias-linear",
        action="store_true",
        help="No bias in the linear layers (Megatron-LM's flag; MoE models need it here).",
    )
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=_positive(int), default=4)
    g.add_argument("--global-batch-size", type=_positive(int), default=None)
    g.add_argument("--train-iters", type=_positive(int), required=True)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=_positive(int), default=1)
    g.add_argument(
        "--tensorboard-dir",
        type=str,
        default=None,
        help="write TensorBoard scalars here (loss, times, checkpoint metrics; needs tensorboard)",
    )

    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=_LR_DECAY_STYLES, default="cosine")
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", type=str, default=None, help="Directory to save checkpoints to.")
    g.add_argument(
        "--load",
        type=str,
        default=None,
        help="Directory to resume from. As Megatron-LM: a folder that does not exist or holds no "
        "checkpoint (no tracker) starts from scratch with a warning.",
    )
    g.add_argument(
        "--exit-on-missing-checkpoint",
        action="store_true",
        help="With --load: exit (code 2) when it holds no checkpoint, instead of starting from "
        "scratch.",
    )
    g.add_argument("--save-interval", type=_positive(int), default=None)
    g.add_argument(
        "--ckpt-format",
        choices=("torch_dist", "torch_dcp"),
        default="torch_dist",
        help="torch_dist: megatron dist_checkpointing (the bases of differential checkpointing); "
        "torch_dcp: PyTorch DCP, for comparison",
    )
    g.add_argument("--async-save", action="store_true")
    g.add_argument(
        "--exit-interval",
        type=_positive(int),
        default=None,
        help="Stop (after saving, when --save is set) once the iteration is a multiple of this.",
    )

    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true", help="Random tokens (speed tests).")
    g.add_argument(
        "--data-path",
        type=str,
        default=None,
        help="A UTF-8 text file, tokenized as bytes. Default: the corpus shipped with the example.",
    )

    g = p.add_argument_group("this example")
    g.add_argument(
        "--cpu",
        action="store_true",
        help="Run on CPU with gloo (megatron_diffckpt.cpu_mode). Automatic when CUDA is absent.",
    )
    g.add_argument(
        "--dump-state",
        type=str,
        default=None,
        help="After training, write each rank's parameters, optimizer shard and losses to "
        "DIR/rank_<r>.pt (used by the exact-resume tests).",
    )
    g.add_argument(
        "--dump-state-at",
        type=int,
        nargs="+",
        default=[],
        metavar="ITER",
        help="Also write the state as it is after these iterations (or as loaded, when --load "
        "resumes at one of them) to DIR/iter_<ITER>/rank_<r>.pt; needs --dump-state DIR.",
    )
    g.add_argument(
        "--dump-model-space",
        action="store_true",
        help="With --dump-state: also write each rank's pieces of the model and optimizer state "
        "in model space (global keys and offsets) to model_space_<r>.pt, so that states of "
        "different parallel layouts compare as whole tensors (used by the reshard tests).",
    )
    DiffCkptConfig.add_arguments(p)
    return p


def parse_args(argv: Sequence[str] | None = None, world_size: int | None = None):
    """Parse and validate flags; ``parser.error`` (exit 2, with the reason) on bad input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.world_size = world_size

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp) != 0:
        parser.error(
            f"world size {world_size} is not divisible by tensor-model-parallel size {tp} x "
            f"pipeline-model-parallel size {pp} = {tp * pp}; launch a multiple of {tp * pp} "
            "processes or change the parallel sizes"
        )
    args.data_parallel_size = world_size // (tp * pp)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step != 0:
        parser.error(
            f"--global-batch-size {args.global_batch_size} is not a multiple of "
            f"--micro-batch-size {args.micro_batch_size} x data-parallel size "
            f"{args.data_parallel_size} = {per_step}"
        )
    args.num_microbatches = args.global_batch_size // per_step
    ep = args.expert_model_parallel_size
    if args.num_experts is None and ep > 1:
        parser.error(f"--expert-model-parallel-size {ep} needs --num-experts")
    if args.num_experts is not None:
        if not args.disable_bias_linear:
            parser.error(
                "--num-experts needs --disable-bias-linear: megatron's local expert MLPs add "
                "their bias in place to a tensor autograd forbids changing (megatron-core "
                "0.16-0.19), and Megatron-LM's MoE recipes run without biases"
            )
        if args.data_parallel_size % ep != 0:
            parser.error(
                f"--expert-model-parallel-size {ep} does not divide the data-parallel size "
                f"{args.data_parallel_size}"
            )
        _divisible(parser, "--num-experts", args.num_experts, "--expert-model-parallel-size", ep)
        if args.moe_router_topk > args.num_experts:
            parser.error(
                f"--moe-router-topk {args.moe_router_topk} is larger than --num-experts "
                f"{args.num_experts}"
            )
    _divisible(parser, "--num-layers", args.num_layers, "--pipeline-model-parallel-size", pp)
    heads = args.num_attention_heads
    _divisible(parser, "--num-attention-heads", heads, "--tensor-model-parallel-size", tp)
    _divisible(parser, "--hidden-size", args.hidden_size, "--num-attention-heads", heads)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.max_position_embeddings < args.seq_length:
        parser.error(
            f"--max-position-embeddings {args.max_position_embeddings} is smaller than "
            f"--seq-length {args.seq_length}"
        )
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_iters < 0 or args.lr_warmup_iters >= max(args.lr_decay_iters, 1):
        if args.lr_warmup_iters != 0:
            parser.error(
                f"--lr-warmup-iters {args.lr_warmup_iters} must be in [0, --lr-decay-iters "
                f"{args.lr_decay_iters})"
            )
    if args.min_lr > args.lr:
        parser.error(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    if args.save_interval is not None and args.save is None:
        parser.error("--save-interval needs --save DIR")
    if args.async_save and args.save is None:
        parser.error("--async-save needs --save DIR")
    if args.dump_state_at and args.dump_state is None:
        parser.error("--dump-state-at needs --dump-state DIR")
    if args.mock_data and args.data_path:
        parser.error("--mock-data and --data-path exclude each other")
    args.load_missing = None
    if args.load is not None:
        args.load_missing = _check_load_dir(parser, args.load, args.exit_on_missing_checkpoint)
    try:
        args.diffckpt = DiffCkptConfig.from_args(args)
        args.diffckpt.check_launch(args)
    except DiffCkptUsageError as exc:
        parser.error(str(exc))
    args.base_interval = args.diffckpt.full_interval or args.save_interval
    if args.data_path is not None and not os.path.isfile(args.data_path):
        parser.error(f"--data-path {args.data_path}: no such file")
    return args


def _divisible(
    parser: argparse.ArgumentParser, flag: str, value: int, by_flag: str, by: int
) -> None:
    """``parser.error`` unless ``by`` divides ``value`` (the flags' names say which)."""
    if value % by != 0:
        parser.error(f"{flag} {value} is not divisible by {by_flag} {by}")


def _check_load_dir(
    parser: argparse.ArgumentParser, load: str, exit_on_missing: bool
) -> str | None:
    """``None`` when ``load`` holds a checkpoint to resume; the reason when it holds none (no
    folder, no tracker: Megatron-LM then starts from scratch). A tracker that names a missing
    or incomplete checkpoint is an error either way: something is broken there."""
    if not has_tracker(load):
        reason = (
            f"{load}: no such directory"
            if not os.path.isdir(load)
            else f"{load} holds no checkpoint (no {TRACKER_FILENAME})"
        )
        if exit_on_missing:
            parser.error(f"--load: {reason} (--exit-on-missing-checkpoint)")
        return reason
    try:
        find_latest_iteration(load)
    except CheckpointNotFoundError as exc:
        parser.error(f"--load: {exc}")
    return None
