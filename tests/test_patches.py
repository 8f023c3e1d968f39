"""MethodPatch: wrap, revert, idempotence and the drift error, on a stand-in target."""

from __future__ import annotations

import pytest

from megatron_diffckpt.patches.base import (
    TESTED_MEGATRON_CORE_VERSIONS,
    MegatronDriftError,
    MethodPatch,
    PatchSet,
)


class Target:
    def method(self, x, y=1):
        return x + y


def helper(a):
    return a


def _doubling(original):
    def method(self, x, y=1):
        return 2 * original(self, x, y)

    return method


def _patch(signature="(self, x, y=1)", requires=()):
    return MethodPatch(
        target=f"{__name__}:Target.method",
        expected_signature=signature,
        make_wrapper=_doubling,
        purpose="double the result",
        requires=requires,
    )


def test_apply_wraps_and_revert_restores():
    original = Target.method
    p = _patch()
    p.apply()
    p.apply()  # idempotent: wrapped once, not twice
    try:
        assert Target().method(1) == 4
        assert Target.method.__wrapped__ is original
    finally:
        p.revert()
    p.revert()
    assert Target.method is original
    assert Target().method(1) == 2


def test_drift_names_expected_found_and_versions():
    p = _patch(signature="(self, x)")
    with pytest.raises(MegatronDriftError) as exc:
        p.apply()
    text = str(exc.value)
    tested = ", ".join(TESTED_MEGATRON_CORE_VERSIONS)  # a plain text holds for every release
    assert f"expected signature (self, x) ({tested}), found (self, x, y=1)" in text
    assert f"{__name__}:Target.method" in text
    assert all(v in text for v in TESTED_MEGATRON_CORE_VERSIONS)
    assert not p.applied and Target().method(1) == 2


def test_drift_of_a_required_function_is_caught():
    p = _patch(requires=((f"{__name__}:helper", "(a, b)"),))
    with pytest.raises(
        MegatronDriftError, match=r"helper .*expected signature \(a, b\) \(.*0.16.1"
    ):
        p.check_drift()


def test_signatures_per_release_accept_any_and_name_each():
    assert not _patch(signature={"0.16.1": "(self, x)", "0.19.0": "(self, x, y=1)"}).check_drift()
    p = _patch(signature={"0.16.1": "(self, x)", "0.19.0": "(self, x, y=2)"})
    with pytest.raises(MegatronDriftError) as exc:
        p.check_drift()
    assert "expected signature (self, x) (0.16.1) or (self, x, y=2) (0.19.0), found" in str(
        exc.value
    )


def test_a_patch_until_a_release_does_nothing_from_that_release_on():
    gone = MethodPatch(f"{__name__}:Target.gone", "(self)", _doubling, "x", until="0.0.1")
    assert not gone.needed
    gone.check_drift()  # no target, no error: what it served is gone from the installed release
    gone.apply()
    assert not gone.applied and not hasattr(Target, "gone")
    still = MethodPatch(f"{__name__}:Target.gone", "(self)", _doubling, "x", until="999.0.0")
    assert still.needed
    with pytest.raises(MegatronDriftError, match="found <missing>"):
        still.check_drift()


def test_missing_target_is_drift():
    p = MethodPatch(f"{__name__}:Target.gone", "(self)", _doubling, "x")
    with pytest.raises(MegatronDriftError, match="found <missing>"):
        p.check_drift()


def test_patch_set_applies_nothing_when_one_member_drifted():
    good, bad = _patch(), _patch(signature="(self)")
    with pytest.raises(MegatronDriftError):
        PatchSet((good, bad)).apply()
    assert not good.applied and not bad.applied


def test_base_files_are_written_without_the_zip_crc_and_the_switch_comes_back():
    """LowDiff+ base files skip torch.save's zip CRC-32 (no loader checks it): in the writing
    thread only; torch.load reads them exactly, and the switch is restored, also when the write
    fails."""
    import io
    import threading
    import zipfile

    import torch

    from megatron_diffckpt.patches.base_checkpoint import _without_zip_crc32

    def saved(t):
        buf = io.BytesIO()
        torch.save(t, buf)
        return buf

    t = torch.randn(1000)
    elsewhere = {}

    def other_thread():
        elsewhere["buf"] = saved(t)

    assert torch.serialization.get_crc32_options()
    with _without_zip_crc32():
        buf = saved(t)
        thread = threading.Thread(target=other_thread)  # torch's switch is per thread
        thread.start()
        thread.join()
    assert torch.serialization.get_crc32_options()
    crcs = {i.filename.rsplit("/", 1)[-1]: i.CRC for i in zipfile.ZipFile(buf).infolist()}
    assert crcs["0"] == 0  # the tensor's bytes
    for with_crc in (saved(t), elsewhere["buf"]):
        assert all(i.CRC != 0 for i in zipfile.ZipFile(with_crc).infolist() if i.file_size)
    buf.seek(0)
    assert torch.equal(torch.load(buf), t)
    with pytest.raises(OSError), _without_zip_crc32():
        raise OSError("disk full")
    assert torch.serialization.get_crc32_options()


def test_the_base_file_writer_threads_save_without_the_zip_crc(monkeypatch):
    """The switch is per thread: it must be set in the threads that write the files."""
    import io
    import zipfile

    import torch

    from megatron_diffckpt.patches import base_checkpoint

    crcs = {}

    def per_file_writer(transform_list, index, bucket, results, done, use_fsync, **kw):
        buf = io.BytesIO()
        torch.save(bucket, buf)
        crcs[index] = [i.CRC for i in zipfile.ZipFile(buf).infolist() if i.file_size]
        results.put((index, [f"written {index}"]))

    monkeypatch.setattr(base_checkpoint, "_per_file_writer", lambda: per_file_writer)
    outcome, cpu = base_checkpoint.write_files(None, False, [torch.ones(8), torch.zeros(8)])
    assert outcome == {0: ["written 0"], 1: ["written 1"]} and cpu >= 0
    assert set(crcs) == {0, 1} and all(0 in c for c in crcs.values())  # the tensors' records
