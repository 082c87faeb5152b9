"""Video decoding (`media.vision.video`, PyAV): the sampled frames are the file's, and every bad
or oversized input is a one-line `VideoError` read from the header, before frames are decoded."""

import io

import av
import numpy as np
import pytest
import soundfile

from localllm.media.vision.video import (
    VideoError,
    VideoLimits,
    decode_video,
    sample_indices,
    video_digest,
)
from tests.media.test_vision_qwen25vl import DATA

CLIP = (DATA / "clip.mp4").read_bytes()  # 8 frames of 64x48 at 4 fps


def all_frames(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])])


def test_the_sampled_frames_are_the_files_frames_at_their_indices():
    v = decode_video(CLIP)
    assert (v.total, v.fps) == (8, 4.0)
    assert list(v.indices) == sample_indices(8, 4.0, VideoLimits(), 2) == [0, 2, 4, 6]
    np.testing.assert_array_equal(v.frames, all_frames(CLIP)[[0, 2, 4, 6]])
    assert v.sampled_fps == 2.0


def test_a_custom_sampler_picks_the_frames():
    v = decode_video(CLIP, sampler=lambda total, fps, limits: [1, 7])
    np.testing.assert_array_equal(v.frames, all_frames(CLIP)[[1, 7]])


def test_the_digest_follows_the_pixels_and_the_salt():
    a, b = decode_video(CLIP), decode_video(CLIP, sampler=lambda n, f, lim: [1, 7])
    assert video_digest(a) == video_digest(decode_video(CLIP))
    assert len({video_digest(a), video_digest(b), video_digest(a, "other projector")}) == 3


@pytest.mark.parametrize(
    ("data", "limits", "message"),
    [
        (b"", VideoLimits(), "empty"),
        (b"\x00\x00\x00\x18ftypmp42 not a video at all", VideoLimits(), "FFmpeg"),
        (CLIP, VideoLimits(max_bytes=1000), "more than 1000 allowed"),
        (CLIP, VideoLimits(max_seconds=1.0), "2 s long, above 1 s"),
        (CLIP, VideoLimits(max_pixels=64 * 47), "64x48, above 3008 pixels"),
        (CLIP, VideoLimits(max_frames_bytes=30_000), r"4 sampled frames take 0\.04 MiB"),
    ],
    ids=["empty", "garbage", "bytes", "seconds", "frame-pixels", "frames-bytes"],
)
def test_bad_or_oversized_videos_are_refused_with_one_line(data, limits, message):
    with pytest.raises(VideoError, match=message) as e:
        decode_video(data, limits)
    assert "\n" not in str(e.value)


def test_a_file_without_a_video_stream_is_refused():
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(1600, dtype=np.float32), 16000, format="WAV")
    with pytest.raises(VideoError, match="no video stream"):
        decode_video(buf.getvalue())
