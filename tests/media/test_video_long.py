"""A long video is sampled with bounded work and memory (`media.vision.video`): a 2-hour
synthetic video made with PyAV (1 frame a second, 32x32, a keyframe every 24 frames, each frame's
index drawn into its pixels) in MP4 (frame count in the header) and Matroska (none: counted by
packets). The sampled frames must be the ones a full sequential decode gives at those indices;
the decoder's work (frames decoded) stays near samples x keyframe interval, not the video's
7,200 frames, and the peak of Python-tracked memory (numpy's arrays included) stays small.
"""

import io
import tracemalloc
from functools import cache

import av
import numpy as np
import pytest

from localllm.media.vision.video import SEEK_GAP, VideoLimits, decode_video, sample_indices

FRAMES, GOP, SIDE = 7200, 24, 32  # two hours at 1 fps


@cache
def long_video(fmt: str) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream("mpeg4", rate=1)
        s.width, s.height, s.pix_fmt = SIDE, SIDE, "yuv420p"
        s.codec_context.gop_size = GOP
        s.codec_context.max_b_frames = 0
        for i in range(FRAMES):
            img = np.zeros((SIDE, SIDE, 3), np.uint8)
            img[..., 0] = i % 251
            img[..., 1] = i // 251 * 8
            img[:, : i % SIDE, 2] = 255
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def frames_at(data: bytes, indices) -> np.ndarray:
    """The reference: every frame decoded in order, those at `indices` kept."""
    want, out = set(indices), {}
    with av.open(io.BytesIO(data)) as c:
        for i, f in enumerate(c.decode(c.streams.video[0])):
            if i in want:
                out[i] = f.to_ndarray(format="rgb24")
    return np.stack([out[i] for i in indices])


@pytest.mark.parametrize("fmt", ["mp4", "matroska"])
def test_a_two_hour_video_is_sampled_by_seeking(fmt):
    data = long_video(fmt)
    limits = VideoLimits(max_frames=16)
    tracemalloc.start()
    try:
        v = decode_video(data, limits)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert v.total == FRAMES and v.fps == 1.0
    assert list(v.indices) == sample_indices(FRAMES, 1.0, limits, 2)  # 450 frames apart
    np.testing.assert_array_equal(v.frames, frames_at(data, v.indices))
    assert v.decoded <= len(v.indices) * GOP  # each from the keyframe at or before it
    assert peak < 4 * 2**20, peak  # the 16 frames are 48 KiB; the file itself is ~200 KB


def test_close_frames_are_decoded_in_order_without_seeking():
    """Sampled frames closer than SEEK_GAP are reached by decoding on: the work is the span."""
    data = long_video("mp4")
    pick = [0, 10, 40, 41, 40 + SEEK_GAP]
    v = decode_video(data, sampler=lambda total, fps, limits: pick)
    assert v.decoded == pick[-1] + 1
    np.testing.assert_array_equal(v.frames, frames_at(data, pick))


def test_the_default_limits_take_a_two_hour_video():
    v = decode_video(long_video("mp4"))  # 7,200 s: under the 4-hour default
    assert len(v.indices) == 768  # 9.4 frames apart: decoded in order, no seek
    assert v.decoded == v.indices[-1] + 1
