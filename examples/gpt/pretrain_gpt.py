"""GPT pretraining on megatron-core, with Megatron-LM's flags, on GPUs or on CPU processes.

Launch with torchrun (see ``run_local.sh``)::

    torchrun --nproc-per-node 2 examples/gpt/pretrain_gpt.py --train-iters 50 \\
        --save /tmp/ckpt --save-interval 10

It builds megatron's GPTModel (the transformer-engine layer spec when that package imports, the
local spec otherwise), wraps it in megatron DDP, uses megatron's optimizer (the distributed
optimizer with ``--use-distributed-optimizer``) and a Megatron-style LR schedule, runs the
forward/backward schedule from ``get_forward_backward_func`` (1F1B when PP > 1), and saves and
loads stock ``dist_checkpointing`` checkpoints (model, optimizer, scheduler, RNG, iteration,
data position), so a stopped and resumed run continues bit-exactly.

Without CUDA (or with ``--cpu``) it runs on CPU processes with gloo through
:mod:`megatron_diffckpt.cpu_mode`, which must be applied before megatron is imported: that is why
the imports of megatron below sit inside functions.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from arguments import parse_args  # noqa: E402

from megatron_diffckpt import cpu_mode  # noqa: E402
from megatron_diffckpt.background import helpers_die_with_this_rank  # noqa: E402

helpers_die_with_this_rank()  # what this rank starts (megatron's checkpoint writers) dies with it
cpu_mode.enable_if_inherited()  # a helper that megatron started by spawn or forkserver

logger = logging.getLogger("pretrain_gpt")

# Expected on a machine without transformer-engine/apex, or raised by megatron-core's own calls;
# none of them is actionable for a user of this example.
for _message in (
    ".*Transformer Engine and Apex are not installed.*",
    ".*Apex is not installed.*",
    ".*full scope is deprecated.*",
    ".*is not a leaf Tensor is being accessed.*",
    ".*torch.distributed.(reduce_scatter_tensor|all_gather_into_tensor|_all_gather_base).*",
):
    warnings.filterwarnings("ignore", message=_message)


def _use_cpu(args) -> bool:
    return args.cpu or not torch.cuda.is_available()


def initialize(args) -> None:
    """Process groups, CPU mode when needed, model-parallel groups, seeds. All ranks."""
    cpu = _use_cpu(args)
    if cpu:
        cpu_mode.enable()
    if not torch.distributed.is_initialized():
        if cpu:
            torch.distributed.init_process_group("gloo")
        else:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            torch.distributed.init_process_group("nccl")
    rank = torch.distributed.get_rank()
    logging.basicConfig(
        level=logging.INFO,
        format=f"[rank{rank}] %(asctime)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    if cpu:
        logger.info("CPU mode: megatron-core on %d CPU processes with gloo", args.world_size)
    from megatron_diffckpt.patches import torch_adam_state

    torch_adam_state.apply()  # a no-op with transformer-engine's or apex's Adam

    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
    )
    # As Megatron-LM's _set_random_seed: a different seed per pipeline stage, the same on every
    # data-parallel rank; the tracker derives the tensor-parallel seeds from it.
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_model_and_optimizer(args):
    """GPTModel in megatron DDP, megatron's optimizer and LR scheduler. All ranks.

    With ``--diffckpt-compressor topk`` the DDP gradient reduction is the compressed exchange,
    returned as the fourth value (its error-feedback residuals go into every checkpoint).
    """
    from data import VOCAB_SIZE
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=args.bf16,
        use_cpu_initialization=_use_cpu(args),
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        add_bias_linear=not args.disable_bias_linear,
        num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        expert_model_parallel_size=args.expert_model_parallel_size,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(args.num_experts),
        vocab_size=VOCAB_SIZE,
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
    )
    if not _use_cpu(args):
        model.cuda(torch.cuda.current_device())
    if args.bf16:
        # As Megatron-LM: casts the first stage's inputs to bf16 and the last stage's outputs
        # back to fp32; state dicts pass through to the GPT model.
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    from megatron_diffckpt.patches import grad_sync

    exchange = grad_sync.attach_compressor(
        [model], args.diffckpt.compressor, args.diffckpt.topk_ratio
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            clip_grad=args.clip_grad,
            bf16=args.bf16,
            params_dtype=dtype,
            use_distributed_optimizer=args.use_distributed_optimizer,
        ),
        [model],
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if args.lr_warmup_iters > 0 else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
        lr_decay_steps=args.lr_decay_iters * args.global_batch_size,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * args.global_batch_size,
        wd_incr_style="constant",
    )
    # Megatron-LM's wiring of gradient reduction into the schedule: without
    # finalize_model_grads_func the gradients are never reduced across data-parallel ranks.
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    if args.overlap_grad_reduce:
        config.grad_sync_func = model.start_grad_sync
    config.grad_scale_func = optimizer.scale_loss
    return model, optimizer, scheduler, exchange


def _layer_spec(num_experts: int | None):
    """transformer-engine's layer where it is installed, megatron's local one elsewhere; a MoE
    MLP with ``num_experts`` (its experts as separate MLPs: no grouped gemm)."""
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(num_experts, moe_grouped_gemm=False)
    except ImportError:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec(num_experts, moe_grouped_gemm=False)


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean token loss of one micro-batch; reports it averaged over data-parallel ranks."""
    from megatron.core import parallel_state

    losses = output_tensor.float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()
    reported = loss.detach().clone()
    torch.distributed.all_reduce(reported, group=parallel_state.get_data_parallel_group())
    reported /= parallel_state.get_data_parallel_world_size()
    return loss, {"lm loss": reported}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    output = model(
        batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"]
    )
    return output, partial(_loss_func, batch["loss_mask"])


def train_step(args, model, optimizer, scheduler, data_iterator, forward_backward):
    """One iteration: forward/backward over the micro-batches, optimizer step, LR step."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = forward_backward(
        forward_step_func=_forward_step,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=args.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=False,
    )
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful:
        scheduler.step(increment=args.global_batch_size)
    loss = None
    if losses:  # last pipeline stage only
        loss = torch.stack([x["lm loss"] for x in losses]).mean()
    return loss, grad_norm, not update_successful


def _broadcast_loss(loss: torch.Tensor | None) -> float:
    """The iteration's loss on every rank (it is computed on the last pipeline stage)."""
    from megatron.core import parallel_state

    t = torch.zeros(1, dtype=torch.float64)
    if (
        loss is not None
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    ):
        t[0] = loss.double()
    if torch.cuda.is_available() and not torch.distributed.get_backend() == "gloo":
        t = t.cuda()
    torch.distributed.all_reduce(t)
    return float(t.item())


def dump_state(path: str, model, optimizer, losses: list[float], model_space: bool = False) -> None:
    """Write this rank's parameters, optimizer shard and losses to ``path/rank_<r>.pt``; with
    ``model_space``, also its pieces of the state in model space (:func:`_model_space_pieces`)
    to ``path/model_space_<r>.pt``. All ranks, collectively (the model-space view gathers)."""
    os.makedirs(path, exist_ok=True)
    if model_space:
        torch.save(
            _model_space_pieces(model, optimizer),
            os.path.join(path, f"model_space_{torch.distributed.get_rank()}.pt"),
        )
    params = {n: p.detach().cpu().clone() for n, p in model.module.named_parameters()}
    opt_state = []
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_opt = inner.optimizer
        for group in torch_opt.param_groups:
            for p in group["params"]:
                st = torch_opt.state.get(p, {})
                opt_state.append(
                    {
                        "main_param": p.detach().cpu().clone(),
                        **{
                            k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                            for k, v in st.items()
                        },
                    }
                )
    rank = torch.distributed.get_rank()
    torch.save(
        {"params": params, "optimizer": opt_state, "losses": losses},
        os.path.join(path, f"rank_{rank}.pt"),
    )


def _model_space_pieces(model, optimizer) -> list[tuple]:
    """This rank's main-replica pieces of every model tensor, and of the distributed optimizer's
    main parameters and moments placed in model space (``optimizer.state.<name>.<model key>``,
    the names of megatron's ``fully_reshardable`` format), each as ``(key, global_shape,
    global_offset, local_shape, (start, end), values)``: ``values`` is the flat range
    ``[start, end)`` of the local tensor at ``global_offset``. Pieces of all ranks assemble into
    whole tensors, whatever the parallel layout: what lets a test compare states across layouts.
    The optimizer's pieces are placed by the rank's shard map (megatron's own sharded state dict
    and the optimizer's parameter ranges), not by megatron's ``fully_reshardable`` save, whose
    gather in megatron-core 0.16.1 is not exact."""
    from checkpointing import base_layout
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_diffckpt.patches import optimizer_layout, optimizer_step
    from megatron_diffckpt.shard_map import STATE_NAMES, build_shard_map

    state = base_layout(model, optimizer)
    shapes, pieces = {}, []
    for t in nested_values(state["model"]):
        if not isinstance(t, ShardedTensor):
            continue
        shapes[t.key] = tuple(t.global_shape)
        replica = t.replica_id if isinstance(t.replica_id, tuple) else (t.replica_id,)
        if all(r == 0 for r in replica):
            flat = t.data.detach().cpu().reshape(-1).clone()
            pieces.append((t.key, shapes[t.key], tuple(t.global_offset), tuple(t.data.shape),
                           (0, flat.numel()), flat))  # fmt: skip
    inners = optimizer_step.inner_optimizers(optimizer)
    torch_optimizers = [i.optimizer for i in inners]
    coords = (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
    )
    smap = build_shard_map(
        state, torch_optimizers, optimizer_layout.main_param_sources(optimizer), "", coords,
        (0, 0, 0),
    )  # fmt: skip
    for torch_opt, entry in zip(torch_optimizers, smap.inner, strict=True):
        for group, entries in zip(torch_opt.param_groups, entry.groups, strict=True):
            for p, e in zip(group["params"], entries, strict=True):
                values = {"param": p, **{n: torch_opt.state[p][n] for n in STATE_NAMES}}
                for m in e.model:
                    if not m.saved_by_data_parallel_ranks():
                        continue
                    for name, v in values.items():
                        pieces.append((f"optimizer.state.{name}.{m.key}", shapes[m.key],
                                       m.global_offset, m.local_shape, tuple(e.model_range),
                                       v.detach().cpu().reshape(-1).clone()))  # fmt: skip
    return pieces


def _dump_dir(args, iteration: int) -> str:
    return os.path.join(args.dump_state, f"iter_{iteration:07d}")


def main(argv=None) -> int:
    args = parse_args(argv)
    initialize(args)
    from megatron_diffckpt.control import end_rank

    try:
        return train(args)
    except Exception as exc:  # in one line where it tells all, else its traceback
        return end_rank(exc, lambda line: logger.error("pretrain_gpt.py: %s", line))


def train(args) -> int:
    """Build, load or recover, train, save. All ranks."""

    from checkpointing import Checkpointer, base_layout
    from data import TokenWindows, batch_iterator, load_tokens
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_diffckpt.checkpoint_layout import find_latest_iteration, has_tracker

    model, optimizer, scheduler, exchange = build_model_and_optimizer(args)
    residuals = exchange.residuals if exchange is not None else None
    num_params = sum(p.numel() for p in model.module.parameters())
    logger.info(
        "GPT: %d layers, hidden %d, %d heads, seq %d; TP=%d PP=%d DP=%d; "
        "%d parameters on rank 0; %d micro-batches of %d per iteration",
        args.num_layers,
        args.hidden_size,
        args.num_attention_heads,
        args.seq_length,
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.data_parallel_size,
        num_params,
        args.num_microbatches,
        args.micro_batch_size,
    )

    manager = None
    parallel_sizes = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.data_parallel_size,
    )
    if args.diffckpt.enabled:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        from megatron_diffckpt.manager import DiffCheckpointManager

        coords = (
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_data_parallel_rank(),
        )
        manager = DiffCheckpointManager(
            args.diffckpt, args.save, optimizer, get_cuda_rng_tracker(), coords, [model], residuals
        )

    iteration, consumed = 0, 0
    saved = 0  # the iteration of the base --load loaded
    if args.load_missing is not None:  # Megatron-LM's behaviour: warn, start from scratch
        logger.warning(
            "WARNING: --load %s: will not load any checkpoint and will start from random "
            "(use --exit-on-missing-checkpoint to stop instead)",
            args.load_missing,
        )
        args.load = None
    load_start = time.perf_counter()

    def load_base() -> int:  # storage's newest base, into the model and optimizer
        nonlocal consumed
        if args.ckpt_format == "torch_dcp":
            from dcp_checkpointing import DcpCheckpointer

            loaded, consumed = DcpCheckpointer.load(args.load, model, optimizer, scheduler)
        else:
            loaded, consumed = Checkpointer.load(args.load, model, optimizer, scheduler, residuals)
        return loaded

    if args.load is not None and manager is None:
        iteration = saved = load_base()
    elif args.load is not None:
        stored = find_latest_iteration(args.load) if has_tracker(args.load) else None
        # the node keepers' replicas or kept bases first (no base read), then storage's
        got = manager.recover(stored, load_base)
        iteration, saved = got.iteration, got.base if got.base is not None else (stored or 0)
        if got.scheduler_steps is not None:
            scheduler.num_steps = got.scheduler_steps
            scheduler.step(increment=0)  # the LR the next iteration uses
            consumed = got.consumed_samples
        logger.info(  # the lines before say what the keepers held: a replica, or a base
            "recovered to iteration %d in %.3f s (%s)",
            iteration,
            time.perf_counter() - load_start,
            "from the node keepers' memory"
            if got.tier == "keepers"
            else f"from storage: base {saved} and the diff log",
        )
    if iteration in args.dump_state_at:
        dump_state(_dump_dir(args, iteration), model, optimizer, [], args.dump_model_space)
    if args.ckpt_format == "torch_dcp":
        from dcp_checkpointing import DcpCheckpointer

        checkpointer = DcpCheckpointer(args.save, args.async_save)
    else:
        checkpointer = Checkpointer(
            args.save,
            args.async_save,
            manager.on_base_published if manager else None,
            residuals,
            manager.base_failed if manager else None,
        )
    if manager is not None:
        manager.start(iteration, args.base_interval)
    from observability import Observer

    observer = Observer(args, manager)

    tokens = load_tokens(args.data_path, args.mock_data, args.seq_length, args.seed)
    windows = TokenWindows(tokens, args.seq_length, args.seed)
    data = batch_iterator(
        windows,
        consumed,
        args.micro_batch_size,
        parallel_state.get_data_parallel_rank(),
        args.data_parallel_size,
    )
    forward_backward = get_forward_backward_func()
    model.train()

    def save_base(iteration: int, consumed: int) -> float:
        """A base of ``iteration`` (through the manager when there is one); blocked seconds."""
        if manager is not None:
            save = checkpointer.base_saver(model, scheduler, iteration, consumed)
            return manager.save_base(iteration, save)
        return checkpointer.save(model, optimizer, scheduler, iteration, consumed)

    if args.save is not None and saved < iteration >= args.train_iters:
        # Recovered onto the last iteration (killed before its base was published): the job
        # still ends with its final base, as one that trained to the end.
        logger.info("saving the base of the recovered iteration %d (end of training)", iteration)
        save_base(iteration, consumed)
    elif args.save is not None and manager is not None and manager.base_due(iteration):
        # A job from scratch: its starting point is a base too, published before the first
        # iteration, so that every iteration is recoverable from the first on.
        logger.info("saving the base of iteration %d, where this job starts", iteration)
        save_base(iteration, consumed)
        checkpointer.finalize(blocking=True)  # published before the first iteration

    losses: list[float] = []
    skipped = 0
    # Accumulated over the log interval, as Megatron-LM reports them.
    interval = {"loss": 0.0, "time": 0.0, "iters": 0, "ckpt": 0.0, "diff": 0.0}
    while iteration < args.train_iters:
        # Elapsed time per iteration spans the whole loop body, checkpointing included (as
        # Megatron-LM's); "checkpoint time" is the part a save blocked training.
        start = time.perf_counter()
        loss, grad_norm, was_skipped = train_step(
            args, model, optimizer, scheduler, data, forward_backward
        )
        iteration += 1
        consumed += args.global_batch_size
        skipped += int(was_skipped)
        if manager is not None:
            train_s = time.perf_counter() - start
            with observer.timer("diffckpt-diff"):
                manager.end_iteration(iteration, scheduler.num_steps, consumed, train_s)
            interval["diff"] += manager.last_diff_seconds
            if args.ckpt_format == "torch_dist":  # the map `megatron-diffckpt merge` needs
                manager.record_shard_map(lambda: base_layout(model, optimizer), parallel_sizes)
        loss_value = _broadcast_loss(loss)
        losses.append(loss_value)
        checkpointer.finalize()
        stop = args.exit_interval is not None and iteration % args.exit_interval == 0
        if manager is not None:
            due = manager.base_due(iteration)
        else:
            due = args.base_interval is not None and iteration % args.base_interval == 0
        if args.save is not None and (due or stop or iteration == args.train_iters):
            with observer.timer("save-checkpoint"):
                interval["ckpt"] += save_base(iteration, consumed)
        interval["time"] += time.perf_counter() - start
        interval["loss"] += loss_value
        interval["iters"] += 1
        if iteration % args.log_interval == 0:
            n = interval["iters"]
            logger.info(
                " iteration %8d/%8d | consumed samples: %10d | elapsed time per iteration (ms): "
                "%.1f | learning rate: %.6E | global batch size: %5d | lm loss: %.6E | "
                "grad norm: %.3f | checkpoint time (ms): %.1f | "
                "number of skipped iterations: %3d |%s",
                iteration,
                args.train_iters,
                consumed,
                interval["time"] / n * 1000.0,
                optimizer.param_groups[0]["lr"],
                args.global_batch_size,
                interval["loss"] / n,
                float(grad_norm or 0.0),
                interval["ckpt"] * 1000.0,
                skipped,
                f" diff time (ms): {interval['diff'] / n * 1000.0:.1f} | durable diff iteration: "
                f"{manager.durable_iteration} |{observer.line(iteration)}"
                if manager
                else "",
            )
            observer.log(
                iteration,
                n,
                {
                    "lm loss": interval["loss"] / n,
                    "iteration-time": interval["time"] / n,
                    "learning-rate": optimizer.param_groups[0]["lr"],
                },
            )
            interval = {"loss": 0.0, "time": 0.0, "iters": 0, "ckpt": 0.0, "diff": 0.0}
        if iteration in args.dump_state_at:
            dump_state(_dump_dir(args, iteration), model, optimizer, losses, args.dump_model_space)
        if stop:
            logger.info(
                "exiting at iteration %d (--exit-interval %d)", iteration, args.exit_interval
            )
            break
    replica = None
    if manager is not None:
        replica = manager.replica_view()  # LowDiff+: complete once close() merged everything
        manager.close()
    checkpointer.close()
    observer.close()
    if args.dump_state:
        dump_state(args.dump_state, model, optimizer, losses, args.dump_model_space)
        if replica is not None:
            dump_state(os.path.join(args.dump_state, "replica"), model, replica, losses)
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
