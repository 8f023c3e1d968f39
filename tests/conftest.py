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


def pytest_terminal_summary(terminalreporter):
    if _REPORTS:
        terminalreporter.section("fault injection")
        for text in _REPORTS:
            terminalreporter.write_line(text)
