"""Megatron-LM's checkpoint directory layout: finding and publishing the newest checkpoint."""

from __future__ import annotations

import pytest

from megatron_diffckpt.checkpoint_layout import (
    TRACKER_FILENAME,
    CheckpointNotFoundError,
    checkpoint_dir,
    find_latest_iteration,
    publish_iteration,
)


def _complete(root, iteration):
    d = checkpoint_dir(str(root), iteration)
    (root / d.rsplit("/", 1)[1]).mkdir()
    (root / d.rsplit("/", 1)[1] / "metadata.json").write_text("{}")


def test_checkpoint_dir_matches_megatron_lm(tmp_path):
    assert checkpoint_dir("/x", 100) == "/x/iter_0000100"


def test_publish_then_find(tmp_path):
    _complete(tmp_path, 7)
    publish_iteration(str(tmp_path), 7)
    assert (tmp_path / TRACKER_FILENAME).read_text() == "7"
    assert find_latest_iteration(str(tmp_path)) == 7
    assert not (tmp_path / (TRACKER_FILENAME + ".tmp")).exists()


def test_publish_moves_forward_over_an_older_tracker(tmp_path):
    _complete(tmp_path, 1)
    _complete(tmp_path, 2)
    publish_iteration(str(tmp_path), 1)
    publish_iteration(str(tmp_path), 2)
    assert find_latest_iteration(str(tmp_path)) == 2


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: None, "holds no checkpoint"),
        (lambda d: (d / "iter_0000003").mkdir(), "iter_0000003 present, none completed"),
        (lambda d: (d / TRACKER_FILENAME).write_text("abc"), "not an iteration number"),
        (lambda d: (d / TRACKER_FILENAME).write_text("4"), "names iteration 4"),
    ],
)
def test_errors_say_what_is_wrong(tmp_path, setup, message):
    setup(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match=message):
        find_latest_iteration(str(tmp_path))


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no such directory"):
        find_latest_iteration(str(tmp_path / "missing"))
