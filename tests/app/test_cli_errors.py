"""Bad input to `localllm run`: one clear error line on stderr, a non-zero exit, no traceback."""

import subprocess
import sys

import gguf
import numpy as np
import pytest

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


# -- hostile hyperparameters (issue 33, item 6): one `FILE: what` line within a second ----------

U32 = gguf.GGUFValueType.UINT32
HOSTILE_HPARAMS = {
    "block_count 10^6": ({"block_count": (10**6, U32)}, "block_count"),
    "block_count 2^31": ({"block_count": (2**31, U32)}, "block_count"),
    "context_length 2^31": ({"context_length": (2**31 - 1, U32)}, "context_length"),
    "embedding_length 2^31": ({"embedding_length": (2**31 - 1, U32)}, "embedding_length"),
    "rope dims 2^31": ({"rope.dimension_count": (2**31 - 1, U32)}, "rope.dimension_count"),
    "head_count 0": ({"attention.head_count": (0, U32)}, "attention.head_count"),
    "rope base 0": ({"rope.freq_base": (0.0, None)}, "rope.freq_base"),
    "rope base NaN": ({"rope.freq_base": (float("nan"), None)}, "rope.freq_base"),
    "rms eps < 0": ({"attention.layer_norm_rms_epsilon": (-1e-5, None)}, "epsilon"),
    "rms eps NaN": ({"attention.layer_norm_rms_epsilon": (float("nan"), None)}, "epsilon"),
}


def _hostile_llama(tmp_path, hparams=None, meta=None):
    from tests.engine.gguf_fixtures import GGUFValue
    from tests.engine.hostile_gguf import hparam, write_variant

    values = {
        hparam("llama", name): GGUFValue(v, t) if t is not None else v
        for name, (v, t) in (hparams or {}).items()
    }
    return write_variant(tmp_path / "hostile.gguf", "llama", {**values, **(meta or {})})


def _run_fast(path, capsys):
    """`localllm run -m FILE hi`, warmed up (imports) first, under a 20 s watchdog."""
    import signal
    import time

    import localllm.engine.llm_engine  # noqa: F401 (imports are not the file's fault)

    def hang(*_):
        raise TimeoutError("localllm run did not give up on a hostile file within 20 s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, 20)
    try:
        t0 = time.perf_counter()
        code, out, err = _run(["-m", str(path), "-n", "2", "hi"], capsys)
        return code, out, err, time.perf_counter() - t0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _assert_file_error(path, code, out, err, seconds, *needles):
    _assert_one_line_error(code, out, err, *needles)
    assert err.startswith(f"localllm: error: {path}: "), err
    assert seconds < 1.0, f"took {seconds:.2f} s"  # the bound: within a second


@pytest.mark.parametrize("case", HOSTILE_HPARAMS)
def test_hostile_hyperparameter(tmp_path, capsys, case):
    hparams, needle = HOSTILE_HPARAMS[case]
    path = _hostile_llama(tmp_path, hparams)
    code, out, err, seconds = _run_fast(path, capsys)
    _assert_file_error(path, code, out, err, seconds, needle)


def test_wordpiece_model_on_a_bpe_vocabulary(tmp_path, capsys):
    path = _hostile_llama(tmp_path, meta={"tokenizer.ggml.model": "bert"})
    code, out, err, seconds = _run_fast(path, capsys)
    _assert_file_error(path, code, out, err, seconds, "bert")


def test_flipped_bit_in_a_vocabulary_token(tmp_path, capsys):
    from tests.engine.hostile_gguf import TOKENS, flipped_token

    path = _hostile_llama(tmp_path, meta={TOKENS: flipped_token("llama", 120)})
    code, out, err, seconds = _run_fast(path, capsys)
    _assert_file_error(path, code, out, err, seconds, "token 120", "UTF-8")


def test_vocabulary_shorter_than_the_embedding(tmp_path, capsys):
    from tests.engine.hostile_gguf import TOKENS, byte_tokens

    short = {TOKENS: byte_tokens()[:200], "tokenizer.ggml.token_type": np.ones(200, np.int32)}
    path = _hostile_llama(tmp_path, meta=short)
    code, out, err, seconds = _run_fast(path, capsys)
    _assert_file_error(path, code, out, err, seconds, "200 tokens", "256")
