"""Imported by ``multiprocessing``'s fork server before it serves, when a rank asked for it
(:func:`~megatron_diffckpt.background.fork_server_dies_with_this_process`): the server dies with
the rank thread that started it, and every process it forks (megatron-core 0.19's persistent
checkpoint worker) dies with the server. Anywhere else, importing it does nothing.
"""

from __future__ import annotations

from megatron_diffckpt.background import (
    children_die_with_this_process,
    die_with_parent,
    in_fork_server,
)

if in_fork_server():
    die_with_parent()
    children_die_with_this_process()
