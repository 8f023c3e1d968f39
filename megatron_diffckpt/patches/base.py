"""Wrapping a megatron-core method: apply/revert, idempotence and the drift check, once.

A :class:`MethodPatch` replaces ``owner.name`` with a wrapper that calls the original. Before it
wraps, it checks that the original still has the signature the wrapper was written for; when
megatron-core drifts it fails loudly instead of wrapping something it does not understand.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_diffckpt.errors import DiffCkptUsageError

# The megatron-core releases the patches were written and tested against. Keep in step with the
# pin in requirements/cpu.txt (tests/test_drift.py checks both).
TESTED_MEGATRON_CORE_VERSIONS = ("0.16.1", "0.19.2")


class MegatronDriftError(DiffCkptUsageError, RuntimeError):
    """The installed megatron-core does not have the function a patch was written for."""


def installed_megatron_core_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return "not installed"


def release_order(version: str) -> tuple[int, ...]:
    """``"0.19.0"`` (or ``"0.19.0rc1"``) as ``(0, 19, 0)``, for ordering releases."""
    return tuple(int(n) for n in re.findall(r"\d+", version)[:3])


def signature_of(fn: Callable) -> str:
    """``inspect.signature`` as text, the form the drift checks compare. Annotations a module
    keeps as strings (``from __future__ import annotations``, as some megatron-core modules do
    from 0.17 on) are evaluated first, so the text does not depend on how the module spells
    them; where one cannot be evaluated (a name imported for type checkers only) it stays text."""
    try:
        return str(inspect.signature(fn, eval_str=True))
    except Exception:  # noqa: BLE001 - any failure to evaluate leaves the annotations as text
        return str(inspect.signature(fn))


def _known(expected: str | Mapping[str, str]) -> dict[str, str]:
    """An expected signature as ``{releases: signature}``; a plain string holds for every
    tested release."""
    if isinstance(expected, str):
        return {", ".join(TESTED_MEGATRON_CORE_VERSIONS): expected}
    return dict(expected)


@dataclass
class MethodPatch:
    """Wrap ``module:qualname`` (a function or a class attribute) with ``make_wrapper(original)``.

    Attributes:
        target: ``"package.module:Class.method"`` or ``"package.module:function"``.
        expected_signature: :func:`signature_of` the original as written for: one text for
            every tested release, or ``{release: text}`` where megatron-core releases differ
            (any of them passes).
        make_wrapper: builds the replacement from the original (a wrapper that calls it, or, in
            CPU mode only, a CPU implementation of a CUDA-only helper).
        purpose: one line for error messages and the README.
        requires: other megatron-core functions the replacement calls, as
            ``(target, expected_signature)`` pairs; they are drift-checked too.
        until: the first tested release where what the patch serves is gone, with its target
            (``None``: every release has it). From that release on the patch is neither checked
            nor applied.
    """

    target: str
    expected_signature: str | Mapping[str, str]
    make_wrapper: Callable[[Callable], Callable]
    purpose: str
    requires: tuple[tuple[str, str | Mapping[str, str]], ...] = ()
    until: str | None = None
    _original: Any = field(default=None, init=False, repr=False)

    @staticmethod
    def _resolve_target(target: str) -> tuple[Any, str]:
        module_name, qualname = target.split(":")
        owner: Any = importlib.import_module(module_name)
        *path, name = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        return owner, name

    def _resolve(self) -> tuple[Any, str]:
        return self._resolve_target(self.target)

    def current(self) -> Callable:
        owner, name = self._resolve()
        if not hasattr(owner, name):
            raise MegatronDriftError(
                self._drift_message(self.target, self.expected_signature, "<missing>")
            )
        return inspect.getattr_static(owner, name)

    @property
    def needed(self) -> bool:
        """Whether the installed release has what this patch serves (see ``until``)."""
        if self.until is None:
            return True
        installed = installed_megatron_core_version()
        return installed == "not installed" or release_order(installed) < release_order(self.until)

    def check_drift(self) -> None:
        """Raise :class:`MegatronDriftError` if a signature this patch relies on has changed."""
        if not self.needed:
            return
        fn = self._original if self._original is not None else self.current()
        found = signature_of(fn)
        if found not in _known(self.expected_signature).values():
            raise MegatronDriftError(
                self._drift_message(self.target, self.expected_signature, found)
            )
        for target, expected in self.requires:
            owner, name = self._resolve_target(target)
            found = (
                signature_of(inspect.getattr_static(owner, name))
                if hasattr(owner, name)
                else "<missing>"
            )
            if found not in _known(expected).values():
                raise MegatronDriftError(self._drift_message(target, expected, found))

    def _drift_message(self, target: str, expected: str | Mapping[str, str], found: str) -> str:
        known = " or ".join(f"{sig} ({releases})" for releases, sig in _known(expected).items())
        return (
            f"megatron-core drift at {target} (needed to {self.purpose}): expected signature "
            f"{known}, found {found}. Installed megatron-core "
            f"{installed_megatron_core_version()}; the patch was tested with "
            f"{', '.join(TESTED_MEGATRON_CORE_VERSIONS)}. Install a tested version, or update "
            f"the patch and its expected signature after checking the new code."
        )

    @property
    def applied(self) -> bool:
        return self._original is not None

    def apply(self) -> None:
        """Wrap the target (where the installed release needs it). Any rank; idempotent."""
        if self.applied or not self.needed:
            return
        self.check_drift()
        owner, name = self._resolve()
        original = inspect.getattr_static(owner, name)
        wrapper = self.make_wrapper(original)
        if not isinstance(wrapper, staticmethod):  # a staticmethod's is its function's, read-only
            wrapper.__wrapped__ = original
        setattr(owner, name, wrapper)
        self._original = original

    def revert(self) -> None:
        """Restore the original. Any rank; idempotent."""
        if not self.applied:
            return
        owner, name = self._resolve()
        setattr(owner, name, self._original)
        self._original = None


@dataclass
class PatchSet:
    """The patches of one hook point, applied, reverted and checked together."""

    patches: tuple[MethodPatch, ...]

    def apply(self) -> None:
        """Apply every patch. Any rank; idempotent; nothing is applied if one has drifted."""
        for p in self.patches:
            p.check_drift()
        for p in self.patches:
            p.apply()

    def revert(self) -> None:
        """Revert every patch. Any rank; idempotent."""
        for p in reversed(self.patches):
            p.revert()

    def check_drift(self) -> None:
        for p in self.patches:
            p.check_drift()
