"""`localllm run --lora PATH:SCALE` in a subprocess: its greedy text is the in-process engine's
with that adapter at that scale, and not the base's."""

import os
import subprocess
import sys

from localllm.engine import EngineArgs, LLMEngine, SamplingParams
from localllm.engine.lora import LoraSpec
from tests.lora.lora_refs import HF, LORA

PROMPT = "Hello, world! The quick brown"
ADAPTER = LORA / "llama-a.gguf"


def engine_text(lora) -> str:
    e = LLMEngine(str(HF / "llama"), EngineArgs(max_num_seqs=1, lora=(LoraSpec(str(ADAPTER)),)))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, lora=lora)
    e.add_request("a", PROMPT, params)
    text = ""
    while e.has_unfinished_requests():
        for out in e.step():
            text = out.outputs[0].text
    e.close()
    return text


def test_run_applies_the_adapter_at_its_scale(tmp_path):
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1", LOCALLLM_MODEL_DIRS="")
    env.update(XDG_CONFIG_HOME=str(tmp_path / "c"), XDG_DATA_HOME=str(tmp_path / "d"))
    cmd = [sys.executable, "-m", "localllm.app", "run", "-m", str(HF / "llama"), "--no-chat",
           "--lora", f"{ADAPTER}:0.5", "-n", "8", "--temp", "0", "--ignore-eos",
           PROMPT]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    want = engine_text(((0, 0.5),))
    assert want != engine_text(())
    assert r.stdout.removesuffix("\n") == want
