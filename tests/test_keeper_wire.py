"""The keeper's messages whose tensors travel as files: a payload of bytes, hard-linked files
and copies goes over a real socket and lands, bit for bit, in new files of the receiver's
folder; what either side made is removed when released (and on a broken stream); a linked file
outlives its holder removing it; a tensor that is not where the header says is refused."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch

from megatron_diffckpt.keeper.wire import Parts, receive, recv_header, send, span
from megatron_diffckpt.shared_replica import SharedArena, map_tensor


def _folders(tmp_path):
    out, into = tmp_path / "out", tmp_path / "in"
    out.mkdir()
    into.mkdir()
    return str(out), str(into)


def _exchange(parts: Parts, header: dict, into: str):
    """``header`` and ``parts`` sent over a socket pair (a thread sends); what was received."""
    a, b = socket.socketpair()
    sender = threading.Thread(target=send, args=(a, header, parts))
    sender.start()
    got, n = recv_header(b)
    received = receive(b, n, got, into)
    sender.join()
    a.close()
    b.close()
    return got, received


def test_bytes_links_and_copies_arrive_in_files_bit_for_bit(tmp_path):
    out, into = _folders(tmp_path)
    arena = SharedArena(out)
    kept = arena.copy(torch.randn(1000))  # a kept base's file: linked, never copied
    changing = torch.randn(7, 3).to(torch.bfloat16)  # a replica's tensor: copied as it is now
    step = torch.tensor(5.0)  # a 0-d Adam step
    parts = Parts(out)
    header = {
        "head": parts.add(b"counters"),
        "linked": parts.link(arena.spec(kept)),
        "nested": [{"tensor": parts.copy(changing)}, {"step": parts.copy(step)}],
        "empty": parts.copy(torch.empty(0)),
        "tail": parts.add(b"rng states"),
    }
    expected_changing = changing.clone()
    changing.add_(1)  # the copy was taken when the message was made
    got, received = _exchange(parts, header, into)

    assert bytes(span(received, *got["head"])) == b"counters"
    assert bytes(span(received, *got["tail"])) == b"rng states"
    assert torch.equal(map_tensor(got["linked"]), kept)
    assert torch.equal(map_tensor(got["nested"][0]["tensor"]), expected_changing)
    assert torch.equal(map_tensor(got["nested"][1]["step"]), step)
    assert map_tensor(got["empty"]).numel() == 0
    files = {got["linked"]["file"], got["nested"][0]["tensor"]["file"], got["empty"]["file"]}
    assert all(os.path.dirname(f) == into for f in files) and "offset" not in got["linked"]
    with pytest.raises(ValueError, match="not plain bytes"):
        span(received, got["head"][0], 100)  # runs into the linked tensor

    # The sender's links and copies go with release; the kept base's own file stays.
    assert len(os.listdir(out)) == 1 + 4  # the kept file, one link, three copies
    parts.release()
    assert os.listdir(out) == [os.path.basename(arena.spec(kept)["file"])]
    # The receiver keeps what a holder claimed, and removes the rest.
    received.claim({got["linked"]["file"]})
    received.release()
    assert os.listdir(into) == [os.path.basename(got["linked"]["file"])]


def test_a_payload_handed_to_its_own_keeper_is_what_a_peer_would_receive(tmp_path):
    """:meth:`Parts.received` (a keeper serving its own copy of a replica to a rank that moved
    to its node): the header's tensors keep their files, now the result's, the other items
    (bytes, a snapshot bucket's copy, which no spec describes) become plain bytes."""
    out, _ = _folders(tmp_path)
    arena = SharedArena(out)
    kept = arena.copy(torch.randn(100))
    bucket = torch.randn(64)
    parts = Parts(out)
    header = {
        "head": parts.add(b"counters"),
        "linked": parts.link(arena.spec(kept)),
        "nested": [{"tensor": parts.copy(torch.arange(6.0).view(2, 3))}],
        "empty": parts.copy(torch.empty(0)),
        "bucket": parts.copy(bucket)["offset"],  # a span, as a held iteration's buckets are
    }
    received = parts.received(header)
    parts.release()  # what it still had: nothing the result names
    assert bytes(span(received, *header["head"])) == b"counters"
    assert torch.equal(map_tensor(header["linked"]), kept)
    assert torch.equal(map_tensor(header["nested"][0]["tensor"]), torch.arange(6.0).view(2, 3))
    assert map_tensor(header["empty"]).numel() == 0
    got = torch.frombuffer(bytearray(span(received, header["bucket"], 256)), dtype=torch.float32)
    assert torch.equal(got, bucket)
    assert "offset" not in header["linked"] and "offset" not in header["nested"][0]["tensor"]
    named = {
        header["linked"]["file"],
        header["nested"][0]["tensor"]["file"],
        header["empty"]["file"],
    }
    assert received.files == named and all(os.path.exists(f) for f in named)
    received.release()
    assert os.listdir(out) == [os.path.basename(arena.spec(kept)["file"])]


def test_a_linked_file_outlives_its_holder_removing_it(tmp_path):
    """A base the keeper drops while its copy waits to be sent still goes whole."""
    out, into = _folders(tmp_path)
    arena = SharedArena(out)
    kept = arena.copy(torch.arange(4096, dtype=torch.float32))
    parts = Parts(out)
    header = {"t": parts.link(arena.spec(kept))}
    os.remove(arena.spec(kept)["file"])
    got, received = _exchange(parts, header, into)
    assert torch.equal(map_tensor(got["t"]), torch.arange(4096, dtype=torch.float32))
    parts.release()
    received.release()
    assert os.listdir(out) == [] and os.listdir(into) == []


def test_a_stream_broken_mid_tensor_leaves_no_file(tmp_path):
    """The sender dies halfway through a tensor: the receiver raises and removes the files it
    made (the whole first tensor, the partial second one)."""
    _, into = _folders(tmp_path)
    header = {
        "a": {"shape": [256], "dtype": "float32", "offset": 0},
        "b": {"shape": [256], "dtype": "float32", "offset": 1024},
    }
    a, b = socket.socketpair()
    a.sendall(torch.randn(256 + 100).numpy().tobytes())  # 1024 + 400 of 2048 bytes
    a.close()
    with pytest.raises(ConnectionError):
        receive(b, 2048, header, into)
    assert os.listdir(into) == []


@pytest.mark.parametrize(
    "specs, n",
    [
        ({"a": {"shape": [4], "dtype": "float32", "offset": 8}}, 16),  # past the end
        (
            [
                {"shape": [4], "dtype": "float32", "offset": 0},
                {"shape": [4], "dtype": "float32", "offset": 8},  # overlaps the first
            ],
            32,
        ),
    ],
)
def test_a_header_whose_tensors_do_not_fit_its_payload_is_refused(tmp_path, specs, n):
    _, into = _folders(tmp_path)
    a, b = socket.socketpair()
    a.sendall(bytes(n))
    with pytest.raises(ValueError, match="a tensor at bytes"):
        receive(b, n, {"specs": specs}, into)
    assert os.listdir(into) == []
    a.close()
    b.close()


def test_every_request_the_package_sends_or_serves_is_named_by_the_protocol():
    """No request name is a bare string: each ``{"op": ...}``, ``op == ...`` and ``op=...`` in
    the package uses :class:`~megatron_diffckpt.keeper.protocol.Op`."""
    import ast
    from pathlib import Path

    from megatron_diffckpt.keeper.protocol import Op

    bare = []
    for path in (Path(__file__).parent.parent / "megatron_diffckpt").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict):
                pairs = zip(node.keys, node.values, strict=True)
                bare += [
                    f"{path.name}:{v.lineno}"
                    for k, v in pairs
                    if isinstance(k, ast.Constant) and k.value == "op"
                    if isinstance(v, ast.Constant) and v.value in set(Op)
                ]
            elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Name):
                if node.left.id == "op":
                    bare += [
                        f"{path.name}:{c.lineno}"
                        for c in node.comparators
                        if isinstance(c, ast.Constant) and c.value in set(Op)
                    ]
    assert not bare, bare
    assert len(set(Op)) == len(Op) and all(op.value == op.name.lower() for op in Op)
