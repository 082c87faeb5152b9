"""`localllm run --image` through the real CLI entry point, against the in-process engine."""

import os
import subprocess
import sys

import pytest

from localllm.engine import EngineArgs, LLMEngine
from localllm.media.vision.pipeline import VisionPipeline
from tests.media.vision_fixture import DATA, MMPROJ, TEXT, image_bytes, record, run_greedy

N = 8


def _run(*args, stdin=None):
    cmd = [sys.executable, "-m", "localllm.app", "run", *args]
    env = dict(os.environ, PYTHONSAFEPATH="1", PYTHONIOENCODING="utf-8")
    return subprocess.run(cmd, capture_output=True, input=stdin, timeout=600, env=env)


@pytest.fixture(scope="module")
def expected() -> str:
    """The answer of the same request in-process (LLMEngine + VisionPipeline), as text."""
    engine = LLMEngine(str(TEXT), EngineArgs(max_num_seqs=1))
    vision = VisionPipeline(MMPROJ, engine)
    try:
        chat = record()["chats"]["one_image"]
        ids, mm = vision.chat(engine, chat["messages"], [vision.prepare(image_bytes("tall.png"))])
        tokens, out = run_greedy(engine, ids, mm, N)
        assert tokens == chat["greedy_ids"]  # the transformers reference (see test_vision_*)
        return out.outputs[0].text
    finally:
        vision.close()
        engine.close()


def test_run_with_an_image_prints_the_in_process_answer(expected):
    text = record()["chats"]["one_image"]["messages"][0]["content"][1]["text"]
    proc = _run("-m", str(TEXT), "--mmproj", str(MMPROJ), "--image", str(DATA / "tall.png"),
                "--temperature", "0", "-n", str(N), text)  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode() == expected + "\n"


def test_the_image_may_come_from_stdin(expected):
    text = record()["chats"]["one_image"]["messages"][0]["content"][1]["text"]
    proc = _run("-m", str(TEXT), "--mmproj", str(MMPROJ), "--image", "-", "--temperature", "0",
                "-n", str(N), text, stdin=image_bytes("tall.png"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode() == expected + "\n"


def test_a_local_model_is_never_paired_with_a_file_beside_it():
    """The fixture folder holds the model's own mmproj, and still: no --mmproj, no images."""
    proc = _run("-m", str(TEXT), "--image", str(DATA / "tall.png"), "-n", "2", "hi")
    assert proc.returncode == 1
    assert b"--image needs the model's vision projector: pass --mmproj FILE" in proc.stderr


def test_a_bad_image_file_is_named(tmp_path):
    bad = tmp_path / "picture.png"
    bad.write_bytes(b"not a png")
    proc = _run("-m", str(TEXT), "--mmproj", str(MMPROJ), "--image", str(bad), "-n", "2", "hi")
    assert proc.returncode == 1
    assert f"{bad}: not an image in a supported format".encode() in proc.stderr
