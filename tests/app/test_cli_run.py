"""`localllm run` on the embedded default model, end to end through the real CLI entry point."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "goldens" / "smollm2.json"

pytestmark = pytest.mark.slow


def _run(*args, stdin=None):
    cmd = [sys.executable, "-m", "localllm.app", "run", *args]
    return subprocess.run(cmd, capture_output=True, text=True, input=stdin, timeout=600)


@pytest.fixture(scope="module")
def chat_golden(smollm2_path):
    prompts = json.loads(GOLDEN.read_text())["greedy"]["prompts"]
    return next(p for p in prompts if p["name"] == "chat_default_system")


def test_greedy_chat_answer_equals_llamacpp(chat_golden):
    """Default model, chat template on by default: stdout is exactly llama.cpp's greedy answer."""
    message = chat_golden["messages"][0]["content"]
    proc = _run("--temperature", "0", "-n", "48", message)
    assert proc.returncode == 0, proc.stderr
    expected = chat_golden["generated_text"].removesuffix("<|im_end|>")
    assert proc.stdout == expected
    assert proc.stderr == ""  # nothing but the text: no banners, no logs


def test_prompt_from_stdin_and_verbose_stats_on_stderr(chat_golden):
    message = chat_golden["messages"][0]["content"]
    proc = _run("--temperature", "0", "-n", "4", "-v", stdin=message)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "The answer to this"
    assert "loaded SmolLM2-135M-Instruct.Q4_1.gguf" in proc.stderr
    assert "tok/s" in proc.stderr


def test_seeded_sampling_is_reproducible_and_seed_matters():
    args = ("--no-chat", "-n", "12", "--temperature", "1.0", "Once upon a time")
    a, b = _run(*args, "--seed", "7"), _run(*args, "--seed", "7")
    c = _run(*args, "--seed", "8")
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout
    assert c.stdout != a.stdout
