"""Where each optimizer parameter of a rank lives in a base: what an offline merge needs.

A differential names a torch-optimizer parameter by its position (inner optimizer, group, index).
A base names tensors by megatron's sharded-state-dict keys. The shard map, written once per run
and rank as ``DIFF_DIR/rank_T_P_D/shard_map.json`` (plain JSON, published atomically), joins the
two: for every optimizer parameter, the slice of the base's flat optimizer tensors that holds its
main parameter and Adam moments (the distributed optimizer's ``dp_reshardable`` buckets), and the
slice of the model tensor it is a shard of. With it, ``megatron-diffckpt merge``
(:mod:`megatron_diffckpt.offline_merge`) replays differentials into a base without building a model
or importing megatron.

It is built from what megatron itself saves: the rank's sharded state dict, matched to the
optimizer's tensors by storage, so the keys and offsets are exactly those of the rank's bases.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from megatron_diffckpt.durable_io import publish_file
from megatron_diffckpt.errors import DiffCkptError
from megatron_diffckpt.out_of_space import FULL_ERRNOS, StorageFullError

logger = logging.getLogger(__name__)

SHARD_MAP_FILE = "shard_map.json"
SHARD_MAP_FORMAT = "megatron-diffckpt-shard-map-v1"
# The Adam moments sit beside the main parameter in the distributed optimizer's buckets:
# ``<bucket key>.param``, ``<bucket key>.exp_avg``, ``<bucket key>.exp_avg_sq``.
MAIN_SUFFIX = ".param"
STATE_NAMES = ("exp_avg", "exp_avg_sq")


class ShardMapError(DiffCkptError, ValueError):
    """A shard map cannot be built for this optimizer, or a file is not a valid shard map."""


@dataclass(frozen=True)
class MainParamSource:
    """Which model parameter a main (optimizer) parameter is a shard of: the flat range
    ``[start, end)`` of ``model_param.view(-1)``."""

    model_param: torch.Tensor
    start: int
    end: int


@dataclass(frozen=True)
class TensorSlice:
    """A rank's local tensor inside a global checkpoint tensor (megatron's ``ShardedTensor``):
    ``global[offset[:prepend]] [offset[i] : offset[i] + local_shape[i]] ...``. ``replica_id``
    is megatron's; the data-parallel rank is its last component."""

    key: str
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    prepend_axis_num: int
    replica_id: tuple[int, ...]

    def saved_by_data_parallel_ranks(self) -> bool:
        """Whether megatron saves this slice from this rank's data-parallel group (the main
        replica but for the data-parallel component): the copies a tied or tensor-parallel
        duplicate holds are not written."""
        return all(r == 0 for r in self.replica_id[:-1])

    def index(self) -> tuple[Any, ...]:
        """The index of the local tensor in the global one."""
        p = self.prepend_axis_num
        head = tuple(self.global_offset[:p])
        tail = tuple(
            slice(o, o + s) for o, s in zip(self.global_offset[p:], self.local_shape, strict=True)
        )
        return head + tail


@dataclass(frozen=True)
class ParamEntry:
    """One torch-optimizer parameter: its numel, where its main value and moments are in the
    base (``main_key[main_offset : main_offset + numel]``, likewise for each name in
    :data:`STATE_NAMES`), and the model tensors it is the flat range ``model_range`` of."""

    numel: int
    main_key: str
    main_offset: int
    model: tuple[TensorSlice, ...]
    model_range: tuple[int, int]
    model_dtype: str

    def state_key(self, name: str) -> str:
        return self.main_key[: -len(MAIN_SUFFIX)] + "." + name


@dataclass(frozen=True)
class InnerEntry:
    """One inner optimizer: its torch class, the key of its param-groups object in the base,
    and ``groups[g][i]``, the :class:`ParamEntry` of each parameter."""

    optimizer_class: str
    param_groups_key: str
    groups: tuple[tuple[ParamEntry, ...], ...]


@dataclass(frozen=True)
class ShardMap:
    """A rank's shard map. ``inner[i]`` is ``None`` for a stub (parameter-less) optimizer;
    ``parallel`` is ``(tp, pp, dp)`` sizes; ``layout_hash`` is the diff log's identity field."""

    layout_hash: str
    rank: tuple[int, int, int]
    parallel: tuple[int, int, int]
    inner: tuple[InnerEntry | None, ...]

    def to_json(self) -> str:
        return json.dumps({"format": SHARD_MAP_FORMAT, **asdict(self)}, indent=1)

    @staticmethod
    def from_json(text: str) -> ShardMap:
        try:
            raw = json.loads(text)
            if raw.get("format") != SHARD_MAP_FORMAT:
                raise ShardMapError(f"not a shard map (format {raw.get('format')!r})")
            inner = tuple(
                None
                if i is None
                else InnerEntry(
                    i["optimizer_class"],
                    i["param_groups_key"],
                    tuple(tuple(_param_entry(p) for p in g) for g in i["groups"]),
                )
                for i in raw["inner"]
            )
            return ShardMap(raw["layout_hash"], tuple(raw["rank"]), tuple(raw["parallel"]), inner)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ShardMapError):
                raise
            raise ShardMapError(f"malformed shard map: {e!r}") from e


def _param_entry(raw: dict) -> ParamEntry:
    return ParamEntry(
        int(raw["numel"]),
        str(raw["main_key"]),
        int(raw["main_offset"]),
        tuple(
            TensorSlice(
                str(m["key"]),
                tuple(m["global_offset"]),
                tuple(m["local_shape"]),
                int(m["prepend_axis_num"]),
                tuple(m["replica_id"]),
            )
            for m in raw["model"]
        ),
        tuple(raw["model_range"]),
        str(raw["model_dtype"]),
    )


def _walk(tree: Any) -> Iterator[Any]:
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _walk(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _walk(value)
    else:
        yield tree


def _is_sharded_tensor(x: Any) -> bool:
    return all(hasattr(x, a) for a in ("key", "data", "global_offset", "local_shape"))


def _replica_id(sharded: Any) -> tuple[int, ...]:
    r = getattr(sharded, "replica_id", 0)
    return tuple(int(x) for x in r) if isinstance(r, (tuple, list)) else (int(r),)


def _tensors_by_storage(tree: Any) -> dict[tuple[int, int], list[Any]]:
    out: dict[tuple[int, int], list[Any]] = {}
    for x in _walk(tree):
        if _is_sharded_tensor(x) and torch.is_tensor(x.data):
            if getattr(x, "flattened_range", None) is not None:
                raise ShardMapError(
                    f"{x.key} is saved with a flattened range; the shard map needs whole local "
                    "tensors (the distributed optimizer's dp_reshardable format)"
                )
            out.setdefault(_storage_key(x.data), []).append(x)
    return out


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    return (t.data_ptr(), t.numel())


def build_shard_map(
    sharded_state_dict: dict,
    torch_optimizers: list[torch.optim.Optimizer | None],
    sources: list[list[list[MainParamSource]] | None],
    layout_hash: str,
    rank: tuple[int, int, int],
    parallel: tuple[int, int, int],
) -> ShardMap:
    """The shard map of one rank. Any rank; reads tensors' storage, copies nothing.

    Args:
        sharded_state_dict: what the rank saves in a base (``{"model": ..., "optimizer": ...}``
            of megatron ``ShardedTensor``/``ShardedObject``), built from the live training state.
        torch_optimizers: each inner optimizer's torch optimizer (``None`` for a stub).
        sources: ``sources[i][g][k]``, the model parameter of each main parameter.

    Each inner optimizer's param groups (hyper-parameters, step) are the sharded objects whose
    data holds ``param_groups``, in the order megatron lists the inner optimizers.
    """
    # A main parameter may share storage with its model parameter (fp32 training): look main
    # parameters up among the optimizer's tensors only, model parameters among the rest.
    optimizer_part = sharded_state_dict.get("optimizer", {})
    model_part = {k: v for k, v in sharded_state_dict.items() if k != "optimizer"}
    mains_by_storage = _tensors_by_storage(optimizer_part)
    models_by_storage = _tensors_by_storage(model_part)
    groups_keys = [
        x.unique_key
        for x in _walk(optimizer_part)
        if not _is_sharded_tensor(x)
        and isinstance(getattr(x, "data", None), dict)
        and "param_groups" in x.data
        and hasattr(x, "unique_key")
    ]
    live = sum(1 for t in torch_optimizers if t is not None)
    if len(groups_keys) != live:
        raise ShardMapError(
            f"expected the param groups of {live} inner optimizer(s) in the sharded state dict, "
            f"found {len(groups_keys)}"
        )
    keys = iter(groups_keys)
    inner_entries: list[InnerEntry | None] = []
    for torch_opt, inner_sources in zip(torch_optimizers, sources, strict=True):
        if torch_opt is None or inner_sources is None:
            inner_entries.append(None)
            continue
        groups = []
        for group, group_sources in zip(torch_opt.param_groups, inner_sources, strict=True):
            entries = []
            for p, src in zip(group["params"], group_sources, strict=True):
                mains = [
                    s
                    for s in mains_by_storage.get(_storage_key(p), [])
                    if s.key.endswith(MAIN_SUFFIX) and len(s.global_offset) == 1
                ]
                if len(mains) != 1:
                    raise ShardMapError(
                        f"expected one flat '*{MAIN_SUFFIX}' optimizer tensor holding a main "
                        f"parameter of {p.numel()} elements, found {len(mains)}: the shard map "
                        "supports the distributed optimizer saved as dp_reshardable"
                    )
                models = models_by_storage.get(_storage_key(src.model_param), [])
                if not models:
                    raise ShardMapError(
                        f"no model tensor of the sharded state dict holds the parameter of shape "
                        f"{tuple(src.model_param.shape)}"
                    )
                entries.append(
                    ParamEntry(
                        numel=p.numel(),
                        main_key=mains[0].key,
                        main_offset=int(mains[0].global_offset[0]),
                        model=tuple(
                            TensorSlice(
                                m.key,
                                tuple(int(o) for o in m.global_offset),
                                tuple(int(s) for s in m.local_shape),
                                int(getattr(m, "prepend_axis_num", 0)),
                                _replica_id(m),
                            )
                            for m in models
                        ),
                        model_range=(src.start, src.end),
                        model_dtype=str(src.model_param.dtype).removeprefix("torch."),
                    )
                )
            groups.append(tuple(entries))
        inner_entries.append(InnerEntry(type(torch_opt).__name__, next(keys), tuple(groups)))
    return ShardMap(layout_hash, rank, parallel, tuple(inner_entries))


def write_shard_map(rank_dir: str, shard_map: ShardMap) -> bool:
    """Publish ``shard_map`` in ``rank_dir`` unless the same map is there. Any rank (its own
    folder). Returns whether it wrote; durable on return."""
    path = os.path.join(rank_dir, SHARD_MAP_FILE)
    text = shard_map.to_json()
    try:
        with open(path) as f:
            if f.read() == text:
                return False
    except OSError:
        pass
    os.makedirs(rank_dir, exist_ok=True)
    publish_file(path, lambda f: f.write(text.encode()))
    return True


class ShardMapRecorder:
    """Writes a rank's shard map once, when training has built it, and follows
    ``--diffckpt-when-full`` when there is no room (``block``: raise; ``skip``: one warning,
    tried again at the next call). Any rank (its own folder)."""

    def __init__(self, rank_dir: str, when_full: str):
        self.rank_dir = rank_dir
        self.when_full = when_full
        self.done = False
        self._full_warned = False

    def record(self, build: Callable[[], ShardMap]) -> None:
        """Build the map (``build``) and publish it; durable on return unless it found no room."""
        self.done = True
        try:
            shard_map = build()
        except (ValueError, ShardMapError) as e:
            logger.info("no shard map, `megatron-diffckpt merge` will not merge this run: %s", e)
            return
        try:
            if write_shard_map(self.rank_dir, shard_map):
                logger.debug("wrote the shard map of %s", os.path.basename(self.rank_dir))
        except OSError as exc:
            if exc.errno not in FULL_ERRNOS:
                raise
            if self.when_full != "skip":
                raise StorageFullError(
                    f"the shard map of {self.rank_dir} cannot be written ({exc.strerror}): free "
                    "space and restart with --load, or run with --diffckpt-when-full skip"
                ) from exc
            self.done = False  # tried again after the next iteration
            if not self._full_warned:
                self._full_warned = True
                logger.warning(
                    "%s: no room for the shard map (%s); `megatron-diffckpt merge` needs it, "
                    "it is written once there is space (--diffckpt-when-full skip)",
                    self.rank_dir,
                    exc.strerror,
                )


def read_shard_map(rank_dir: str) -> ShardMap:
    """The shard map of ``rank_dir``. Raises :class:`ShardMapError` when it is missing or bad."""
    path = os.path.join(rank_dir, SHARD_MAP_FILE)
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ShardMapError(f"{path}: {e.strerror or e}") from e
    return ShardMap.from_json(text)
