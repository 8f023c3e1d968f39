"""LowDiff+'s replica as plain data over shared memory: what a rank and its node's keeper share.

A replica (the torch optimizers of one rank's shard: main parameters, Adam moments, steps) is
*described* as plain data (:func:`describe`: class, group options, per tensor a
``{"file", "shape", "dtype"}`` spec) and *built* again from that description in another
process (:func:`build`) over the same pages: files of a shared-memory folder (``/dev/shm``)
mapped shared (:func:`map_tensor`), so that writes by one process are seen by the other. A rank
creates the files (:class:`SharedArena`); :mod:`~megatron_diffckpt.keeper.replicas` is the
keeper's side, :mod:`~megatron_diffckpt.keeper.replica_client` the rank's.

A copy that another process will read back (a kept base, a copy for the next node's keeper,
a replica at rest) is *sealed*: its spec carries ``"sum"``, the :func:`checksum` of its bytes when
it was made, and the reader checks it before using the copy (:func:`damaged_file`): a copy
damaged in memory (a flipped bit in ``/dev/shm``) is refused, never loaded into training.

Any process, any thread; nothing here talks to another process.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.uint8,
    )  # fmt: skip
}
DTYPE_NAMES = frozenset(_DTYPES)
"""The dtypes a tensor spec may name."""
_OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}


def map_tensor(spec: dict[str, Any]) -> torch.Tensor:
    """The tensor a ``{"file", "shape", "dtype"}`` spec names, mapped shared (writes are seen by
    every process that maps the file)."""
    shape, dtype = tuple(spec["shape"]), _DTYPES[spec["dtype"]]
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_file(spec["file"], shared=True, size=numel, dtype=dtype).view(shape)


def create_tensor(spec: dict[str, Any]) -> torch.Tensor:
    """A new file for the tensor a ``{"file", "shape", "dtype"}`` spec names, its bytes
    allocated before it is mapped, and the mapping (zeros). Pages of a sparse file mapped shared
    on a full filesystem fault (SIGBUS) when first written; allocated up front, a full folder
    raises :class:`OSError` here instead, naming the folder and the bytes. An existing file is
    never reused (:class:`FileExistsError`)."""
    nbytes = tensor_nbytes(spec)
    fd = os.open(spec["file"], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if nbytes and hasattr(os, "posix_fallocate"):  # Linux; elsewhere mapped sparse
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.close(fd)
        os.remove(spec["file"])
        raise OSError(
            exc.errno,
            f"no room for {nbytes / 2**20:.1f} MiB in {os.path.dirname(spec['file'])} "
            f"({exc.strerror}; a container needs a larger --shm-size)",
        ) from exc
    os.close(fd)
    return map_tensor(spec)


def checksum(tensor: torch.Tensor) -> int:
    """A 64-bit checksum of ``tensor``'s bytes: the wrapped sum of them read as little-endian
    64-bit words (the last one zero-padded), computed by torch at memory speed. It detects any
    damage confined to one word (a flipped bit or byte, a torn word) and random damage with
    probability 1 - 2**-64; it is no defence against a deliberate change."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    whole = flat.numel() // 8 * 8
    total = int(flat[:whole].view(torch.int64).sum()) if whole else 0
    if whole < flat.numel():
        tail = flat[whole:].numpy().tobytes().ljust(8, b"\0")
        total += int.from_bytes(tail, "little", signed=True)
    return total & (2**64 - 1)


def seal(spec: dict[str, Any], tensor: torch.Tensor) -> dict[str, Any]:
    """``spec`` with ``"sum"``: the :func:`checksum` of ``tensor``, its tensor as made."""
    spec["sum"] = checksum(tensor)
    return spec


def damaged_file(specs: Iterable[dict[str, Any]]) -> str:
    """The file of the first sealed spec of ``specs`` whose bytes no longer have the checksum
    they were sealed with (``""``: none). Reads every sealed file once."""
    for spec in specs:
        if "sum" in spec and "file" in spec and checksum(map_tensor(spec)) != spec["sum"]:
            return spec["file"]
    return ""


class SharedArena:
    """Tensors this rank creates in files of the keeper's shared-memory folder.

    File names carry the process id and a counter of the process (shared by all its arenas),
    so a restarted rank never maps its predecessor's files and no two arenas of one process
    name the same file; the keeper removes a file when it stops using it, and the whole folder
    when it stops.
    """

    _count = itertools.count(1)

    def __init__(self, folder: str, sealed: bool = False):
        self.folder = folder
        self.sealed = sealed
        """Seal each :meth:`copy` (:func:`seal`): for copies that never change (a kept base)."""
        self.specs: dict[int, dict[str, Any]] = {}  # id(tensor) -> its spec

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        spec = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}
        while True:  # a file left by a killed process of the same id is never taken over
            spec["file"] = os.path.join(self.folder, f"{os.getpid()}-{next(self._count)}")
            try:
                tensor = create_tensor(spec)
                break
            except FileExistsError:
                continue
        self.specs[id(tensor)] = spec
        return tensor

    def copy(self, source: torch.Tensor, _name: str = "") -> torch.Tensor:
        """A shared copy of ``source`` (a replica allocator)."""
        tensor = self.empty(tuple(source.shape), source.dtype)
        tensor.copy_(source.detach())
        if self.sealed:
            seal(self.specs[id(tensor)], tensor)
        return tensor

    def spec(self, tensor: torch.Tensor) -> dict[str, Any]:
        return self.specs[id(tensor)]

    def files(self) -> list[str]:
        """Every file this arena made."""
        return [spec["file"] for spec in self.specs.values()]


def remove_files(files: Iterable[str], folder: str) -> None:
    """Remove ``files`` that lie in ``folder`` (never one outside it); missing ones are fine."""
    for path in files:
        if os.path.dirname(path) == folder:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


def describe(optimizers: list[torch.optim.Optimizer | None], spec_of: Any) -> list[Any]:
    """The replica ``optimizers`` as plain data: class, group options, and per parameter the
    spec of its tensor and of each state tensor (``spec_of(tensor)``)."""
    out: list[Any] = []
    for opt in optimizers:
        if opt is None:
            out.append(None)
            continue
        groups = []
        for group in opt.param_groups:
            options = {k: v for k, v in group.items() if k != "params"}
            params = []
            for p in group["params"]:
                state = {
                    k: {"tensor": spec_of(v)} if torch.is_tensor(v) else {"value": v}
                    for k, v in opt.state.get(p, {}).items()
                }
                params.append({"param": spec_of(p), "state": state})
            groups.append({"options": options, "params": params})
        out.append({"class": type(opt).__name__, "groups": groups})
    return out


def build(
    description: list[Any], tensor_of: Callable[[dict], torch.Tensor] | None = None
) -> list[torch.optim.Optimizer | None]:
    """The optimizers :func:`describe` described, over the tensors ``tensor_of(spec)`` gives
    (default :func:`tensor_from`: mapped files)."""
    tensor_of = tensor_of or tensor_from
    optimizers: list[torch.optim.Optimizer | None] = []
    for d in description:
        if d is None:
            optimizers.append(None)
            continue
        groups, states = [], []
        for g in d["groups"]:
            params = [tensor_of(p["param"]) for p in g["params"]]
            # JSON has no tuples: torch's own options (betas) are, and a base saves them
            options = {k: tuple(v) if isinstance(v, list) else v for k, v in g["options"].items()}
            groups.append({"params": params, **options})
            for p, spec in zip(params, g["params"], strict=True):
                states.append((p, spec["state"]))
        opt = _OPTIMIZERS[d["class"]](groups)
        for p, state in states:
            if state:
                opt.state[p] = {
                    k: tensor_of(v["tensor"]) if "tensor" in v else v["value"]
                    for k, v in state.items()
                }
        optimizers.append(opt)
    return optimizers


def specs_of(description: list[Any], slots: list[dict[str, Any]] = ()) -> Iterator[dict]:
    """Every tensor spec of ``description`` (parameters, each followed by its state tensors) and
    then of ``slots``, in one fixed order."""
    for d in description:
        for g in d["groups"] if d else []:
            for p in g["params"]:
                yield p["param"]
                yield from (v["tensor"] for v in p["state"].values() if "tensor" in v)
    for slot in slots:
        yield from slot.values()


def tensors_of(description: list[Any], optimizers: list[torch.optim.Optimizer | None]):
    """The tensors of ``optimizers`` (built from ``description``), in :func:`specs_of` order."""
    for d, opt in zip(description, optimizers, strict=True):
        if d is None:
            continue
        for g, group in zip(d["groups"], opt.param_groups, strict=True):
            for spec, p in zip(g["params"], group["params"], strict=True):
                yield p
                yield from (opt.state[p][k] for k, v in spec["state"].items() if "tensor" in v)


def files_of(description: list[Any], slots: list[dict[str, Any]]) -> set[str]:
    return {s["file"] for s in specs_of(description, slots) if "file" in s}


def nbytes_of(description: list[Any], slots: list[dict[str, Any]]) -> int:
    return sum(tensor_nbytes(s) for s in specs_of(description, slots))


def tensor_nbytes(spec: dict[str, Any]) -> int:
    """The bytes of the tensor a spec names."""
    return math.prod(spec["shape"]) * _DTYPES[spec["dtype"]].itemsize


def tensor_from(spec: dict[str, Any]) -> torch.Tensor:
    """The tensor a spec names: a mapped file (``"file"``), or else a new zero tensor."""
    if "file" in spec:
        return map_tensor(spec)
    return torch.zeros(tuple(spec["shape"]), dtype=_DTYPES[spec["dtype"]])


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A copy of ``tensor``'s bytes."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def initial_adam_state(opt: torch.optim.Optimizer, alloc: Any) -> None:
    """Give each parameter without state (no step yet) the state torch Adam's first step would
    create, made by ``alloc(tensor)``: in shared memory, the keeper's steps update it in place
    where the rank and a recovery see it (a state Adam created lazily would be the keeper's)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if opt.state.get(p):
                continue
            names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
            state = {"step": alloc(torch.tensor(0.0, dtype=torch.float32))}
            state.update({n: alloc(torch.zeros_like(p)) for n in names})
            opt.state[p] = state
