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
    assert proc.stdout == expected + "\n"  # a pipe: one newline after the text, always
    assert proc.stderr == ""  # nothing but the text: no banners, no logs


def test_prompt_from_stdin_and_verbose_stats_on_stderr(chat_golden):
    message = chat_golden["messages"][0]["content"]
    proc = _run("--temperature", "0", "-n", "4", "-v", stdin=message)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "The answer to this\n"
    assert "loaded SmolLM2-135M-Instruct.Q4_1.gguf" in proc.stderr
    assert "tok/s" in proc.stderr


def test_seeded_sampling_is_reproducible_and_seed_matters():
    args = ("--no-chat", "-n", "12", "--temperature", "1.0", "Once upon a time")
    a, b = _run(*args, "--seed", "7"), _run(*args, "--seed", "7")
    c = _run(*args, "--seed", "8")
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout
    assert c.stdout != a.stdout


# -- a newcomer's first hour (issue 34): empty prompts, cut constrained answers, newlines --------


def _one_line(stderr: str, prefix: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "stdin", "why"),
    [
        ((), "", "the prompt on stdin is empty"),  # echo -n | localllm run
        (("-",), " \n\t", "the prompt on stdin is empty"),
        (("",), None, "the prompt is empty"),  # localllm run ""
        (("  ",), "ignored", "the prompt is empty"),
    ],
)
def test_an_empty_prompt_is_a_usage_error(args, stdin, why):
    proc = _run(*args, stdin=stdin)
    assert proc.returncode == 2 and proc.stdout == ""
    assert _one_line(proc.stderr, "localllm: error: ") == (
        f"localllm: error: {why}; nothing to generate from"
    )


def test_a_json_answer_the_limit_cut_is_reported_and_exits_3():
    proc = _run("--temperature", "0", "-n", "12", "--json", "Describe a cat as JSON")
    assert proc.returncode == 3
    assert _one_line(proc.stderr, "localllm: warning: ") == (
        "localllm: warning: the answer was cut at 12 tokens (-n); it is not complete JSON"
    )
    assert proc.stdout.startswith("{") and proc.stdout.endswith("\n")
    with pytest.raises(json.JSONDecodeError):
        json.loads(proc.stdout)


def test_a_regex_answer_complete_on_the_last_allowed_token_is_not_reported():
    args = ("--temperature", "0", "--regex", "[0-9]{3}", "-v", "Pick a number")
    cut = _run("-n", "2", *args)
    assert cut.returncode == 3, cut.stderr
    assert "localllm: warning: the answer was cut at 2 tokens (-n); it does not match --regex" in (
        cut.stderr
    )
    exact = _run("-n", "3", *args)  # three digit tokens: complete, though the limit ended it
    assert exact.returncode == 0, exact.stderr
    assert "generated 3 tokens" in exact.stderr and "warning" not in exact.stderr
    assert len(exact.stdout) == 4 and exact.stdout[:3].isdigit() and exact.stdout[3] == "\n"
    room = _run("-n", "20", *args)  # ended by the grammar: the same digits, exit 0
    assert room.returncode == 0 and room.stdout == exact.stdout


def test_piped_output_ends_with_one_newline_even_after_one_of_its_own():
    """A pipe gets the text and one newline, whether or not the text ended with one."""
    base = ("--no-chat", "--temperature", "0", "--regex", "[a-z]{3}\n")
    proc = _run(*base, "-n", "8", "Three letters:")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout) == 5 and proc.stdout.endswith("\n\n"), repr(proc.stdout)


def test_no_prompt_and_a_terminal_on_stdin_is_a_usage_error():
    """Nothing to read: a terminal on stdin is not waited on."""
    import os

    main_fd, term = os.openpty()
    try:
        cmd = [sys.executable, "-m", "localllm.app", "run"]
        proc = subprocess.run(cmd, stdin=term, capture_output=True, text=True, timeout=120)
    finally:
        os.close(main_fd)
        os.close(term)
    assert proc.returncode == 2 and proc.stdout == ""
    assert _one_line(proc.stderr, "localllm: error: ") == (
        "localllm: error: no prompt given (pass it as an argument or on stdin); "
        "nothing to generate from"
    )
