"""`-t/--threads` and the default from the cores free at start (`app.threads`)."""

import argparse
import subprocess
import sys

import pytest
import torch

from localllm.app import threads


def test_others_running_reads_proc_loadavg():
    assert threads.others_running("0.50 0.40 0.30 3/190 4242") == 2
    assert threads.others_running("0.50 0.40 0.30 1/190 4242") == 0
    assert threads.others_running("garbage") is None


@pytest.mark.parametrize(
    ("running", "default", "want"), [(1, 2, 2), (2, 2, 1), (9, 2, 1), (3, 8, 6)]
)
def test_free_threads_leave_busy_cores_alone(tmp_path, monkeypatch, running, default, want):
    f = tmp_path / "loadavg"
    f.write_text(f"1.0 1.0 1.0 {running}/100 1\n")
    monkeypatch.setattr(threads, "LOADAVG", f)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 8)
    assert threads.free_threads(default) == want


def test_without_proc_loadavg_torch_default_stands(tmp_path, monkeypatch):
    monkeypatch.setattr(threads, "LOADAVG", tmp_path / "missing")
    assert threads.free_threads(5) == 5


def test_apply_threads_sets_torch():
    before = torch.get_num_threads()
    try:
        assert threads.apply_threads(argparse.Namespace(threads=1)) == 1
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="--threads must be at least 1"):
            threads.apply_threads(argparse.Namespace(threads=0))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("command", ["run", "serve", "tui", "bench", "transcribe", "tts"])
def test_every_computing_command_takes_threads(command):
    out = subprocess.run([sys.executable, "-m", "localllm.app", command, "--help"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and "--threads" in out.stdout, out.stderr


def test_run_with_zero_threads_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "localllm.app", "run", "-t", "0", "Hi"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode != 0
    assert out.stderr.strip() == "localllm: error: --threads must be at least 1", out.stderr
