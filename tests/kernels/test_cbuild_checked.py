"""`cbuild.checked`: a native library's self-check runs once per built file (its verdict kept
beside the library), not in every process that loads it; a failed check is remembered too."""

import pytest

from localllm.kernels.cpu import block_linear, cbuild


def test_self_check_runs_once_per_built_library(tmp_path, monkeypatch):
    if cbuild.compiler() is None:
        pytest.skip("no C compiler")
    calls = []
    real = block_linear.self_check

    def counting(k, seed=0):
        calls.append(k.path)
        return real(k, seed)

    monkeypatch.setattr(block_linear, "self_check", counting)
    first = block_linear.load(tmp_path)
    assert first is not None and len(calls) == 1
    assert first.path.with_suffix(".ok").exists()
    second = block_linear.load(tmp_path)  # a later process: loads, checks nothing
    assert second is not None and second.path == first.path and len(calls) == 1


def test_failed_verdict_is_kept(tmp_path):
    lib = tmp_path / "x-0123.so"
    lib.write_bytes(b"")
    assert cbuild.checked(lib, lambda: False) is False
    assert (tmp_path / "x-0123.bad").exists()
    assert cbuild.checked(lib, lambda: pytest.fail("checked again")) is False
