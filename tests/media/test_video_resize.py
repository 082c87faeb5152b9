"""Video frames are resized as they are decoded (`decode_video(resize=)`): only frames of the
size the processor gives them are kept, and the pixels equal those of decoding every frame at
full size first and resizing them together (the path checked against transformers'
`Qwen2VLVideoProcessor` / `Qwen3VLVideoProcessor` in test_vision_qwen25vl.py / _qwen3vl.py).
A 1280x720 video made with PyAV is above Qwen2.5-VL's default per-frame budget (602,112 pixels)."""

import io

import av
import numpy as np
import pytest

from localllm.engine import EngineArgs, LLMEngine
from localllm.media.vision.pipeline import VisionPipeline
from localllm.media.vision.video import VideoError, VideoLimits, decode_video
from tests.media.test_vision_qwen25vl import MMPROJ, TEXT

W, H, N = 1280, 720, 8


def hd_video() -> bytes:
    rng = np.random.default_rng(3)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=4)
        s.width, s.height, s.pix_fmt = W, H, "yuv420p"
        for i in range(N):
            img = np.zeros((H, W, 3), np.uint8)
            img[:, :, 0] = np.linspace(0, 255, W, dtype=np.uint8)[None]
            img[:, :, 1] = i * 30 % 256
            img[100:300, 200 + 10 * i : 500 + 10 * i] = rng.integers(0, 256, 3, dtype=np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


@pytest.fixture(scope="module")
def vision():
    engine = LLMEngine(str(TEXT), EngineArgs(max_num_seqs=1))
    vp = VisionPipeline(MMPROJ, engine)  # Qwen2.5-VL's default pixel bounds
    yield vp
    vp.close()
    engine.close()


def test_frames_are_kept_at_the_processors_size_with_the_same_pixels(vision):
    data, proc = hd_video(), vision.processor
    full = decode_video(data)  # every sampled frame at 1280x720
    small = decode_video(data, resize=proc.video_frame_size)
    size = proc.video_frame_size(len(full.indices), H, W)
    assert full.frames.shape[1:3] == (H, W) and small.frames.shape[1:3] == size
    assert size[0] * size[1] < H * W and small.source == full.source == (H, W)
    want, grid = proc.preprocess_video(full)
    ours, grid2 = proc.preprocess_video(small)
    assert grid == grid2
    np.testing.assert_array_equal(ours, want)
    item = vision.prepare_video(data)  # the pipeline resizes while decoding
    assert item.size == (W, H) and list(item.layout.thw) == list(grid.thw)
    np.testing.assert_array_equal(item.pixels.numpy(), want)


def test_the_decoded_bytes_limit_counts_the_resized_frames(vision):
    data, proc = hd_video(), vision.processor
    n = len(decode_video(data).indices)
    h, w = proc.video_frame_size(n, H, W)
    limits = VideoLimits(max_frames_bytes=n * h * w * 3)  # enough for the resized frames only
    assert decode_video(data, limits, resize=proc.video_frame_size).frames.shape[1:3] == (h, w)
    with pytest.raises(VideoError, match="sampled frames take"):
        decode_video(data, limits)
