"""Bad input to the GPT example gets one clear message and exit code 2, before any rank starts."""

from __future__ import annotations

import pytest
from arguments import parse_args
from launch import TINY_GPT, assert_help_lists_every_flag, run_gpt, run_script


class _Result:
    def __init__(self, returncode: int, stderr: str):
        self.returncode, self.stderr, self.stdout = returncode, stderr, ""


def _parse(*argv: str, world_size: int = 1) -> _Result:
    """The example's real parser, in-process (the script itself is tested once below)."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        parse_args(list(argv), world_size=world_size)
    return _Result(exc.value.code, err.getvalue())


def _error(proc) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    return proc.stderr


def test_help_lists_every_diffckpt_flag():
    assert_help_lists_every_flag(run_script("--help"))


def test_a_retired_flag_is_refused_by_the_script_in_one_line():
    err = _error(run_script("--train-iters", "2", "--diffckpt-keeper-replica"))
    assert (
        err.strip()
        .splitlines()[-1]
        .endswith(
            "--diffckpt-keeper-replica was retired; use --diffckpt-keeper auto (the default; "
            "--diffckpt-option keeper_replica=true forces it)"
        )
    )


def test_unknown_flag_is_refused_by_the_script():
    err = _error(run_script("--train-iters", "2", "--no-such-flag"))
    assert "unrecognized arguments: --no-such-flag" in err


def test_parallel_sizes_checked_by_the_script_against_torchrun_world_size():
    err = _error(
        run_script("--train-iters", "2", "--tensor-model-parallel-size", "2", world_size=3)
    )
    assert "world size 3 is not divisible" in err


def test_abbreviated_flag_is_refused():
    # Megatron-LM disables abbreviations; "--train" must not silently mean "--train-iters".
    err = _error(_parse("--train", "2"))
    assert "unrecognized arguments" in err or "required: --train-iters" in err


def test_load_path_that_does_not_exist_exits_with_exit_on_missing_checkpoint(tmp_path):
    missing = tmp_path / "nope"
    err = _error(
        _parse("--train-iters", "2", "--load", str(missing), "--exit-on-missing-checkpoint")
    )
    assert f"--load: {missing}: no such directory" in err


def test_load_path_without_checkpoint_exits_with_exit_on_missing_checkpoint(tmp_path):
    err = _error(
        _parse("--train-iters", "2", "--load", str(tmp_path), "--exit-on-missing-checkpoint")
    )
    assert "holds no checkpoint" in err and "latest_checkpointed_iteration.txt" in err


@pytest.mark.parametrize("exists", [False, True])
def test_load_path_without_checkpoint_starts_from_scratch_as_megatron_lm(tmp_path, exists):
    """Launch scripts that always pass --load rely on it (Megatron-LM's behaviour)."""
    load = tmp_path / "ckpt"
    if exists:
        load.mkdir()
    args = parse_args(["--train-iters", "2", "--load", str(load), "--save", str(load)])
    assert args.load_missing is not None and str(load) in args.load_missing


def test_load_path_with_incomplete_checkpoint(tmp_path):
    (tmp_path / "iter_0000005").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    err = _error(_parse("--train-iters", "2", "--load", str(tmp_path)))
    assert "names iteration 5" in err and "metadata.json" in err


@pytest.mark.parametrize(("world", "tp", "pp"), [(3, 2, 1), (2, 1, 4), (6, 2, 2)])
def test_parallel_sizes_must_divide_world_size(world, tp, pp):
    err = _error(
        _parse(
            "--train-iters",
            "2",
            "--tensor-model-parallel-size",
            str(tp),
            "--pipeline-model-parallel-size",
            str(pp),
            "--num-layers",
            "4",
            world_size=world,
        )
    )
    assert f"world size {world} is not divisible" in err and f"= {tp * pp}" in err


def test_global_batch_must_be_a_multiple_of_micro_batch_times_dp():
    err = _error(
        _parse(
            "--train-iters",
            "2",
            "--micro-batch-size",
            "4",
            "--global-batch-size",
            "6",
            world_size=2,
        )
    )
    assert "--global-batch-size 6 is not a multiple of" in err and "= 8" in err


@pytest.mark.parametrize(
    ("flags", "world", "message"),
    [
        ("--expert-model-parallel-size 2", 2, "--expert-model-parallel-size 2 needs --num-experts"),
        ("--num-experts 4", 2, "--num-experts needs --disable-bias-linear"),
        (
            "--num-experts 4 --disable-bias-linear --expert-model-parallel-size 2",
            3,
            "--expert-model-parallel-size 2 does not divide the data-parallel size 3",
        ),
        (
            "--num-experts 3 --disable-bias-linear --expert-model-parallel-size 2",
            2,
            "--num-experts 3 is not divisible by --expert-model-parallel-size 2",
        ),
        ("--num-experts 2 --disable-bias-linear --moe-router-topk 3", 2, "--moe-router-topk 3 is"),
    ],
)
def test_mixture_of_experts_flags_are_checked(flags, world, message):
    micro = ["--micro-batch-size", "1", "--global-batch-size", str(world)]
    err = _error(_parse("--train-iters", "2", *micro, *flags.split(), world_size=world))
    assert message in err, err


def test_valid_flags_derive_the_schedule():
    args = parse_args(
        [
            "--train-iters",
            "10",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "8",
            "--tensor-model-parallel-size",
            "2",
        ],
        world_size=4,
    )
    assert (args.data_parallel_size, args.num_microbatches) == (2, 2)
    assert args.max_position_embeddings == args.seq_length
    assert args.lr_decay_iters == 10


def test_non_positive_sizes_are_refused():
    err = _error(_parse("--train-iters", "0"))
    assert "must be > 0" in err


def test_missing_data_path(tmp_path):
    err = _error(_parse("--train-iters", "2", "--data-path", str(tmp_path / "x.txt")))
    assert "no such file" in err


def test_auto_tune_needs_differential_checkpointing():
    err = _error(_parse("--train-iters", "2", "--diffckpt-auto-tune"))
    assert "--diffckpt-auto-tune needs --diffckpt-mode lowdiff" in err


def test_diffckpt_values_are_checked_by_flag_name():
    err = _error(_parse("--train-iters", "2", "--diffckpt-mtbf-hours", "0"))
    assert "--diffckpt-mtbf-hours must be > 0" in err


@pytest.mark.distributed
def test_training_with_an_empty_load_folder_starts_from_scratch(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = run_gpt(2, *TINY_GPT, "--train-iters", "3", "--load", str(ckpt), "--save", str(ckpt),
                   "--save-interval", "2", "--diffckpt-mode", "lowdiff")  # fmt: skip
    log = proc.stdout + proc.stderr
    assert "will not load any checkpoint and will start from random" in log
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"
