"""The CLI's front door, run as a user runs it (a real `python -m localllm.app` process): `--help`
never imports torch, and every usage error is one `localllm: error:` line that names the flag."""

import socket
import subprocess
import sys

import pytest

COMMANDS = (
    "run", "serve", "pull", "ls", "rm", "bench", "tui", "transcribe", "tts", "doctor",
    "completion",
)  # fmt: skip


def _cli(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "localllm.app", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def _imported(importtime: str) -> set[str]:
    """Module names from `python -X importtime` output (`import time: self | cum | name`)."""
    names = set()
    for line in importtime.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


@pytest.mark.parametrize("argv", [["--help"], *([c, "--help"] for c in COMMANDS)], ids=" ".join)
def test_help_does_not_import_torch(argv):
    cmd = [sys.executable, "-X", "importtime", "-m", "localllm.app", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: localllm"), proc.stdout
    modules = _imported(proc.stderr)
    assert "localllm.app.cli" in modules  # the importtime output was read
    heavy = sorted(modules & {"torch", "numpy", "triton", "fastapi", "textual", "gguf"})
    assert heavy == [], f"`localllm {' '.join(argv)}` imported {heavy}"


def _one_error_line(proc: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("localllm: error: "), line
    for n in needles:
        assert n in line, (n, line)
    return line


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--bogus"], ["unrecognized arguments: --bogus", "localllm --help"]),
        (["run", "--bogus", "hi"], ["unrecognized arguments: --bogus", "localllm run --help"]),
        (["serve", "--port", "many"], ["--port", "invalid int value: 'many'"]),
        (["run", "-n", "x", "hi"], ["-n/--max-tokens", "invalid int value: 'x'"]),
        (["run", "--cache-type", "q2"], ["--cache-type", "invalid choice: 'q2'"]),
        (["pull"], ["required: model", "localllm pull --help"]),
        (["frobnicate"], ["unknown command", "frobnicate", "choose from"]),
        (["completion", "tcsh"], ["invalid choice: 'tcsh'"]),
    ],
)
def test_usage_error_is_one_line(argv, needles):
    _one_error_line(_cli(*argv), 2, *needles)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["run", "-n", "-5", "hi"], "-n/--max-tokens must be >= 1, got -5"),
        (["run", "-c", "0", "hi"], "-c/--ctx-size must be >= 2"),
        (["run", "--temp", "-1", "hi"], "--temperature/--temp must be >= 0"),
        (["run", "--top-p", "0", "hi"], "--top-p must be in (0, 1]"),
    ],
)
def test_engine_limit_names_the_flag(smollm2_path, argv, needle):
    line = _one_error_line(_cli(*argv), 1, needle)
    for internal in ("max_tokens", "max_model_len", "temperature ", "top_p"):
        assert internal not in line, line


def test_serve_limit_names_the_flag(smollm2_path):
    with socket.socket() as s:  # a free port, in case the bound check were missing
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _cli("serve", "-c", "0", "--port", str(port), timeout=180)
    _one_error_line(proc, 1, "-c/--ctx-size must be >= 2")


def test_bad_regex_is_one_line(smollm2_path):
    proc = _cli("run", "--regex", "(", "-n", "4", "hi")
    line = _one_error_line(proc, 1, "regex", "unclosed group")
    assert "^" not in line and " | " not in line, line  # llguidance's source excerpt left out


def test_version_matches_the_installed_distribution():
    from importlib.metadata import version

    proc = _cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"localllm {version('localllm')}\n"
