import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "examples" / "gpt", Path(__file__).resolve().parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

_REPORTS: list[str] = []


@pytest.fixture
def fault_report():
    """``fault_report(text)``: a report that the session's summary prints (CI's output shows it
    whether the test passed or failed)."""
    return _REPORTS.append


def pytest_sessionfinish(session, exitstatus):
    """Keepers the tests SIGKILL leave their shared-memory folders behind, as on a node, until
    the next keeper started there sweeps them: the suite sweeps what its last ones left, as that
    keeper would (only folders whose owner process is gone)."""
    from megatron_diffckpt.keeper.shm import shared_memory_root, sweep_stale_shm

    sweep_stale_shm(shared_memory_root(), keep="")


def pytest_terminal_summary(terminalreporter):
    if _REPORTS:
        terminalreporter.section("fault injection")
        for text in _REPORTS:
            terminalreporter.write_line(text)


class Tmpfs:
    """Small filesystems for a test (root): ``tmpfs(name, size)`` mounts one of ``size``
    (``"1m"``) at ``tmp_path/name``; ``tmpfs.grow(path)`` gives it room again (64 MiB, what it
    holds stays). Unmounted after the test. Without root the test is skipped, except under
    ``CI=true`` (CI runs as root: a skip there protects nothing)."""

    def __init__(self, root: Path):
        self.root = root
        self.mounted: list[Path] = []

    def __call__(self, name: str, size: str) -> Path:
        path = self.root / name
        path.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)  # fmt: skip
        if proc.returncode != 0:
            if os.environ.get("CI") == "true":
                raise RuntimeError(f"cannot mount a tmpfs: {proc.stderr.strip()}")
            pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
        self.mounted.append(path)
        return path

    @staticmethod
    def grow(path: Path) -> None:
        subprocess.run(["mount", "-o", "remount,size=64m", str(path)], check=True)


@pytest.fixture
def tmpfs(tmp_path):
    """A :class:`Tmpfs` for this test."""
    mounts = Tmpfs(tmp_path)
    yield mounts
    for path in mounts.mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)
