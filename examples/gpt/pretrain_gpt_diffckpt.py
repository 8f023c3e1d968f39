"""Megatron-LM's own GPT pretraining, with differential checkpointing: its ``pretrain_gpt.py``.

Runs Megatron-LM's ``pretrain()`` (``megatron.training``) with Megatron-LM's GPT model provider,
forward step and datasets, exactly as its ``pretrain_gpt.py`` does, plus the ``--diffckpt-*``
flags (through Megatron-LM's ``extra_args_provider``) and the hooks of
:mod:`megatron_diffckpt.integrations.megatron_lm` (which wrap, never copy, its save, load and
training step). Both systems run here: ``--diffckpt-mode lowdiff`` (with
``--diffckpt-compressor topk`` for compressed training) and ``--diffckpt-mode lowdiff-plus``.
Every Megatron-LM flag works as usual::

    MEGATRON_LM=/path/to/Megatron-LM torchrun --nproc-per-node 8 \\
        examples/gpt/pretrain_gpt_diffckpt.py <Megatron-LM's GPT flags> \\
        --save /ckpt --load /ckpt --save-interval 500 --diffckpt-mode lowdiff

``MEGATRON_LM`` names a Megatron-LM checkout (its ``megatron/training`` and top-level
``pretrain_gpt.py``); the megatron-core installed in the environment is the one used (the
checkout goes at the end of the import path), so keep the two at the same release. Without CUDA
it runs on CPU processes with gloo through :mod:`megatron_diffckpt.cpu_mode`, which then adds
the flags CPU training needs (``--distributed-backend gloo --transformer-impl local
--no-gradient-accumulation-fusion --no-persist-layer-norm --no-masked-softmax-fusion``) unless
given.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from megatron_diffckpt import cpu_mode  # noqa: E402
from megatron_diffckpt.background import helpers_die_with_this_rank  # noqa: E402

helpers_die_with_this_rank()  # what this rank starts (megatron's checkpoint writers) dies with it
cpu_mode.enable_if_inherited()  # a helper that megatron started by spawn or forkserver

# Flags CPU processes need, with the values they need (Megatron-LM defaults to NCCL, fused CUDA
# kernels and TransformerEngine).
CPU_FLAGS = {
    "--distributed-backend": ["gloo"],
    "--transformer-impl": ["local"],
    "--no-gradient-accumulation-fusion": [],
    "--no-persist-layer-norm": [],
    "--no-masked-softmax-fusion": [],  # a CUDA extension (scaled_masked_softmax_cuda)
}


def _say(message: str) -> None:
    """``message`` on stderr, as one line in one write: torchrun runs the ranks unbuffered
    (``python -u``), where ``print`` writes the line and its end apart, and the ranks' lines,
    said at the same moment, would run into each other."""
    sys.stderr.write(f"pretrain_gpt_diffckpt.py: {message}\n")
    sys.stderr.flush()


def _checkout() -> str:
    path = os.environ.get("MEGATRON_LM")
    if not path:
        _say("set MEGATRON_LM to a Megatron-LM checkout (the folder holding pretrain_gpt.py and "
             "megatron/training)")  # fmt: skip
        sys.exit(2)
    if not os.path.isfile(os.path.join(path, "pretrain_gpt.py")) or not os.path.isdir(
        os.path.join(path, "megatron", "training")
    ):
        _say(f"MEGATRON_LM={path} is not a Megatron-LM checkout")
        sys.exit(2)
    return os.path.abspath(path)


def checkout_version(path: str) -> str | None:
    """The megatron-core version a Megatron-LM checkout carries (its package_info.py)."""
    try:
        with open(os.path.join(path, "megatron", "core", "package_info.py")) as f:
            text = f.read()
    except OSError:
        return None
    parts = [re.search(rf"^{k} = (\d+)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else None


def main() -> None:
    checkout = _checkout()
    import torch

    cpu = not torch.cuda.is_available()
    if cpu:
        cpu_mode.enable()  # before megatron is imported
        for flag, values in CPU_FLAGS.items():
            if flag not in sys.argv:
                sys.argv += [flag, *values]
    # The installed megatron-core first; megatron.training and Megatron-LM's top-level modules
    # (gpt_builders, model_provider, pretrain_gpt) from the checkout.
    sys.path.append(checkout)
    from importlib.metadata import version

    from megatron_diffckpt.control import end_rank
    from megatron_diffckpt.integrations import megatron_lm
    from megatron_diffckpt.patches import torch_adam_state

    installed, carried = version("megatron-core"), checkout_version(checkout)
    if carried is not None and carried != installed:
        logging.getLogger(__name__).warning(
            "Megatron-LM checkout %s is release %s, the installed megatron-core %s: use the "
            "matching release (checked: %s)",
            checkout,
            carried,
            installed,
            ", ".join(megatron_lm.TESTED_MEGATRON_LM_VERSIONS),
        )
    if cpu:
        cpu_mode.enable_training()
    torch_adam_state.apply()  # a no-op with transformer-engine's or apex's Adam
    megatron_lm.apply()

    # Megatron-LM's pretrain_gpt.py, by path (this folder has a pretrain_gpt.py of its own).
    spec = importlib.util.spec_from_file_location(
        "megatron_lm_pretrain_gpt", os.path.join(checkout, "pretrain_gpt.py")
    )
    mlm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mlm)
    from megatron.core.enums import ModelType
    from megatron.training import inprocess_restart, pretrain

    mlm.train_valid_test_datasets_provider.is_distributed = True
    extra = megatron_lm.add_arguments
    if mlm.has_nvidia_modelopt:

        def extra(parser):
            return megatron_lm.add_arguments(mlm.add_modelopt_args(parser))

    if {"-h", "--help"} & set(sys.argv[1:]):
        # Megatron-LM's in-process restart wrapper parses the flags first, without ours: its
        # parser with the --diffckpt-* flags prints the help (and exits) instead.
        from megatron.training.arguments import parse_args

        parse_args(extra_args_provider=extra)
    run, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)

    defaults = {"tokenizer_type": "GPT2BPETokenizer"}
    if hasattr(mlm, "pretrain_cfg_container_from_args"):
        # Megatron-LM 0.19: pretrain_gpt.py parses the arguments itself and hands pretrain() a
        # configuration built from them (and no model provider).
        args = mlm.parse_and_validate_args(extra_args_provider=extra, args_defaults=defaults)
        model_cfg = {}
        if mlm.has_nvidia_modelopt:
            mlm.maybe_enable_modelopt(args)
            if getattr(args, "modelopt_enabled", False):
                model_cfg = {"model_config_cls": mlm.ModelOptModelConfig}
        config = mlm.pretrain_cfg_container_from_args(
            args, mlm.gpt_config_from_args(args, **model_cfg)
        )
        launch = functools.partial(run, config, mlm.train_valid_test_datasets_provider)
    else:
        launch = functools.partial(
            run,
            mlm.train_valid_test_datasets_provider,
            mlm.partial(mlm.model_provider, mlm.gpt_builder),
            args_defaults=defaults,
            extra_args_provider=extra,
        )
    try:
        launch(
            model_type=ModelType.encoder_or_decoder,
            forward_step_func=mlm.forward_step,
            store=store,
            get_embedding_ranks=mlm.get_embedding_ranks,
        )
    except SystemExit as stop:  # Megatron-LM's exit conditions (--exit-interval, signals)
        if stop.code in (None, 0):
            megatron_lm.RUN.close()
        raise
    except Exception as exc:  # in one line where it tells all, else its traceback
        sys.exit(end_rank(exc, _say))
    # On an error, a rank does not close: closing may be collective, and the other ranks may
    # never get there. What is durable stays durable; the writer's pending batch is lost.
    megatron_lm.RUN.close()


if __name__ == "__main__":
    main()
