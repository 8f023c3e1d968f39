"""DiffCkptConfig: the flags come from the dataclass, and bad values are refused by name."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from megatron_diffckpt.config import DiffCkptConfig
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
        assert action.option_strings == [f"--diffckpt-{f.name.replace('_', '-')}"]
        assert len(action.help) > 20, f"{f.name} has no docstring"


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
        ({"max_pending": 0}, "--diffckpt-max-pending"),
        ({"when_full": "x"}, "--diffckpt-when-full"),
        ({"full_interval": -1}, "--diffckpt-full-interval"),
        ({"compressor": "zip"}, "--diffckpt-compressor"),
        ({"topk_ratio": 0.0}, "--diffckpt-topk-ratio"),
        ({"topk_ratio": 1.5}, "--diffckpt-topk-ratio"),
        (
            {"mode": "lowdiff-plus", "plus_keeper_writes_bases": True},
            "--diffckpt-plus-keeper-writes-bases is for --diffckpt-plus-keeper-replica",
        ),
        (
            {"mode": "lowdiff-plus", "keeper_writes_log": True},
            "--diffckpt-keeper-writes-log is for --diffckpt-mode lowdiff",
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
        DiffCkptConfig(mode="lowdiff-plus", auto_tune=True, plus_no_diff_log=True)
