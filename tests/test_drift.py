"""The installed megatron-core matches what every patch and shim was written for.

When this fails after a megatron-core upgrade, the message names the function, the expected and
found signatures and the tested versions: read the new code, adapt the patch, then update its
expected signature and TESTED_MEGATRON_CORE_VERSIONS.
"""

from __future__ import annotations

import importlib
import os
import re
from importlib.metadata import version
from pathlib import Path

import pytest

from megatron_diffckpt import cpu_mode
from megatron_diffckpt.patches import (
    ALL_PATCHES,
    MEGATRON_LM_PATCHES,
    TESTED_MEGATRON_CORE_VERSIONS,
)

REPO = Path(__file__).resolve().parent.parent


# The lane's pins: requirements/cpu.txt (make test, CI), or requirements/newest.txt
# (make test-newest sets DIFFCKPT_PINS).
PINS = os.environ.get("DIFFCKPT_PINS") or "requirements/cpu.txt"


def _pin(package: str) -> str:
    text = (REPO / PINS).read_text()
    match = re.search(rf"^{re.escape(package)}==(\S+)$", text, re.MULTILINE)
    assert match, f"{PINS} has no exact pin for {package}"
    return match.group(1)


def test_installed_megatron_core_is_the_pinned_and_tested_one():
    pinned, installed = _pin("megatron-core"), version("megatron-core")
    assert installed == pinned, (
        f"megatron-core {installed} is installed but {PINS} pins {pinned}: "
        f"run `make venv` or `make test-newest` (or `pip install -r {PINS}`)"
    )
    assert pinned in TESTED_MEGATRON_CORE_VERSIONS, (
        f"{PINS} pins megatron-core {pinned}, but the patches were tested with "
        f"{TESTED_MEGATRON_CORE_VERSIONS}: run the suite against {pinned}, then add it to "
        "TESTED_MEGATRON_CORE_VERSIONS in megatron_diffckpt/patches/base.py"
    )


def test_installed_torch_is_the_pinned_one():
    assert version("torch").split("+")[0] == _pin("torch")


@pytest.mark.parametrize("module", ALL_PATCHES)
def test_patch_targets_have_the_expected_signatures(module):
    importlib.import_module(module).check_drift()


def test_cpu_mode_targets_have_the_expected_signatures():
    cpu_mode.check_drift()


def test_every_patch_module_is_listed():
    found = {
        f"megatron_diffckpt.patches.{p.stem}"
        for p in (REPO / "megatron_diffckpt" / "patches").glob("*.py")
        if p.stem not in ("__init__", "base")
    }
    assert found == set(ALL_PATCHES)
    integrations = {
        f"megatron_diffckpt.integrations.{p.stem}"
        for p in (REPO / "megatron_diffckpt" / "integrations").glob("*.py")
        # the hooks' data, and the run they call: no hook
        if p.stem not in ("__init__", "megatron_lm_releases", "megatron_lm_run")
    }
    assert integrations == set(MEGATRON_LM_PATCHES)
