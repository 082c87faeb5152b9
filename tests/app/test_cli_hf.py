"""`localllm run -m DIR` on a Hugging Face folder (tests/data/hf), and its errors as one line."""

import json
import shutil
from pathlib import Path

from localllm.app.cli import main
from localllm.engine import EngineArgs, LLMEngine, SamplingParams

DATA = Path(__file__).parents[1] / "data" / "hf"


def greedy_text(path: str, prompt: str, n: int, **kw) -> str:
    e = LLMEngine(path, EngineArgs(**kw))
    e.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=n))
    text = ""
    while e.has_unfinished_requests():
        for out in e.step():
            text = out.outputs[0].text
    e.close()
    return text


def test_run_on_a_folder_prints_the_engines_text(capsys):
    folder = str(DATA / "qwen3")
    args = ["run", "-m", folder, "-n", "8", "--temperature", "0", "--no-chat", "Hello, world"]
    assert main(args) == 0
    assert capsys.readouterr().out == greedy_text(folder, "Hello, world", 8) + "\n"
    assert main([*args, "--quantize", "q8_0"]) == 0
    want = greedy_text(folder, "Hello, world", 8, quantize="q8_0")
    assert capsys.readouterr().out == want + "\n"


def test_errors_are_one_line_naming_the_folder(tmp_path, capsys):
    d = tmp_path / "m"
    shutil.copytree(DATA / "llama", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq"}
    (d / "config.json").write_text(json.dumps(cfg))
    assert main(["run", "-m", str(d), "hi"]) == 1
    err = capsys.readouterr().err
    assert err == f"localllm: error: {d}: " + err.split(f"{d}: ", 1)[1]
    assert err.count("\n") == 1 and "pre-quantized AWQ checkpoint" in err
    assert main(["run", "-m", str(DATA / "llama.gguf"), "--quantize", "q8_0", "hi"]) == 1
    assert "--quantize applies to Hugging Face folders" in capsys.readouterr().err
