"""One place for pins: the Dockerfile installs exactly requirements/cpu.txt's pins, and is linted.

The container cannot be built on the CI machines (no container engine): these checks are what
stands between the Dockerfile and drift.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = (REPO / "Dockerfile").read_text()
# Provided by the NGC PyTorch image, not installed over it.
FROM_IMAGE = {"torch", "numpy", "packaging"}


def _pins() -> dict[str, str]:
    text = (REPO / "requirements" / "cpu.txt").read_text()
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", text, re.MULTILINE))


def test_dockerfile_installs_the_pinned_packages_the_image_lacks():
    m = re.search(r"grep -E '\^\(([^)]*)\)==' requirements/cpu\.txt", DOCKERFILE)
    assert m, "the Dockerfile must take its pins from requirements/cpu.txt"
    installed = set(m.group(1).split("|"))
    pins = _pins()
    assert installed <= set(pins), f"{installed - set(pins)} not pinned in requirements/cpu.txt"
    assert installed | FROM_IMAGE == set(pins), (
        "every pin of requirements/cpu.txt is either installed by the Dockerfile or provided by "
        f"the image; unaccounted: {set(pins) - installed - FROM_IMAGE}"
    )


def test_dockerfile_pins_nothing_itself_and_pins_its_base_image():
    assert not re.search(r"[A-Za-z0-9_-]+==\d", DOCKERFILE), "versions belong in requirements/"
    tag = re.search(r"^ARG NGC_PYTORCH_TAG=(\S+)$", DOCKERFILE, re.MULTILINE)
    assert tag and re.fullmatch(r"\d{2}\.\d{2}-py3", tag.group(1)), "pin the NGC image tag"
    # The real image name: `docker build .` needs no arguments.
    assert re.search(
        r"^FROM nvcr\.io/nvidia/pytorch:\$\{NGC_PYTORCH_TAG\}$", DOCKERFILE, re.MULTILINE
    )


def test_dockerfile_gets_the_megatron_lm_release_of_the_pinned_megatron_core():
    from megatron_diffckpt.integrations.megatron_lm import MEGATRON_LM_COMMITS

    tag = f"core_v{_pins()['megatron-core']}"
    commit = re.search(r"^ARG MEGATRON_LM_COMMIT=([0-9a-f]{40})$", DOCKERFILE, re.MULTILINE)
    assert commit and MEGATRON_LM_COMMITS.get(tag) == commit.group(1), (
        f"the Dockerfile must fetch Megatron-LM {tag} ({MEGATRON_LM_COMMITS.get(tag)})"
    )
    assert f"tag {tag}" in DOCKERFILE
    assert (
        'ENTRYPOINT ["torchrun", "--nproc-per-node=gpu", "examples/gpt/pretrain_gpt_diffckpt.py"]'
        in DOCKERFILE
    )


def test_the_package_needs_what_the_pins_provide():
    """pyproject's ranges admit the pinned versions (the container installs with --no-deps)."""
    text = (REPO / "pyproject.toml").read_text()
    pins = _pins()
    for name in ("megatron-core", "psutil", "numpy", "torch"):
        assert f'"{name}' in text, f"pyproject.toml does not declare {name}"
    core = re.search(r'"megatron-core>=([\d.]+),<([\d.]+)"', text)
    low, high = (tuple(map(int, v.split("."))) for v in core.groups())
    assert low <= tuple(map(int, pins["megatron-core"].split("."))) < high


def test_dockerfile_passes_hadolint():
    beside = Path(sys.executable).parent / "hadolint"  # the venv's, installed by test.txt
    hadolint = str(beside) if beside.exists() else shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (requirements/test.txt installs it)")
    proc = subprocess.run(
        [hadolint, "--failure-threshold", "info", "-"],
        input=DOCKERFILE,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
