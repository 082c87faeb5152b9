"""A GGUF whose chat template tries to escape the jinja sandbox: one error line, exit 1."""

import gguf
import numpy as np
import pytest

from localllm.app.cli import main
from tests.engine.tiny_models import SPECS, _metadata, _tensors


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-printable-character mapping, one token per byte, plus one merge."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    tokens = [chars[b] for b in range(256)]
    tokens[255] = "ab"  # one merged token, so the vocabulary has a merge to carry
    return tokens


def _tiny_chat_model(path, template: str):
    spec = SPECS["llama"]
    w = gguf.GGUFWriter(str(path), spec.arch)
    for key, value in _metadata(spec).items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(key, value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(_byte_tokens())
    w.add_token_types([1] * 256)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(template)
    for name, arr in _tensors(spec, np.random.default_rng(0)).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


HOSTILE = {
    "class escape": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals": "{{ self._TemplateReference__context.cycler.__init__.__globals__.os }}",
    "endless": "{% for i in range(10**9) %}{% for j in range(10**9) %}x{% endfor %}{% endfor %}",
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_template_is_one_clear_error(tmp_path, capsys, name):
    path = _tiny_chat_model(tmp_path / "tiny.gguf", HOSTILE[name])
    code = main(["run", "-m", str(path), "--chat", "-n", "4", "hi"])
    out, err = capsys.readouterr()
    assert code == 1
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("localllm: error: "), err
    assert "template" in lines[0]


def test_benign_template_generates(tmp_path, capsys):
    """The same tiny model with a plain template runs: the failures above are the template's."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = _tiny_chat_model(tmp_path / "tiny.gguf", template)
    code = main(["run", "-m", str(path), "--chat", "-n", "4", "--temperature", "0", "hi"])
    _, err = capsys.readouterr()
    assert code == 0, err
    assert err == ""


def test_large_template_fails_to_compile_within_seconds(tmp_path, capsys):
    """252 K characters of output tags: they compiled for 2 s and ran (at the old 1 MiB cap a
    template compiled for 10-30 s); now refused by the compile limits."""
    import time

    path = _tiny_chat_model(tmp_path / "tiny.gguf", "{{ m }}" * 36_000)
    start = time.monotonic()
    code = main(["run", "-m", str(path), "--chat", "-n", "4", "hi"])
    seconds = time.monotonic() - start
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("localllm: error: "), err
    assert "chat template does not compile" in lines[0], err
    assert seconds < 10  # the compile limit is 1 s; generous for a loaded CI machine
