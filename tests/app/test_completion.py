"""`localllm completion bash|zsh|fish`: the scripts, loaded into the real shells, complete the
CLI's subcommands, flags and choices (bash through its completion function, fish through
`complete -C`, zsh through compinit's registry and the script's own tables)."""

import shutil
import subprocess
import sys

import pytest


def _script(shell: str, tmp_path) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "localllm.app", "completion", shell],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / {"bash": "localllm.bash", "zsh": "_localllm", "fish": "localllm.fish"}[shell]
    path.write_text(proc.stdout)
    return str(path)


def _shell(shell: str, code: str) -> str:
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed")
    proc = subprocess.run([shell, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _bash_complete(script: str, *words: str) -> list[str]:
    """COMPREPLY for the command line `words` (the last word is the one being completed)."""
    quoted = " ".join(f"'{w}'" for w in words)
    code = (
        f"source {script}; COMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; "
        f'COMP_LINE="{" ".join(words)}"; COMP_POINT=${{#COMP_LINE}}; '
        '_shtab_localllm; printf "%s\\n" "${COMPREPLY[@]}"'
    )
    return _shell("bash", code).split()


def test_bash(tmp_path):
    script = _script("bash", tmp_path)
    assert {"run", "rm"} == set(_bash_complete(script, "localllm", "r"))
    assert _bash_complete(script, "localllm", "run", "--max") == ["--max-tokens"]
    kv = _bash_complete(script, "localllm", "serve", "--cache-type", "")
    assert kv == ["f32", "f16", "bf16", "q8_0", "fp8"]
    assert _bash_complete(script, "localllm", "completion", "") == ["bash", "zsh", "fish"]
    (tmp_path / "model.gguf").write_bytes(b"")
    got = _bash_complete(script, "localllm", "run", "-m", f"{tmp_path}/mod")
    assert got == [f"{tmp_path}/model.gguf"]  # -m completes paths


def _fish_complete(script: str, line: str) -> list[str]:
    out = _shell("fish", f"source {script}; complete -C '{line}'")
    return [row.split("\t")[0] for row in out.splitlines()]


def test_fish(tmp_path):
    script = _script("fish", tmp_path)
    assert {"run", "rm"} == set(_fish_complete(script, "localllm r"))
    assert _fish_complete(script, "localllm run --max") == ["--max-tokens"]
    kv = _fish_complete(script, "localllm serve --cache-type ")
    assert sorted(kv) == sorted(["f32", "f16", "bf16", "q8_0", "fp8"])
    assert "doctor" in _fish_complete(script, "localllm ")


def test_zsh(tmp_path):
    script = _script("zsh", tmp_path)
    folder = tmp_path  # the script is named _localllm: a compinit function file
    code = (
        f"fpath=({folder} $fpath); autoload -Uz compinit; compinit -u -d {tmp_path}/zcd; "
        "print -r -- $_comps[localllm]; "
        f"source {script}; print -r -- $functions[_shtab_localllm_commands]; "
        "print -rl -- $_shtab_localllm_run_options $_shtab_localllm_bench_options"
    )
    out = _shell("zsh", code)
    lines = out.splitlines()
    assert lines[0] == "_localllm"  # compinit registered the script for `localllm`
    assert "doctor:'print versions" in out  # the subcommands' table
    assert any(ln.startswith("--max-tokens[") for ln in lines)  # run's flags
    assert "--output[output]:output:(md csv json)" in lines  # bench -o's choices, not files
    assert any(ln.startswith("--model[") and ln.endswith(":_files") for ln in lines)
