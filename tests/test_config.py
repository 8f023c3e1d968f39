"""DiffCkptConfig: the flags come from the dataclass, and bad values are refused by name."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields

import pytest

from megatron_diffckpt.config import (
    RETIRED_FLAGS,
    DiffCkptConfig,
    DiffCkptOptions,
    KeeperPlan,
    field_docs,
    flag_of,
)
from megatron_diffckpt.errors import DiffCkptUsageError


def _parse(*argv: str) -> DiffCkptConfig:
    parser = argparse.ArgumentParser()
    DiffCkptConfig.add_arguments(parser)
    return DiffCkptConfig.from_args(parser.parse_args(list(argv)))


def test_every_field_has_a_flag_with_its_docstring_as_help():
    parser = argparse.ArgumentParser()
    DiffCkptConfig.add_arguments(parser)
    actions = {a.dest: a for a in parser._actions}
    for f in fields(DiffCkptConfig):
        action = actions[f"diffckpt_{f.name}"]
        assert action.option_strings == [flag_of(f.name)]
        assert len(action.help) > 20, f"{f.name} has no docstring"
    docs = field_docs(DiffCkptOptions)
    for f in fields(DiffCkptOptions):  # each option named in --diffckpt-option's help
        assert len(docs.get(f.name, "")) > 20, f"option {f.name} has no docstring"
        assert f.name in actions["diffckpt_options"].help, f.name


def test_at_most_twelve_user_flags_one_of_them_the_memory_tier():
    parser = argparse.ArgumentParser()
    DiffCkptConfig.add_arguments(parser)
    shown = [a for a in parser._actions if a.help != argparse.SUPPRESS and a.option_strings]
    flags = [s for a in shown for s in a.option_strings if s.startswith("--diffckpt-")]
    assert len(flags) <= 12, flags
    keeper = next(a for a in shown if a.option_strings == ["--diffckpt-keeper"])
    assert keeper.choices == ("auto", "off") and keeper.default == "auto"


def test_the_help_of_every_flag_renders(capsys):
    """argparse formats each help with ``%``: a docstring holding "+8.7%" once broke --help."""
    parser = argparse.ArgumentParser()
    DiffCkptConfig.add_arguments(parser)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for f in fields(DiffCkptConfig):
        assert flag_of(f.name) in out


@pytest.mark.parametrize(("old", "instead"), sorted(RETIRED_FLAGS.items()))
def test_a_retired_flag_is_refused_in_one_line_naming_the_new_way(old, instead, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse("--diffckpt-mode", "lowdiff", old)
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{old} was retired; use {instead}" in last


def test_options_take_names_and_values_of_their_fields():
    c = _parse("--diffckpt-mode", "lowdiff-plus", "--diffckpt-option",
               "max_pending=4,diff_log=off", "--diffckpt-option", "keeper_replica=false",
               "--diffckpt-option", "buffered-io=1,replica_kernel=Fused")  # fmt: skip
    assert c.options == DiffCkptOptions(
        max_pending=4, diff_log=False, keeper_replica=False, buffered_io=True,
        replica_kernel="fused",
    )  # fmt: skip
    # a later value wins, and auto gives a keeper choice back to --diffckpt-keeper auto
    c = _parse("--diffckpt-mode", "lowdiff", "--diffckpt-option", "keeper_replica=false",
               "--diffckpt-option", "keeper_replica=auto")  # fmt: skip
    assert c.options.keeper_replica is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("max_pending", "takes NAME=VALUE with NAME one of max_pending, "),
        ("no_such=1", "takes NAME=VALUE with NAME one of"),
        ("max_pending=two", "max_pending takes an integer; got 'two'"),
        ("max_pending=0", "max_pending must be >= 1"),
        ("max_full_interval=-1", "max_full_interval must be >= 0"),
        ("buffered_io=auto", "buffered_io takes true, false; got 'auto'"),
        ("keeper_replica=maybe", "keeper_replica takes true, false or auto; got 'maybe'"),
        ("replica_kernel=exact", "replica_kernel takes auto or fused; got 'exact'"),
    ],
)
def test_a_bad_option_is_refused_naming_it(value, message):
    with pytest.raises(DiffCkptUsageError, match=re.escape(message)):
        _parse("--diffckpt-mode", "lowdiff", "--diffckpt-option", value)


def test_keeper_auto_picks_per_mode_what_measured_best_and_options_override_it():
    lowdiff = DiffCkptConfig(mode="lowdiff")
    assert lowdiff.keeper_plan() == KeeperPlan(kept_bases=True, writes_log=True, replica=True)
    plus = DiffCkptConfig(mode="lowdiff-plus")
    assert plus.keeper_plan() == KeeperPlan(replica=True)
    # the tuner measures the ranks' own writer: LowDiff+'s replica stays in the rank
    assert DiffCkptConfig(mode="lowdiff-plus", auto_tune=True).keeper_plan() == KeeperPlan()
    assert DiffCkptConfig(mode="lowdiff", keeper="off").keeper_plan() == KeeperPlan()
    assert DiffCkptConfig(mode="off").keeper_plan() == KeeperPlan()
    no_base = DiffCkptOptions(keeper_kept_bases=False)
    assert DiffCkptConfig(mode="lowdiff", options=no_base).keeper_plan() == KeeperPlan(
        writes_log=True
    )
    # a bounded merge wait bounds the hand-over to the keeper: the replica stays there
    bounded = DiffCkptOptions(max_merge_wait_ms=100)
    assert DiffCkptConfig(mode="lowdiff-plus", options=bounded).keeper_plan() == KeeperPlan(
        replica=True
    )
    # strict waits on the rank's own writer: the replica in the rank, whose log goes on in a
    # pause of its merger, so the bound is allowed with it
    strict = DiffCkptConfig(mode="lowdiff-plus", when_full="strict", options=bounded)
    assert strict.keeper_plan() == KeeperPlan()
    writes = DiffCkptOptions(keeper_writes_bases=True)
    assert DiffCkptConfig(mode="lowdiff-plus", options=writes).keeper_plan() == KeeperPlan(
        replica=True, writes_bases=True
    )


def test_defaults_and_values():
    assert _parse() == DiffCkptConfig()
    assert not DiffCkptConfig().enabled
    c = _parse(
        "--diffckpt-mode",
        "lowdiff",
        "--diffckpt-batch-size",
        "4",
        "--diffckpt-when-full",
        "skip",
        "--diffckpt-dir",
        "/x",
        "--diffckpt-compressor",
        "topk",
        "--diffckpt-topk-ratio",
        "0.05",
    )
    assert (c.mode, c.batch_size, c.when_full, c.dir, c.enabled) == (
        "lowdiff",
        4,
        "skip",
        "/x",
        True,
    )
    assert (c.compressor, c.topk_ratio) == ("topk", 0.05)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "sometimes"}, "--diffckpt-mode"),
        ({"batch_size": 0}, "--diffckpt-batch-size"),
        ({"keeper": "on"}, "--diffckpt-keeper must be one of"),
        ({"mtbf_hours": 0}, "--diffckpt-mtbf-hours must be > 0"),
        ({"when_full": "x"}, "--diffckpt-when-full"),
        ({"full_interval": -1}, "--diffckpt-full-interval"),
        ({"compressor": "zip"}, "--diffckpt-compressor"),
        ({"topk_ratio": 0.0}, "--diffckpt-topk-ratio"),
        ({"topk_ratio": 1.5}, "--diffckpt-topk-ratio"),
        (
            {
                "mode": "lowdiff-plus",
                "options": DiffCkptOptions(keeper_replica=False, keeper_writes_bases=True),
            },
            "keeper_writes_bases=true is for lowdiff-plus with its replica in the keeper",
        ),
        (
            {"mode": "lowdiff-plus", "options": DiffCkptOptions(keeper_writes_log=True)},
            "keeper_writes_log=true is for --diffckpt-mode lowdiff",
        ),
        (
            {"mode": "lowdiff", "options": DiffCkptOptions(max_merge_wait_ms=100)},
            "max_merge_wait_ms is for --diffckpt-mode lowdiff-plus",
        ),
        (
            {"mode": "lowdiff", "options": DiffCkptOptions(replica_kernel="fused")},
            "replica_kernel is for --diffckpt-mode lowdiff-plus",
        ),
        (
            {"mode": "lowdiff", "options": DiffCkptOptions(max_full_interval=6)},
            "max_full_interval caps the auto-tuner's F: add --diffckpt-auto-tune",
        ),
        (
            {"mode": "lowdiff", "keeper": "off", "options": DiffCkptOptions(keeper_replica=True)},
            "--diffckpt-option keeper_replica=true needs the keeper: drop --diffckpt-keeper off",
        ),
        (
            {"mode": "lowdiff", "options": DiffCkptOptions(diff_log=False)},
            "diff_log=false is for --diffckpt-mode lowdiff-plus",
        ),
        (
            {
                "mode": "lowdiff",
                "options": DiffCkptOptions(keeper_replica=True, keeper_kept_bases=False),
            },
            "keeper_replica=true needs keeper_kept_bases",
        ),
        (
            {
                "mode": "lowdiff-plus",
                "auto_tune": True,
                "options": DiffCkptOptions(keeper_replica=True),
            },
            "keeper_replica=true is for lowdiff-plus without --diffckpt-auto-tune",
        ),
    ],
)
def test_invalid_values_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DiffCkptConfig(**kwargs)


def test_choices_are_enforced_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        _parse("--diffckpt-mode", "sometimes")
    assert "invalid choice" in capsys.readouterr().err


def test_lowdiff_plus_auto_tune_needs_the_diff_log_it_measures():
    DiffCkptConfig(mode="lowdiff-plus", auto_tune=True)  # chooses between the log and bases
    with pytest.raises(DiffCkptUsageError, match="measures the diff log"):
        DiffCkptConfig(mode="lowdiff-plus", auto_tune=True, options=DiffCkptOptions(diff_log=False))


@pytest.mark.parametrize("mode", ["lowdiff", "lowdiff-plus"])
def test_context_parallelism_is_refused_expert_parallelism_is_not(mode):
    """Megatron-LM's flags as a launch gives them: context parallelism is refused in one line
    (megatron runs it only with transformer-engine); expert parallelism passes."""
    config = DiffCkptConfig(mode=mode, full_interval=5)
    launch = dict(save="s", load="s", use_distributed_optimizer=True)
    config.check_launch(argparse.Namespace(**launch, expert_model_parallel_size=2))
    with pytest.raises(DiffCkptUsageError, match="^context parallelism is not supported yet") as e:
        config.check_launch(argparse.Namespace(**launch, context_parallel_size=2))
    assert "\n" not in str(e.value) and str(e.value).endswith("run without --context-parallel-size")


@pytest.mark.parametrize("mode", ["lowdiff", "lowdiff-plus"])
def test_async_saves_through_nvrx_are_refused_naming_megatron_cores_strategy(mode):
    """Megatron-LM 0.19's default asynchronous strategy (NVIDIA's resiliency extension) is
    refused in one line naming ``--async-strategy mcore``; megatron-core's own strategy, a
    synchronous save (Megatron-LM then sets ``mcore``) and a release without the flag pass."""
    config = DiffCkptConfig(mode=mode, full_interval=5)
    launch = dict(save="s", load="s", use_distributed_optimizer=True, async_save=True)
    config.check_launch(argparse.Namespace(**launch, async_strategy="mcore"))
    config.check_launch(argparse.Namespace(**launch))  # megatron-core 0.16: no such flag
    config.check_launch(argparse.Namespace(**{**launch, "async_save": False}))
    with pytest.raises(DiffCkptUsageError, match="add --async-strategy mcore$") as refused:
        config.check_launch(argparse.Namespace(**launch, async_strategy="nvrx"))
    assert "\n" not in str(refused.value)
    assert "not supported yet" in str(refused.value)
    DiffCkptConfig().check_launch(argparse.Namespace(**launch, async_strategy="nvrx"))  # off


def test_megatron_lms_help_prints_where_a_help_text_has_a_bare_percent():
    """megatron-core 0.19.2's ``--moe-paged-stash-buffer-size-factor-cuda`` help ends in
    "10%).", which makes argparse's ``--help`` raise; the ``--diffckpt-*`` provider escapes it
    (and leaves ``%(default)s`` working)."""
    from megatron_diffckpt.integrations import megatron_lm

    parser = argparse.ArgumentParser(prog="pretrain_gpt.py")
    parser.add_argument("--factor", default=1.1, help="headroom (e.g. 1.10 = 10%).")
    parser.add_argument("--size", default=7, help="size, default %(default)s")
    with pytest.raises(ValueError):
        parser.format_help()
    megatron_lm.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "(e.g. 1.10 = 10%)." in text and "size, default 7" in text
    assert "--diffckpt-mode" in text
