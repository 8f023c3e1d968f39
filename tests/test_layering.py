"""Import contracts (``[tool.importlinter]`` in pyproject.toml, checked by ``lint-imports`` in
``make lint`` and ``make test``): no import cycle in any package, ``storage/`` knows nothing of
the keeper, and the modules below the manager take tensors, shards and process groups and import
neither megatron nor the patches (the hook points into megatron). Only ``patches/``,
``integrations/``, the per-iteration strategies, the manager and the CPU shim touch megatron; a
module added to the package must be placed on one side or the other."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "megatron_diffckpt"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
# The strategies, the manager and the CPU shim are allowed to reach megatron (through patches).
# (strategies/: LowDiff and LowDiff+; its base module is below, in the "core" contract)
ABOVE = {"megatron_diffckpt", "cpu_mode", "manager", "strategies"}


def contracts(root: Path = REPO) -> dict[str, dict]:
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["id"]: c for c in config["contracts"]}


def lint_imports(root: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-logo", "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_every_module_is_placed_on_one_side():
    below = {
        m.removeprefix("megatron_diffckpt.").split(".")[0]
        for m in contracts()["core"]["source_modules"]
    }
    tops = {
        p.stem if p.parent == PACKAGE else p.relative_to(PACKAGE).parts[0]
        for p in PACKAGE.rglob("*.py")
        if p.relative_to(PACKAGE).parts[0] not in ("patches", "integrations")
    }
    tops = {"megatron_diffckpt" if t == "__init__" else t for t in tops}
    assert tops == below | ABOVE, (tops - below - ABOVE, (below | ABOVE) - tops)


def test_the_package_keeps_its_import_contracts():
    proc = lint_imports(REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "0 broken" in proc.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        ("recovery.py", "import megatron.core\n", "Below the manager"),
        ("storage/reader.py", "from megatron_diffckpt.keeper import client\n",
         "storage/ knows nothing"),
        ("storage/format.py", "def f():\n    from megatron_diffckpt.patches import base\n",
         "Below the manager"),
        ("errors.py", "if False:\n    from megatron_diffckpt import config\n",
         "No import cycle"),
    ],
)  # fmt: skip
def test_the_contracts_catch_a_forbidden_import(tmp_path, module, line, broken):
    """A copy of the package with one forbidden import added (function-level and
    never-executed imports count) breaks the contract that names it."""
    shutil.copytree(PACKAGE, tmp_path / PACKAGE.name)
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    with open(tmp_path / PACKAGE.name / module, "a") as f:
        f.write(line)
    proc = lint_imports(tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert broken in proc.stdout.split("Broken contracts")[1], proc.stdout[-3000:]


def test_every_module_of_the_package_imports():
    """A module left importing a name that moved fails here, in the quick tests, rather than in
    the first training job that reaches it (Megatron-LM's training modules aside: they need a
    checkout on the path, and tests/test_megatron_lm.py imports them)."""
    names = [
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.name != "__main__.py"
    ]
    code = (
        "import importlib, sys\n"
        "failed = []\n"
        f"for name in {names!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError as exc:\n"
        "        if not (exc.name or '').startswith('megatron.training'):\n"
        "            failed.append(f'{name}: {exc}')\n"
        "print('\\n'.join(failed)); sys.exit(1 if failed else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
