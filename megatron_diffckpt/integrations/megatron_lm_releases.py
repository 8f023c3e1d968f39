"""What each tested Megatron-LM release looks like where :mod:`megatron_lm` hooks it.

The Megatron-LM tags the hooks were checked against, the commit of each (the Dockerfile fetches
Megatron-LM by commit), and the signatures of the hooked functions per megatron-core release:
the drift check accepts any tested one and names them all when none matches; the hooks bind
arguments by name, so that each release's order and extra arguments pass through.
"""

from __future__ import annotations

# Megatron-LM versions (git tags of its repository) these hooks were checked against, and the
# commit of each tag (the Dockerfile fetches Megatron-LM by commit).
TESTED_MEGATRON_LM_VERSIONS = ("core_v0.16.1", "core_v0.19.0")
MEGATRON_LM_COMMITS = {
    "core_v0.16.1": "55ac7082517c3878ae653c07c09c534b8aed49f6",
    "core_v0.19.0": "5be9626709af2722333bf54797c954c09edeada3",
}

TRAINING = "megatron.training.training"
CHECKPOINTING = "megatron.training.checkpointing"
_GROUP = "Optional[torch.distributed.distributed_c10d.ProcessGroup] = None"
_PG_COLLECTION = (
    "megatron.core.process_groups_config.ProcessGroupCollection, "
    "megatron.core.process_groups_config.MultiModuleProcessGroupCollection"
)
_SAVE_016 = (
    "(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far, "
    "checkpointing_context=None, pipeline_rank=None, expert_rank=None, tensor_rank=None, "
    "pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False, "
    "train_data_iterator=None, preprocess_common_state_dict_fn=None, release=False, "
    f"tp_group: {_GROUP}, pp_group: {_GROUP}, dp_cp_group: {_GROUP}"
)
# Megatron-LM's signatures per megatron-core release (the hooks bind arguments by name).
SIGNATURES = {
    "setup_model_and_optimizer": {
        "0.16.1": "(model_provider_func, model_type, checkpointing_context=None)",
        "0.19.0": "(model_type, model_provider_func=None, checkpointing_context=None, *, "
        "cfg_container: megatron.training.config.container.PretrainConfigContainer | None = "
        f"None, pg_collection: {_PG_COLLECTION.replace(', ', ' | ')} | None = None)",
    },
    "num_flops": {  # num_floating_point_operations
        "0.16.1": "(args, batch_size)",
        "0.19.0": "(args, batch_size, seqlen_squared_sum_in_batch=None, "
        "total_real_tokens_in_batch=None)",
    },
    "train_step": {
        "0.16.1": "(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, "
        "config, forward_backward_func, iteration=None)",
        "0.19.0": "(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, "
        f"config, forward_backward_func, iteration=None, pg_collection: Union[{_PG_COLLECTION}"
        ", NoneType] = None, p2p_communicator: Optional[megatron.core.pipeline_parallel."
        "p2p_communication.P2PCommunicator] = None)",
    },
    "save_checkpoint": {
        "0.16.1": _SAVE_016 + ")",
        "0.19.0": _SAVE_016
        + f", dp_group: {_GROUP}, expt_dp_group: {_GROUP}, rng_state_key_prefix: str = '')",
    },
    "schedule_async_save": {
        "0.16.1": "(async_request: megatron.core.dist_checkpointing.strategies.async_utils."
        "AsyncRequest)",
        "0.19.0": "(async_request: megatron.core.dist_checkpointing.strategies.async_utils."
        "AsyncRequest | typing.Any)",
    },
}

# checkpointing.generate_state_dict: the same in every tested release.
GENERATE_STATE_DICT_SIGNATURE = (
    "(args, model, optimizer, opt_param_scheduler, rng_state, iteration=None, "
    "optim_sd_kwargs=None, model_sd_kwargs=None, rerun_state=None)"
)
