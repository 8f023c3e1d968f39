"""LowDiff+'s base files written by the node's keeper: a request carries the plan's tensors
staged in shared memory (whole storages, buffers reused) by reference, small ones by value, and
nothing a keeper should not run; a real keeper process writes files byte for byte as the rank's
own writer does (megatron's per-file writer), with the same write results, in a writer process
that keeps its mappings and ends with the rank's connection; a rank whose keeper is gone writes
them itself; a keeper forgets (removes) the files of a rank's earlier set."""

from __future__ import annotations

import io
import os
import pickle
import signal
import time

import psutil
import pytest
import torch
from launch import run_cli
from test_keeper import ME, start_keeper

from megatron_diffckpt.keeper.client import KeeperClient, query, stop
from megatron_diffckpt.keeper.writes import HandedWrites, Mappings, StagingArea, dumps, loads
from megatron_diffckpt.patches import base_checkpoint


def _plan_item(fqn: str, tensor: torch.Tensor):
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    chunk = ChunkStorageMetadata(offsets=torch.Size([0] * tensor.dim()), sizes=tensor.shape)
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size([0] * tensor.dim())),
        type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=chunk, properties=TensorProperties(dtype=tensor.dtype), size=tensor.shape
        ),
    )


def _bytes_item(fqn: str):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)


def _write_buckets(folder: str, tensors: dict[str, torch.Tensor]) -> list:
    """Two files as megatron's planner lays them out: (path, key, (bytes, tensors))."""
    names = sorted(tensors)
    buckets = []
    for index, part in enumerate((names[::2], names[1::2])):
        key = f"__0_{index}.distcp"
        data = [(_bytes_item(f"common{index}"), io.BytesIO(b"common state %d" % index))]
        items = [(_plan_item(n, tensors[n]), tensors[n]) for n in part]
        buckets.append((os.path.join(folder, key), key, (data, items)))
    return buckets


def _transforms() -> list:
    from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms

    return [_StorageWriterTransforms()]


def _tensors() -> dict[str, torch.Tensor]:
    """What a plan holds: large tensors (staged; one a view of its whole storage, as megatron
    leaves them: it clones narrower views), small ones (sent by value)."""
    torch.manual_seed(0)
    large = {f"large.{i}": torch.randn(128, 257) for i in range(3)}
    narrow = {"transposed": torch.randn(512, 100).t()}
    small = {
        "small.step": torch.tensor(7.0),
        "small.0": torch.randn(5, 2),
        "small.int": torch.arange(9),
    }
    return {**large, **narrow, **small}


def test_a_request_carries_staged_tensors_by_reference_and_small_ones_by_value(tmp_path):
    staging = StagingArea(str(tmp_path))
    (tmp_path / "narrow").mkdir()
    base = torch.arange(64 * 1024, dtype=torch.float32)
    view = base[4 : 4 + 255 * 256].view(255, 256)[:, 3:203]  # an offset, strides: not contiguous
    small = torch.randn(3, 3)
    payload, staged, sent = dumps(([view, small], io.BytesIO(b"x")), staging)
    assert staged == view.numel() * 4 and sent == small.numel() * 4
    assert len(payload) < 1024 < view.numel() * 4  # the staged tensor's bytes did not travel
    (got_view, got_small), got_bytes = loads(payload, str(tmp_path))
    assert torch.equal(got_view, view) and torch.equal(got_small, small)
    # its whole storage, offset and strides kept: torch.save writes the same bytes
    assert (got_view.stride(), got_view.storage_offset()) == (view.stride(), view.storage_offset())
    assert _saved(got_view) == _saved(view)
    assert got_bytes.getvalue() == b"x"
    # a narrow view of a large storage: staged as a contiguous copy, not its whole storage
    narrow = torch.randn(1024, 1024)[10:90]
    payload, staged, _ = dumps((narrow,), StagingArea(str(tmp_path / "narrow")))
    (got_narrow,) = loads(payload, str(tmp_path / "narrow"))
    assert torch.equal(got_narrow, narrow) and staged == narrow.numel() * 4
    assert got_narrow.untyped_storage().nbytes() == narrow.numel() * 4
    # the next round reuses the buffers: same files, nothing new in the folder
    files = sorted(os.listdir(tmp_path))  # the view's buffer, and the folder above
    base.add_(1)
    again, _, _ = dumps(([view, small], io.BytesIO(b"x")), staging)
    assert sorted(os.listdir(tmp_path)) == files
    assert torch.equal(loads(again, str(tmp_path))[0][0], view)


def _saved(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


class _Evil:
    def __reduce__(self):
        return (os.system, ("true",))


@pytest.mark.parametrize(
    "payload, why",
    [
        (pickle.dumps(_Evil()), "may not name posix.system"),
        (pickle.dumps(torch.load), "may not name torch.serialization.load"),
        (b"ctorch\nload\n.", "may not name torch.load"),  # torch.load by torch's name
        (pickle.dumps(pickle.loads), "may not name _pickle.loads"),
        (b"ctorch.distributed.checkpoint\nload\n.", "may not name torch.distributed"),
    ],
    ids=["os.system", "torch.load", "torch:load", "pickle.loads", "dcp.load"],
)
def test_a_request_naming_anything_but_a_write_plan_is_refused(tmp_path, payload, why):
    with pytest.raises(pickle.UnpicklingError, match=why):
        loads(payload, str(tmp_path))


def test_a_request_mapping_a_file_outside_the_keepers_folder_is_refused(tmp_path):
    payload, _, _ = dumps((torch.ones(64 * 1024),), StagingArea(str(tmp_path)))
    (tmp_path / "keeper").mkdir()
    with pytest.raises(pickle.UnpicklingError, match="is not in the keeper's folder"):
        loads(payload, str(tmp_path / "keeper"))


def _writer_processes(keeper: int) -> list[psutil.Process]:
    """The keeper's live writer processes (spawned; its multiprocessing resource tracker aside,
    and a dead one the keeper has not reaped yet)."""
    alive = []
    for child in psutil.Process(keeper).children():
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                alive.append(child)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            pass
    return alive


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_the_keeper_writes_a_bases_files_as_the_ranks_own_writer_does(tmp_path):
    """Same bytes in every file, same write results; the shared tensors were not sent; the
    keeper removes a rank's earlier set of files that a later request no longer names."""
    sock = str(tmp_path / "keeper.sock")
    proc = start_keeper(sock)
    try:
        client = KeeperClient(sock, ME)
        staging = StagingArea(client.shm_folder())
        tensors = _tensors()
        here, there = tmp_path / "here", tmp_path / "there"
        here.mkdir(), there.mkdir()
        expected = base_checkpoint.write_files(
            _transforms(), False, _write_buckets(str(here), tensors)
        )[0]
        handed = HandedWrites(client.sibling(timeout=None), staging)
        outcome, cpu = handed(
            base_checkpoint.write_files, _transforms(), False, _write_buckets(str(there), tensors)
        )
        assert handed.last_in_keeper and handed.in_keeper == 1 and handed.here == 0
        assert handed.last["staged_bytes"] == (3 * 128 * 257 + 100 * 512) * 4
        assert handed.last["sent_bytes"] == 4 + 5 * 2 * 4 + 9 * 8  # the small ones
        assert outcome == expected and cpu > 0
        assert _files(there) == _files(here) and len(_files(here)) == 2
        _assert_readable(there, outcome, tensors)
        (row,) = query(sock)["writes"]
        assert row["writes"] == 1 and row["dp_rank"] == ME.dp_rank
        shown = run_cli("inspect", str(tmp_path), "--keeper", sock).stdout
        assert "rank_0_0_1: 1 base(s) written here, the last in " in shown, shown
        # the rank's writer process ends with its connection (the rank's end) ...
        assert len(_writer_processes(proc.pid)) == 1
        handed.client.close()
        deadline = time.monotonic() + 30
        while _writer_processes(proc.pid):
            assert time.monotonic() < deadline, "the writer process outlived its connection"
            time.sleep(0.05)
        # ... and a restarted rank's (another set of files: the earlier one is freed) gets a
        # new one, started at once and ready when its first base comes
        first = set(staging.files())
        later = StagingArea(staging.folder)
        again = HandedWrites(client.sibling(timeout=None), later, warm=base_checkpoint.write_files)
        assert len(_writer_processes(proc.pid)) == 1
        again(base_checkpoint.write_files, _transforms(), False, [])
        assert again.last_in_keeper and not any(os.path.exists(f) for f in first)
        again.close()
        assert os.listdir(staging.folder) == []
        client.close()
    finally:
        stop(sock)
        proc.wait(30)


def test_a_rank_whose_keeper_is_gone_writes_its_base_files_itself(tmp_path, caplog):
    sock = str(tmp_path / "keeper.sock")
    proc = start_keeper(sock)
    client = KeeperClient(sock, ME)
    tensors = _tensors()
    handed = HandedWrites(client.sibling(timeout=None), StagingArea(client.shm_folder()))
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    (tmp_path / "here").mkdir()
    outcome, _ = handed(
        base_checkpoint.write_files,
        _transforms(),
        False,
        _write_buckets(str(tmp_path / "here"), tensors),
    )
    assert set(outcome) == {0, 1} and len(_files(tmp_path / "here")) == 2
    assert not handed.last_in_keeper and handed.here == 1
    assert "this rank writes its base's files itself (" in caplog.text
    _assert_readable(tmp_path / "here", outcome, tensors)


def _assert_readable(folder, outcome: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Every tensor reads back from where its write result says it is."""
    found = 0
    for results in outcome.values():
        for result in results:
            info = result.storage_data
            raw = (folder / info.relative_path).read_bytes()[
                info.offset : info.offset + info.length
            ]
            if result.index.fqn in tensors:
                got = torch.load(io.BytesIO(raw), weights_only=True)
                assert torch.equal(got, tensors[result.index.fqn]), result.index.fqn
                found += 1
    assert found == len(tensors)


def test_a_writer_process_keeps_its_mappings_until_a_file_is_replaced_or_not_named(tmp_path):
    staging = StagingArea(str(tmp_path))
    kept, dropped = torch.ones(64 * 1024), torch.zeros(32 * 1024)
    mapped = Mappings()
    both, _, _ = dumps((kept, dropped), staging)
    first_kept, _ = loads(both, str(tmp_path), mapped)
    again, _, _ = dumps((kept,), staging)
    (second_kept,) = loads(again, str(tmp_path), mapped)
    assert second_kept.untyped_storage().data_ptr() == first_kept.untyped_storage().data_ptr()
    assert len(mapped._maps) == 1  # the file the second request did not name is let go
    # the staging file replaced by another (a new inode under the same name): mapped anew
    (file,) = [f for f in staging.files() if os.path.getsize(f) == kept.numel() * 4]
    os.remove(file)
    torch.full((64 * 1024,), 7.0).numpy().tofile(file)
    (third_kept,) = loads(again, str(tmp_path), mapped)
    assert torch.equal(third_kept, torch.full((64 * 1024,), 7.0))
    assert torch.equal(first_kept, torch.ones(64 * 1024))  # the old mapping keeps the old pages
