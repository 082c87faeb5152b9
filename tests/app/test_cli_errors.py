"""Bad input to `localllm run`: one clear error line on stderr, a non-zero exit, no traceback."""

import subprocess
import sys

import gguf
import numpy as np

from localllm.app.cli import main


def _run(args, capsys):
    code = main(["run", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _assert_one_line_error(code, out, err, *needles):
    assert code != 0
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("localllm: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, err)


def test_missing_model_path(tmp_path, capsys):
    missing = tmp_path / "nope.gguf"
    code, out, err = _run(["-m", str(missing), "hi"], capsys)
    _assert_one_line_error(code, out, err, "model not found", "nope.gguf")


def test_directory_without_gguf(tmp_path, capsys):
    code, out, err = _run(["-m", str(tmp_path), "hi"], capsys)
    _assert_one_line_error(code, out, err, "exactly one .gguf")


def test_not_a_gguf(tmp_path, capsys):
    bad = tmp_path / "notes.gguf"
    bad.write_text("this is not a model\n" * 10)
    code, out, err = _run(["-m", str(bad), "hi"], capsys)
    _assert_one_line_error(code, out, err, "notes.gguf")


def test_truncated_real_model(smollm2_path, tmp_path, capsys):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2_path.read_bytes()[:3_000_000])
    code, out, err = _run(["-m", str(cut), "hi"], capsys)
    _assert_one_line_error(code, out, err, "cut.gguf")


def test_bitflipped_header(smollm2_path, tmp_path, capsys):
    data = bytearray(smollm2_path.read_bytes()[:2_000_000])
    rng = np.random.default_rng(7)
    flipped = tmp_path / "flip.gguf"
    for _ in range(5):
        buf = bytearray(data)
        for pos in rng.integers(0, 4096, size=3):
            buf[pos] ^= 1 << int(rng.integers(0, 8))
        flipped.write_bytes(bytes(buf))
        code, out, err = _run(["-m", str(flipped), "hi"], capsys)
        _assert_one_line_error(code, out, err)


def test_unknown_architecture(tmp_path, capsys):
    path = tmp_path / "mystery.gguf"
    w = gguf.GGUFWriter(str(path), "mamba9")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    code, out, err = _run(["-m", str(path), "hi"], capsys)
    _assert_one_line_error(code, out, err, "unsupported model architecture 'mamba9'")


def test_bad_flag_value(capsys):
    code, out, err = _run(["--temperature", "-1", "hi"], capsys)
    _assert_one_line_error(code, out, err, "temperature")


def test_subprocess_exit_code_and_stderr(tmp_path):
    """The installed entry point, not just main(): exit status and a single stderr line."""
    cmd = [sys.executable, "-m", "localllm.app", "run", "-m", str(tmp_path / "x.gguf"), "hi"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.strip().startswith("localllm: error: model not found")
    assert "Traceback" not in proc.stderr
