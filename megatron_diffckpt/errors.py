"""The package's exceptions: one base, and a subclass for what a user causes by flags or setup.

Every error this package raises on purpose is a :class:`DiffCkptError`, so a training script can
catch them all in one place (as megatron's ``CheckpointingException`` or DCP's
``CheckpointException``). Errors a user can fix (a flag, a folder, a version) are
:class:`DiffCkptUsageError`; their message says what was expected, what was found, and what to
do. The concrete classes keep the builtin base they always had (``ValueError``,
``RuntimeError``, ``FileNotFoundError``), so ``except ValueError`` around a flag parser still
works.
"""

from __future__ import annotations


class DiffCkptError(Exception):
    """Base of every error megatron-diffckpt raises on purpose."""


class DiffCkptUsageError(DiffCkptError, ValueError):
    """Caused by flags or setup: the message says what to change."""
