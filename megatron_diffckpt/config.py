"""``DiffCkptConfig``: every setting of differential checkpointing, and its ``--diffckpt-*`` flags.

The flags are generated from the dataclass (name, type, default, choices, help from the field's
docstring), so a setting is written once. Validation lives in ``__post_init__`` (rules between
``--diffckpt-*`` flags) and :meth:`DiffCkptConfig.check_launch` (rules between them and the
Megatron flags of a launch); both training entries call these, and no other place holds a rule
between flags.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import os
from dataclasses import MISSING, dataclass, fields
from typing import Any

from megatron_diffckpt.errors import DiffCkptUsageError

MODES = ("off", "lowdiff", "lowdiff-plus")
WHEN_FULL = ("block", "skip")
COMPRESSORS = ("none", "topk")


@dataclass
class DiffCkptConfig:
    """Differential checkpointing settings (one field per ``--diffckpt-*`` flag)."""

    mode: str = "off"
    """off: stock checkpoints only. lowdiff: write every iteration's optimizer input as a
    differential, replayed on --load onto the newest base. lowdiff-plus: snapshot each reduced
    gradient bucket to host memory during the backward pass, merge it into a host replica of the
    optimizer shard, and persist bases from the replica in the background."""

    dir: str | None = None
    """Folder of the diff log; default SAVE/diffckpt."""

    batch_size: int = 1
    """Iterations per diff-log write (B); a crash loses at most this many iterations."""

    max_pending: int = 2
    """Writes that may wait for the background writer; bounds host memory."""

    when_full: str = "block"
    """When the diff-log writer falls behind or the storage under --save is full: block
    (wait for the writer; a full disk stops the job with one line) or skip (drop the batch or
    the base with one warning per incident and train on; durability waits for the next base)."""

    full_interval: int = 0
    """Iterations between bases (stock dist checkpoints, F); 0 uses --save-interval."""

    keep_bases: int = 0
    """Newest complete bases to keep, with the differentials they can replay; 0 keeps all."""

    compressor: str = "none"
    """Data-parallel gradient exchange: none (megatron's dense reduction) or topk (top-k per
    bucket with error feedback; the optimizer input, and so each differential, is sparse).
    Applies with --diffckpt-mode off too (compressed training without checkpoints)."""

    topk_ratio: float = 0.01
    """Fraction of each bucket's entries every rank sends with --diffckpt-compressor topk."""

    auto_tune: bool = False
    """Re-derive the base interval F and the write batch B from measured costs while training
    (megatron_diffckpt.tuning); each decision is logged with the numbers behind it. LowDiff+:
    also turns the diff log off when storage cannot take it every iteration and bases only is
    cheaper."""

    mtbf_hours: float = 24.0
    """Mean time between failures of the whole job, in hours (the auto-tuner's failure rate)."""

    host_memory_budget: int = 4096
    """MiB of host memory the diff writer may hold; bounds the auto-tuned B."""

    retune_interval: int = 50
    """Iterations between auto-tune decisions."""

    buffered_io: bool = False
    """Write diff-log segments through the page cache. By default they are written with direct
    I/O (O_DIRECT) wherever the filesystem takes it: no copy into the page cache and no
    writeback on the training node's cores; a filesystem that refuses it is written buffered,
    said once in the log."""

    plus_no_diff_log: bool = False
    """lowdiff-plus: persist bases only, without the per-iteration differentials between them
    (recovery from storage then resumes from the newest base; with
    --diffckpt-plus-keeper-replica a restart whose keepers live still recovers the newest
    iteration from them)."""

    plus_keeper_replica: bool = False
    """lowdiff-plus under a node launcher with a keeper (--diffckpt-keeper-memory): the replica
    and its merger live in the node's keeper, which outlives the ranks, and the keeper writes
    the diff log from its merges (the ranks write none); a restart recovers from the keepers
    without reading storage, and from storage's bases and diff log when a keeper was lost
    (without a keeper: in-process, as without this flag)."""

    plus_keeper_writes_bases: bool = False
    """lowdiff-plus with --diffckpt-plus-keeper-replica: the keeper writes each base's files
    (the rank stages the plan's tensors in shared memory, one memcpy, and only plans and
    finalizes bases) instead of the rank's persister thread. Off by default: on hosts whose
    cores training keeps busy it costs more than it saves (measured on 2 CPU cores, a base
    every iteration: +8.7% per iteration against the ranks writing); for hosts with spare
    cores, where the rank's own interpreter is the contended resource."""

    keeper_no_base: bool = False
    """lowdiff under a node launcher with a keeper: do not stage each base in the keeper's
    memory. By default every base is also copied there (one host copy of the optimizer shard
    and residuals per base; held within --diffckpt-keeper-memory), so that a restart whose
    ranks all find it reads no base from storage."""

    keeper_writes_log: bool = False
    """lowdiff under a node launcher with a keeper: the keeper writes each rank's diff log from
    the records the rank hands it (already encoded: no second serialisation or checksum), and
    the rank's writer only hands over, keeping each record until the keeper reports it durable;
    a rank whose keeper is lost writes its log itself from the newest durable iteration on."""

    keeper_replica: bool = False
    """lowdiff under a node launcher with a keeper: the keeper also steps a copy of each rank's
    newest kept base with every differential the rank hands over (one iteration behind), so
    that a restart takes the state at the recovered iteration from it and replays nothing. It
    costs the keeper one optimizer step per iteration and one more host copy of the optimizer
    shard and residuals (held within --diffckpt-keeper-memory)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise DiffCkptUsageError(f"--diffckpt-mode must be one of {MODES}, got {self.mode!r}")
        if self.when_full not in WHEN_FULL:
            raise DiffCkptUsageError(
                f"--diffckpt-when-full must be one of {WHEN_FULL}, got {self.when_full!r}"
            )
        for name in ("batch_size", "max_pending"):
            if getattr(self, name) < 1:
                raise DiffCkptUsageError(f"--diffckpt-{name.replace('_', '-')} must be >= 1")
        for name in ("full_interval", "keep_bases"):
            if getattr(self, name) < 0:
                raise DiffCkptUsageError(f"--diffckpt-{name.replace('_', '-')} must be >= 0")
        if self.compressor not in COMPRESSORS:
            raise DiffCkptUsageError(
                f"--diffckpt-compressor must be one of {COMPRESSORS}, got {self.compressor!r}"
            )
        for name in ("mtbf_hours", "host_memory_budget", "retune_interval"):
            if getattr(self, name) <= 0:
                raise DiffCkptUsageError(f"--diffckpt-{name.replace('_', '-')} must be > 0")
        if self.mode == "lowdiff-plus" and self.compressor != "none":
            raise DiffCkptUsageError(
                "--diffckpt-mode lowdiff-plus is for training without gradient compression; "
                "use --diffckpt-mode lowdiff with --diffckpt-compressor topk"
            )
        if self.mode == "lowdiff-plus" and self.auto_tune and self.plus_no_diff_log:
            raise DiffCkptUsageError(
                "--diffckpt-auto-tune measures the diff log to choose between it and bases "
                "only; drop --diffckpt-plus-no-diff-log (or --diffckpt-auto-tune and set "
                "--diffckpt-full-interval yourself)"
            )
        if self.plus_keeper_replica and (self.mode != "lowdiff-plus" or self.auto_tune):
            raise DiffCkptUsageError(
                "--diffckpt-plus-keeper-replica is for --diffckpt-mode lowdiff-plus without "
                "--diffckpt-auto-tune (the keeper writes the diff log; the tuner measures the "
                "ranks' writer)"
            )
        if self.plus_keeper_writes_bases and not self.plus_keeper_replica:
            raise DiffCkptUsageError(
                "--diffckpt-plus-keeper-writes-bases is for --diffckpt-plus-keeper-replica (the "
                "keeper that holds the replica writes its bases)"
            )
        if self.keeper_writes_log and self.mode != "lowdiff":
            raise DiffCkptUsageError(
                "--diffckpt-keeper-writes-log is for --diffckpt-mode lowdiff (with "
                "--diffckpt-plus-keeper-replica, lowdiff-plus's keeper writes its diff log)"
            )
        if self.keeper_replica and (self.mode != "lowdiff" or self.keeper_no_base):
            raise DiffCkptUsageError(
                "--diffckpt-keeper-replica is for --diffckpt-mode lowdiff without "
                "--diffckpt-keeper-no-base (the replica starts from each base kept in the "
                "keeper; lowdiff-plus has --diffckpt-plus-keeper-replica)"
            )
        if not 0.0 < self.topk_ratio <= 1.0:
            raise DiffCkptUsageError(
                f"--diffckpt-topk-ratio must be in (0, 1], got {self.topk_ratio}"
            )

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def check_launch(self, args: argparse.Namespace) -> None:
        """Check these settings against a launch's Megatron flags (``args`` of the GPT example or
        of Megatron-LM; flags either lacks count as their Megatron-LM default). Raises
        :class:`DiffCkptUsageError` naming every conflict and the flag to change."""
        problems = [p for p in self._launch_problems(args) if p]
        if problems:
            raise DiffCkptUsageError("; ".join(problems))

    def _launch_problems(self, args: argparse.Namespace):
        def flag(name: str, default: Any = None) -> Any:
            value = getattr(args, name, default)
            return default if value is None else value

        save, load = flag("save"), flag("load")
        ckpt_format = flag("ckpt_format", "torch_dist")
        if self.auto_tune and not self.enabled:
            yield "--diffckpt-auto-tune needs --diffckpt-mode lowdiff"
        if self.compressor != "none" and ckpt_format != "torch_dist":
            yield (
                f"--ckpt-format {ckpt_format} does not save the compressed exchange's "
                "error-feedback residuals; use torch_dist"
            )
        if self.compressor != "none" and flag("context_parallel_size", 1) > 1:
            yield "--diffckpt-compressor topk does not support context parallelism yet"
        if not self.enabled:
            return
        mode = f"--diffckpt-mode {self.mode}"
        if save is None:
            yield f"{mode} needs --save DIR (the diff log lives beside the bases)"
        elif load is not None and os.path.abspath(load) != os.path.abspath(save):
            yield (
                f"{mode} continues the differential log of --load: use the same folder for "
                f"--save (got --load {load}, --save {save})"
            )
        if ckpt_format != "torch_dist":
            yield f"{mode} writes torch_dist bases; --ckpt-format {ckpt_format} is not supported"
        if self.mode == "lowdiff-plus" and not flag("use_distributed_optimizer", False):
            yield f"{mode} needs --use-distributed-optimizer (its replica is the optimizer shard)"
        if self.mode == "lowdiff-plus" and flag("fp16", False):
            yield f"{mode} does not support fp16 loss scaling yet; use --bf16 or fp32"
        if self.full_interval == 0 and not flag("save_interval", 0):
            yield f"{mode} needs --diffckpt-full-interval or --save-interval"
        if flag("context_parallel_size", 1) > 1 or flag("expert_model_parallel_size", 1) > 1:
            yield "context or expert parallelism is not supported yet"
        if flag("iterations_to_skip", None):
            yield "--iterations-to-skip leaves gaps that no differential can fill"

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add one ``--diffckpt-<field>`` flag per field to ``parser``."""
        group = parser.add_argument_group("differential checkpointing (megatron-diffckpt)")
        docs = field_docs(cls)
        choices = {"mode": MODES, "when_full": WHEN_FULL, "compressor": COMPRESSORS}
        for f in fields(cls):
            flag = f"--diffckpt-{f.name.replace('_', '-')}"
            if str(f.type) == "bool":
                group.add_argument(
                    flag, dest=f"diffckpt_{f.name}", action="store_true", help=docs.get(f.name)
                )
                continue
            kind = {"int": int, "float": float, "str": str, "str | None": str}[str(f.type)]
            group.add_argument(
                flag,
                dest=f"diffckpt_{f.name}",
                type=kind,
                default=f.default if f.default is not MISSING else None,
                choices=choices.get(f.name),
                help=docs.get(f.name, ""),
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DiffCkptConfig:
        """The config of parsed flags; raises :class:`DiffCkptUsageError` (a ``ValueError``) with
        the flag's name when invalid."""
        return cls(**{f.name: getattr(args, f"diffckpt_{f.name}") for f in fields(cls)})


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of ``cls`` (its attribute docstring)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs: dict[str, Any] = {}
    for node, following in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
                docs[node.target.id] = " ".join(str(following.value.value).split())
    return docs
