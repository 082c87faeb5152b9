"""`localllm run --video` through the real CLI entry point, against the in-process engine
(Qwen2.5-VL fixture; the video path itself is checked against transformers in
tests/media/test_vision_qwen25vl.py)."""

import os
import subprocess
import sys

import pytest

from localllm.engine import EngineArgs, LLMEngine
from localllm.media.vision.pipeline import VisionPipeline
from tests.media.test_vision_qwen25vl import DATA, MMPROJ, TEXT
from tests.media.vision_fixture import run_greedy

N = 6
QUESTION = "What happens in the video?"


def _run(*args, stdin=None):
    cmd = [sys.executable, "-m", "localllm.app", "run", *args]
    env = dict(os.environ, PYTHONSAFEPATH="1", PYTHONIOENCODING="utf-8")
    return subprocess.run(cmd, capture_output=True, input=stdin, timeout=600, env=env)


@pytest.fixture(scope="module")
def expected() -> str:
    """The same request in-process (LLMEngine + VisionPipeline, default preprocessing)."""
    engine = LLMEngine(str(TEXT), EngineArgs(max_num_seqs=1))
    vision = VisionPipeline(MMPROJ, engine)
    try:
        video = vision.prepare_video((DATA / "clip.mp4").read_bytes())
        msgs = [
            {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}
        ]
        ids, mm = vision.chat(engine, msgs, [video])
        _, out = run_greedy(engine, ids, mm, N)
        return out.outputs[0].text
    finally:
        vision.close()
        engine.close()


def test_run_with_a_video_prints_the_in_process_answer(expected):
    proc = _run("-m", str(TEXT), "--mmproj", str(MMPROJ), "--video", str(DATA / "clip.mp4"),
                "--temperature", "0", "-n", str(N), QUESTION)  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode() == expected + "\n"


def test_the_video_may_come_from_stdin(expected):
    proc = _run("-m", str(TEXT), "--mmproj", str(MMPROJ), "--video", "-", "--temperature", "0",
                "-n", str(N), QUESTION, stdin=(DATA / "clip.mp4").read_bytes())  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode() == expected + "\n"


def test_a_bad_video_file_is_named(tmp_path):
    bad = tmp_path / "clip.mp4"
    bad.write_bytes(b"\x00\x00\x00\x18ftypmp42 not really a video")
    proc = _run("-m", str(TEXT), "--mmproj", str(MMPROJ), "--video", str(bad), "-n", "2", "hi")
    assert proc.returncode == 1
    assert f"{bad}: ".encode() in proc.stderr and b"video" in proc.stderr


def test_video_needs_a_projector_and_chat_mode():
    proc = _run("-m", str(TEXT), "--video", str(DATA / "clip.mp4"), "-n", "2", "hi")
    assert proc.returncode == 1
    assert b"--video needs the model's vision projector" in proc.stderr
    proc = _run("-m", str(TEXT), "--mmproj", str(MMPROJ), "--video", str(DATA / "clip.mp4"),
                "--no-chat", "-n", "2", "hi")  # fmt: skip
    assert proc.returncode == 1
    assert b"--video needs chat mode" in proc.stderr
