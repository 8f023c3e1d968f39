"""Layering: the modules below the manager take tensors, shards and process groups, and import
neither megatron nor the patches (the hook points into megatron). Only ``patches/``,
``integrations/``, the per-iteration strategies, the manager and the CPU shim touch megatron;
a module added to the package must be placed on one side or the other here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_diffckpt"

# Below the manager: capture, recovery, the merger, storage, compression, tuning, the offline
# tools, and what they share.
BELOW_THE_MANAGER = (
    "autotune.py", "background.py", "base_space.py", "capture.py", "checkpoint_layout.py", "cli.py",
    "compression.py", "config.py", "dist_ckpt_io.py", "durable_io.py", "errors.py",
    "exchange.py", "export.py", "failpoints.py", "full_storage.py", "keeper.py", "keeper_peers.py",
    "keeper_base.py", "keeper_log.py", "keeper_merger.py", "keeper_replica.py", "keeper_wire.py",
    "keeper_writes.py",
    "shared_replica.py",
    "offline_merge.py",
    "progress.py", "recovery.py", "reshardable.py",
    "replica_merger.py", "retention.py", "scale_plan.py", "shard_map.py", "snapshot.py",
    "strategy.py", "tuning.py", "storage/__init__.py", "storage/format.py", "storage/reader.py",
    "storage/writer.py",
)  # fmt: skip
# The strategies, the manager and the CPU shim are allowed to reach megatron (through patches).
ABOVE = ("__init__.py", "cpu_mode.py", "lowdiff.py", "manager.py", "plus.py")
FORBIDDEN = ("megatron", "megatron_diffckpt.patches", "megatron_diffckpt.integrations")


def imported_modules(source: str) -> set[str]:
    """Every module a source imports, at any depth (function-level imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def violations(source: str) -> list[str]:
    return sorted(
        name
        for name in imported_modules(source)
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)
    )


@pytest.mark.parametrize("module", BELOW_THE_MANAGER)
def test_module_below_the_manager_imports_neither_megatron_nor_the_patches(module):
    found = violations((PACKAGE / module).read_text())
    assert not found, f"megatron_diffckpt/{module} imports {found}: it sits below the manager"


def test_every_module_is_placed_on_one_side():
    modules = {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.parts[-2] not in ("patches", "integrations")
    }
    assert modules == set(BELOW_THE_MANAGER) | set(ABOVE)


@pytest.mark.parametrize(
    "source",
    [
        "import megatron.core",
        "from megatron.core import parallel_state",
        "def f():\n    from megatron_diffckpt.patches import optimizer_step\n",
        "from megatron_diffckpt import patches",
        "from megatron_diffckpt.integrations.megatron_lm import RUN",
    ],
)
def test_the_check_catches_an_import_of_megatron_or_the_patches(source):
    assert violations(source)


def test_the_check_lets_the_core_import_itself_and_torch():
    assert not violations("import torch\nfrom megatron_diffckpt.storage import format\n")
