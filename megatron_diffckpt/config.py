"""``DiffCkptConfig``: every setting of differential checkpointing, and its ``--diffckpt-*`` flags.

The flags are generated from the dataclasses (name, type, default, choices, help from the field's
docstring), so a setting is written once. :class:`DiffCkptConfig` holds what a user sets per
launch, one flag per field; :class:`DiffCkptOptions` holds the fine-grained settings that tests,
benchmarks and experts reach through one flag, ``--diffckpt-option NAME=VALUE``. Validation lives
in ``__post_init__`` (rules between settings) and :meth:`DiffCkptConfig.check_launch` (rules
between them and the Megatron flags of a launch); both training entries call these, and no other
place holds a rule between flags.

The memory tier is one switch, ``--diffckpt-keeper {auto,off}``: under a launcher that runs a
node keeper (``megatron-diffckpt-launch --keeper-memory MIB``), ``auto`` uses it for what
measured best per mode (see :meth:`DiffCkptConfig.keeper_plan`); without a keeper it does
nothing.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from megatron_diffckpt.errors import DiffCkptUsageError

MODES = ("off", "lowdiff", "lowdiff-plus")
WHEN_FULL = ("block", "skip", "strict")
COMPRESSORS = ("none", "topk")
KEEPER = ("auto", "off")
REPLICA_KERNELS = ("auto", "fused")

TRUE, FALSE = ("true", "on", "yes", "1"), ("false", "off", "no", "0")


@dataclass
class DiffCkptOptions:
    """Fine-grained settings, one ``--diffckpt-option NAME=VALUE`` each. The defaults are what
    was measured best; ``auto`` (the keeper's) lets :meth:`DiffCkptConfig.keeper_plan` decide."""

    max_pending: int = 2
    """Writes that may wait for the background writer; bounds host memory."""

    host_memory_budget: int = 4096
    """MiB of host memory the diff writer may hold; bounds the auto-tuned B."""

    retune_interval: int = 50
    """Iterations between auto-tune decisions."""

    max_full_interval: int = 0
    """--diffckpt-auto-tune: the longest F (iterations between bases) the tuner may choose; 0:
    as long as the cost model finds best. A cap bounds what a base interval keeps on storage
    (F differentials per rank, retained until the next base) and the replay a restart from
    storage may need."""

    buffered_io: bool = False
    """Write diff-log segments through the page cache. By default they are written with direct
    I/O (O_DIRECT) wherever the filesystem takes it: no copy into the page cache and no
    writeback on the training node's cores; a filesystem that refuses it is written buffered,
    said once in the log."""

    diff_log: bool = True
    """lowdiff-plus: write the per-iteration differentials between bases. false: bases only
    (recovery from storage then resumes from the newest base; a restart whose keepers live
    still recovers the newest iteration from their replicas)."""

    keeper_kept_bases: bool | None = None
    """lowdiff under a keeper: also copy each base into the keeper's memory (held within its
    cap), so that a restart whose ranks all find it reads no base from storage. auto: on."""

    keeper_writes_log: bool | None = None
    """lowdiff under a keeper: the keeper writes each rank's diff log from the records the rank
    hands it (already encoded); a rank whose keeper is lost writes its log itself from the
    newest durable iteration on. auto: on (measured per iteration as the ranks writing it)."""

    keeper_replica: bool | None = None
    """Under a keeper. lowdiff: the keeper steps a copy of each kept base with every
    differential (one iteration behind), so a restart replays nothing; a copy over the
    keeper's cap is refused with one warning. lowdiff-plus: the replica and its merger live in
    the keeper, which writes the diff log. auto: on (off for lowdiff-plus with
    --diffckpt-auto-tune, which measures the ranks' writer)."""

    keeper_writes_bases: bool = False
    """lowdiff-plus with its replica in the keeper: the keeper writes each base's files instead
    of the rank's persister thread. Off: measured slower on hosts whose cores training keeps
    busy (a base every iteration on 2 CPU cores: +31.8% per iteration against +21.3%)."""

    collective_timeout: int = 600
    """Seconds a collective of this library (an agreement on a base's outcome, on the
    iteration to recover) waits for every rank; then the job stops in one line naming the ranks
    that did not arrive and where each was last (Megatron-LM's --distributed-timeout-minutes
    is 10 minutes too)."""

    max_merge_wait_ms: int = 0
    """lowdiff-plus: how long training may wait, in one iteration, for its merger to free a
    snapshot slot. Past that, LowDiff+ stops merging until the next base instead of slowing
    training to the merger's pace: the iterations in between are not merged, but logged as
    ever (the diff log is written ahead of the merge), and the base is staged from the training
    state. 0: wait as long as it takes (every iteration merged). With the replica in the node's
    keeper, the wait bounded is the hand-over of the previous iteration (which waits for the
    keeper's merge); the iterations in between are logged but not merged there too, or, with
    diff_log=false, neither merged nor logged. With --diffckpt-auto-tune, 0 lets the
    tuner set a bound where waiting costs more."""

    replica_kernel: str = "auto"
    """lowdiff-plus: what the host replica steps with. auto: training's own optimizer kernel
    where training runs on the CPU (the replica bit-identical to the training state), torch's
    fused CPU Adam where no host kernel can match training's bit for bit anyway (training on
    GPUs). fused: the fused kernel on the CPU too (measured 3x the exact kernel's pace per
    thread): the replica then drifts from the training state by rounding between bases, and
    every base re-anchors it first (a copy of the training state; what is written to storage,
    bases and diff log, and so recovery from storage, stay exact; a recovery from the keepers'
    replicas is within rounding)."""

    def __post_init__(self) -> None:
        for name in ("max_pending", "host_memory_budget", "retune_interval", "collective_timeout"):
            if getattr(self, name) < 1:
                raise DiffCkptUsageError(f"--diffckpt-option {name} must be >= 1")
        for name in ("max_merge_wait_ms", "max_full_interval"):
            if getattr(self, name) < 0:
                raise DiffCkptUsageError(f"--diffckpt-option {name} must be >= 0")
        if self.replica_kernel not in REPLICA_KERNELS:
            raise DiffCkptUsageError(
                f"--diffckpt-option replica_kernel takes {' or '.join(REPLICA_KERNELS)}; "
                f"got {self.replica_kernel!r}"
            )

    @classmethod
    def parse(cls, items: list[str] | None) -> DiffCkptOptions:
        """The options of ``--diffckpt-option`` values (``NAME=VALUE``, several comma-separated
        in one), each converted to its field's type; unknown names and bad values raise
        :class:`DiffCkptUsageError` naming the option and what it takes."""
        kinds = {f.name: str(f.type) for f in fields(cls)}
        values: dict[str, Any] = {}
        for item in ",".join(items or []).split(","):
            if not item.strip():
                continue
            name, sep, text = item.strip().partition("=")
            name = name.strip().replace("-", "_")
            if not sep or name not in kinds:
                raise DiffCkptUsageError(
                    f"--diffckpt-option takes NAME=VALUE with NAME one of "
                    f"{', '.join(kinds)}; got {item.strip()!r}"
                )
            values[name] = _convert(name, kinds[name], text.strip())
        return cls(**values)


def _convert(name: str, kind: str, text: str) -> Any:
    lowered = text.lower()
    if kind == "str":
        return lowered
    if kind.startswith("bool"):
        if lowered in TRUE:
            return True
        if lowered in FALSE:
            return False
        if kind == "bool | None" and lowered == "auto":
            return None
        allowed = "true, false" + (" or auto" if kind == "bool | None" else "")
        raise DiffCkptUsageError(f"--diffckpt-option {name} takes {allowed}; got {text!r}")
    try:
        return int(text)
    except ValueError:
        raise DiffCkptUsageError(
            f"--diffckpt-option {name} takes an integer; got {text!r}"
        ) from None


@dataclass(frozen=True)
class KeeperPlan:
    """What the node's keeper does for a rank of this launch, once a keeper was found (all
    false without one)."""

    kept_bases: bool = False
    """lowdiff: each base is copied into the keeper."""
    writes_log: bool = False
    """lowdiff: the keeper writes the diff log."""
    replica: bool = False
    """lowdiff: the keeper steps a copy of the kept base; lowdiff-plus: the replica lives there."""
    writes_bases: bool = False
    """lowdiff-plus: the keeper writes the base files."""


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
    """Iterations per diff-log write (B); a crash loses at most this many iterations while
    storage keeps up (always, with --diffckpt-when-full strict)."""

    full_interval: int = 0
    """Iterations between bases (stock dist checkpoints, F); 0 uses --save-interval."""

    keep_bases: int = 0
    """Newest complete bases to keep, with the differentials they can replay; 0 keeps all."""

    when_full: str = "block"
    """When the diff-log writer falls behind or the storage under --save is full: block
    (wait for the writer once max_pending batches wait for it, so a crash loses at most
    (1 + max_pending) x B iterations; a full disk stops the job with one line), strict (as
    block, and training never runs more than B iterations ahead of what is durable: at most B
    lost whatever the storage does; the rank writes its own log) or skip (drop the batch or the
    base with one warning per incident and train on; durability waits for the next base)."""

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

    keeper: str = "auto"
    """The memory tier: auto uses the node's keeper when the launcher runs one
    (megatron-diffckpt-launch --keeper-memory MIB) for what measured best: lowdiff keeps each
    base, a replica stepped with every differential and the diff log's writing there;
    lowdiff-plus its replica, merger and diff log. A restart recovers from the keepers first,
    then from storage. off: never use a keeper."""

    options: DiffCkptOptions = field(default_factory=DiffCkptOptions)
    """NAME=VALUE[,NAME=VALUE] (repeatable): fine-grained settings for tests, benchmarks and
    experts, each documented in the flag reference: max_pending, host_memory_budget,
    retune_interval, max_full_interval, buffered_io, diff_log, keeper_kept_bases, keeper_writes_log,
    keeper_replica, keeper_writes_bases, collective_timeout, max_merge_wait_ms, replica_kernel."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise DiffCkptUsageError(f"--diffckpt-mode must be one of {MODES}, got {self.mode!r}")
        if self.when_full not in WHEN_FULL:
            raise DiffCkptUsageError(
                f"--diffckpt-when-full must be one of {WHEN_FULL}, got {self.when_full!r}"
            )
        if self.keeper not in KEEPER:
            raise DiffCkptUsageError(
                f"--diffckpt-keeper must be one of {KEEPER}, got {self.keeper!r}"
            )
        if self.batch_size < 1:
            raise DiffCkptUsageError("--diffckpt-batch-size must be >= 1")
        for name in ("full_interval", "keep_bases"):
            if getattr(self, name) < 0:
                raise DiffCkptUsageError(f"--diffckpt-{name.replace('_', '-')} must be >= 0")
        if self.compressor not in COMPRESSORS:
            raise DiffCkptUsageError(
                f"--diffckpt-compressor must be one of {COMPRESSORS}, got {self.compressor!r}"
            )
        if self.mtbf_hours <= 0:
            raise DiffCkptUsageError("--diffckpt-mtbf-hours must be > 0")
        if not 0.0 < self.topk_ratio <= 1.0:
            raise DiffCkptUsageError(
                f"--diffckpt-topk-ratio must be in (0, 1], got {self.topk_ratio}"
            )
        if self.mode == "lowdiff-plus" and self.compressor != "none":
            raise DiffCkptUsageError(
                "--diffckpt-mode lowdiff-plus is for training without gradient compression; "
                "use --diffckpt-mode lowdiff with --diffckpt-compressor topk"
            )
        problem = self._options_problem()
        if problem:
            raise DiffCkptUsageError(problem)

    def _options_problem(self) -> str | None:
        o, plus = self.options, self.mode == "lowdiff-plus"
        forced = [
            n for n in ("keeper_kept_bases", "keeper_writes_log", "keeper_replica") if getattr(o, n)
        ] + (["keeper_writes_bases"] if o.keeper_writes_bases else [])
        if self.keeper == "off" and forced:
            return (
                f"--diffckpt-option {forced[0]}=true needs the keeper: drop --diffckpt-keeper off"
            )
        if not o.diff_log and not plus:
            return "--diffckpt-option diff_log=false is for --diffckpt-mode lowdiff-plus"
        if self.when_full == "strict" and (
            o.keeper_writes_log or (plus and o.keeper_replica) or not o.diff_log
        ):
            return (
                "--diffckpt-when-full strict waits on the rank's own diff-log writer: drop "
                "--diffckpt-option keeper_writes_log=true, keeper_replica=true (lowdiff-plus) "
                "and diff_log=false"
            )
        if plus and self.auto_tune and not o.diff_log:
            return (
                "--diffckpt-auto-tune measures the diff log to choose between it and bases "
                "only; drop --diffckpt-option diff_log=false (or --diffckpt-auto-tune and set "
                "--diffckpt-full-interval yourself)"
            )
        if plus and self.auto_tune and o.keeper_replica:
            return (
                "--diffckpt-option keeper_replica=true is for lowdiff-plus without "
                "--diffckpt-auto-tune (the keeper writes the diff log; the tuner measures the "
                "ranks' writer)"
            )
        if o.max_full_interval and not self.auto_tune:
            return (
                "--diffckpt-option max_full_interval caps the auto-tuner's F: add "
                "--diffckpt-auto-tune (or set --diffckpt-full-interval yourself)"
            )
        for name, default in (("max_merge_wait_ms", 0), ("replica_kernel", "auto")):
            if getattr(o, name) != default and not plus:
                return f"--diffckpt-option {name} is for --diffckpt-mode lowdiff-plus"
        if o.keeper_writes_bases and not (plus and self.keeper_plan().replica):
            return (
                "--diffckpt-option keeper_writes_bases=true is for lowdiff-plus with its replica "
                "in the keeper (the keeper that holds the replica writes its bases)"
            )
        if o.keeper_writes_log and self.mode != "lowdiff":
            return (
                "--diffckpt-option keeper_writes_log=true is for --diffckpt-mode lowdiff "
                "(lowdiff-plus's keeper writes its diff log when it holds the replica)"
            )
        if o.keeper_kept_bases and self.mode != "lowdiff":
            return "--diffckpt-option keeper_kept_bases=true is for --diffckpt-mode lowdiff"
        if o.keeper_replica and self.mode == "lowdiff" and o.keeper_kept_bases is False:
            return (
                "--diffckpt-option keeper_replica=true needs keeper_kept_bases (the replica "
                "starts from each base kept in the keeper)"
            )
        return None

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def keeper_plan(self) -> KeeperPlan:
        """What a node's keeper does for this launch when one runs: ``auto`` takes, per mode,
        what measured best (benchmarks/keeper_recovery.py), an option set to true or false
        overrides it; ``off`` (or --diffckpt-mode off) uses none."""
        o = self.options
        if self.keeper == "off" or not self.enabled:
            return KeeperPlan()
        strict = self.when_full == "strict"  # the rank waits on its own writer
        if self.mode == "lowdiff":
            kept = o.keeper_kept_bases is not False
            return KeeperPlan(
                kept_bases=kept,
                writes_log=o.keeper_writes_log is not False and not strict,
                replica=kept and o.keeper_replica is not False,
            )
        in_rank = self.auto_tune or strict  # the tuner measures, strict waits on, the rank's log
        replica = o.keeper_replica if o.keeper_replica is not None else not in_rank
        return KeeperPlan(replica=replica, writes_bases=replica and o.keeper_writes_bases)

    def forced(self, option: str) -> bool:
        """Whether ``--diffckpt-option OPTION=true`` was given (a keeper missing then warrants
        a warning; under ``auto`` it does not)."""
        return getattr(self.options, option) is True

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
        if flag("context_parallel_size", 1) > 1:
            yield (
                "context parallelism is not supported yet (megatron runs it only with "
                "transformer-engine's attention, where no test covers it yet): run without "
                "--context-parallel-size"
            )
        if flag("async_save", False) and flag("async_strategy", "mcore") == "nvrx":
            yield (
                f"{mode} hands its bases to megatron-core's own asynchronous save; --async-save "
                "through NVIDIA's resiliency extension (--async-strategy nvrx, Megatron-LM's "
                "default from 0.19) is not supported yet: add --async-strategy mcore"
            )
        if flag("iterations_to_skip", None):
            yield "--iterations-to-skip leaves gaps that no differential can fill"

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add one ``--diffckpt-<field>`` flag per field to ``parser`` (help from the field's
        docstring), and the retired flags, each refused in one line naming its replacement."""
        group = parser.add_argument_group("differential checkpointing (megatron-diffckpt)")
        docs = field_docs(cls)
        choices = {
            "mode": MODES,
            "when_full": WHEN_FULL,
            "compressor": COMPRESSORS,
            "keeper": KEEPER,
        }
        for f in fields(cls):
            flag, dest = flag_of(f.name), f"diffckpt_{f.name}"
            text = docs.get(f.name, "").replace("%", "%%")  # argparse formats help with %
            if f.name == "options":
                group.add_argument(
                    "--diffckpt-option",
                    dest=dest,
                    action="append",
                    metavar="NAME=VALUE",
                    help=text,
                )
            elif str(f.type) == "bool":
                group.add_argument(flag, dest=dest, action="store_true", help=text)
            else:
                kind = {"int": int, "float": float, "str": str, "str | None": str}[str(f.type)]
                group.add_argument(
                    flag,
                    dest=dest,
                    type=kind,
                    choices=choices.get(f.name),
                    help=text,
                    default=f.default if f.default is not MISSING else None,
                )
        for old, instead in RETIRED_FLAGS.items():
            group.add_argument(
                old, nargs="?", action=_Retired, instead=instead, help=argparse.SUPPRESS
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DiffCkptConfig:
        """The config of parsed flags; raises :class:`DiffCkptUsageError` (a ``ValueError``) with
        the flag's name when invalid."""
        values = {
            f.name: getattr(args, f"diffckpt_{f.name}") for f in fields(cls) if f.name != "options"
        }
        return cls(**values, options=DiffCkptOptions.parse(args.diffckpt_options))


def flag_of(name: str) -> str:
    """The command-line flag of a :class:`DiffCkptConfig` field."""
    return "--diffckpt-option" if name == "options" else f"--diffckpt-{name.replace('_', '-')}"


RETIRED_FLAGS = {
    "--diffckpt-max-pending": "--diffckpt-option max_pending=N",
    "--diffckpt-host-memory-budget": "--diffckpt-option host_memory_budget=MIB",
    "--diffckpt-retune-interval": "--diffckpt-option retune_interval=N",
    "--diffckpt-buffered-io": "--diffckpt-option buffered_io=true",
    "--diffckpt-plus-no-diff-log": "--diffckpt-option diff_log=false",
    "--diffckpt-plus-keeper-replica": "--diffckpt-keeper auto (the default; "
    "--diffckpt-option keeper_replica=true forces it)",
    "--diffckpt-plus-keeper-writes-bases": "--diffckpt-option keeper_writes_bases=true",
    "--diffckpt-keeper-no-base": "--diffckpt-option keeper_kept_bases=false",
    "--diffckpt-keeper-writes-log": "--diffckpt-keeper auto (the default; "
    "--diffckpt-option keeper_writes_log=true forces it)",
    "--diffckpt-keeper-replica": "--diffckpt-keeper auto (the default; "
    "--diffckpt-option keeper_replica=true forces it)",
    "--diffckpt-keeper-memory": "the launcher's --keeper-memory MIB (megatron-diffckpt-launch)",
    "--diffckpt-keeper-peers": "the launcher's --keeper-peers DIR (megatron-diffckpt-launch)",
}
"""Flags of earlier releases, and what replaced each."""


class _Retired(argparse.Action):
    """A retired flag: the parser stops with one line naming what replaced it."""

    def __init__(self, *args: Any, instead: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.instead = instead

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} was retired; use {self.instead}")


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
