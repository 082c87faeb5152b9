"""`localllm run --image` with the Gemma 3 and LLaVA-1.5 fixtures (tests/data/vision), through
the real CLI entry point: the printed answer is the in-process engine's, whose tokens are
transformers' greedy ones (tests/media/test_vision_gemma3.py, test_vision_llava.py)."""

import pytest

from localllm.engine import EngineArgs, LLMEngine
from localllm.media.vision.pipeline import VisionPipeline
from tests.app.test_cli_vision import _run
from tests.media import test_vision_gemma3 as gemma3
from tests.media import test_vision_llava as llava
from tests.media.vision_fixture import DATA, image_bytes, run_greedy

N = 8


@pytest.mark.parametrize("mod", [gemma3, llava], ids=["gemma3", "llava"])
def test_run_with_an_image_prints_the_in_process_answer(mod):
    chat = mod.record()["chats"]["one_image"]
    engine = LLMEngine(str(mod.TEXT), EngineArgs(max_num_seqs=1))
    vision = VisionPipeline(mod.MMPROJ, engine)
    try:
        ids, mm = vision.chat(engine, chat["messages"], [vision.prepare(image_bytes("tall.png"))])
        tokens, out = run_greedy(engine, ids, mm, N)
        assert tokens == chat["greedy_ids"]
        expected = out.outputs[0].text
    finally:
        vision.close()
        engine.close()
    text = chat["messages"][0]["content"][1]["text"]
    proc = _run("-m", str(mod.TEXT), "--mmproj", str(mod.MMPROJ), "--image",
                str(DATA / "tall.png"), "--temperature", "0", "-n", str(N), text)  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode() == expected + "\n"
