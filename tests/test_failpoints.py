"""Fail points kill the process that reaches them, at the N-th hit on the named rank, only there.

A real diff-log writer in a child process with ``DIFFCKPT_FAILPOINT`` set: it dies by SIGKILL
while its second segment is in its ``.tmp`` file, so the first segment is published and intact,
the second is never taken as written.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from megatron_diffckpt import failpoints
from megatron_diffckpt.storage import SegmentIdentity
from megatron_diffckpt.storage.reader import scan_rank_log

IDENTITY = SegmentIdentity("run-a", 0, 0, 0, "layout-1")

_WRITER = textwrap.dedent(
    """
    import sys, torch
    from megatron_diffckpt.storage import DiffLogWriter, DiffRecord, SegmentIdentity
    w = DiffLogWriter(sys.argv[1], SegmentIdentity("run-a", 0, 0, 0, "layout-1"), "none",
                      batch_size=2)
    for it in range(1, 7):
        w.append(DiffRecord(it, {"lr": 0.1}, {"grad": torch.full((1000,), float(it))}))
    w.close()
    print("all written", flush=True)
    """
)


def _run(tmp_path, spec: str, rank: str) -> subprocess.CompletedProcess:
    env = {**os.environ, failpoints.ENV: spec, "RANK": rank, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", _WRITER, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_nth_hit_on_the_named_rank_dies_by_sigkill(tmp_path):
    proc = _run(tmp_path, "segment-write:2@1", rank="1")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "failpoint segment-write #2: SIGKILL of rank 1" in proc.stderr
    assert "all written" not in proc.stdout
    rank_dir = tmp_path / IDENTITY.dirname()
    scan = scan_rank_log(str(rank_dir), IDENTITY, start=0)
    assert [r.iteration for r in scan.records] == [1, 2] and scan.problems == []
    assert [p.name for p in rank_dir.glob("*.tmp")] == ["seg_0000000003_0000000004.bin.tmp"]


def test_another_rank_or_point_does_not_die(tmp_path):
    for spec, rank in (("segment-write:2@1", "0"), ("replay:1", "0")):
        proc = _run(tmp_path / spec.replace(":", "_"), spec, rank)
        assert proc.returncode == 0 and "all written" in proc.stdout, proc.stderr


@pytest.mark.parametrize("spec", ["segment-write:0", "nowhere", "replay:x", "replay@"])
def test_a_malformed_spec_is_refused(spec):
    with pytest.raises(ValueError, match="expected NAME"):
        failpoints._parse(spec)


def test_a_delay_point_sleeps_on_its_rank_only_and_a_bad_spec_is_refused(monkeypatch):
    assert failpoints._parse_delay("merge:0.25@1") == ("merge", 0.25, 1)
    assert failpoints._parse_delay("") is None
    for bad in ("merge", "merge:x", "nowhere:1"):
        with pytest.raises(ValueError, match="DIFFCKPT_DELAY"):
            failpoints._parse_delay(bad)
    slept: list[float] = []
    monkeypatch.setattr(failpoints.time, "sleep", slept.append)
    monkeypatch.setattr(failpoints, "_delay", ("merge", 0.25, 1))
    monkeypatch.setenv("RANK", "0")
    failpoints.delay("merge")
    monkeypatch.setenv("RANK", "1")
    failpoints.delay("merge")
    failpoints.delay("elsewhere")
    assert slept == [0.25]
