"""Preprocessing settings from the model (`media.vision.preprocess_config`) and Qwen3-VL's pixel
bounds against transformers' own image processor.

The reference is transformers' `Qwen2VLImageProcessorPil` (what `Qwen3VLProcessor` uses for
images) built with the tiny Qwen3-VL mmproj's patch size, mean and std, run live on images of
several sizes (below the minimum, odd sides, extreme aspect ratios, above the maximum) under
Qwen3-VL's default bounds and under min/max pixels overrides: our pixel values must be equal and
our grid the same `image_grid_thw`. Sidecar files are written by transformers' `save_pretrained`
where it can (the video processor needs torchvision, absent here: its JSON is written in the
same format), and the settings reach the processor through `VisionPipeline`.
"""

import json
from functools import cache

import numpy as np
import pytest
from PIL import Image

from localllm.engine import EngineArgs, LLMEngine
from localllm.media.vision import preprocess_config as pconfig
from localllm.media.vision import qwen3vl_processor
from localllm.media.vision.mmproj import MMProjError, open_mmproj
from localllm.media.vision.pipeline import VisionPipeline
from localllm.media.vision.qwen3vl import ModelArgs
from localllm.media.vision.siglip import VisionConfigError
from tests.media.test_vision_qwen25vl import DATA

MMPROJ = DATA / "mmproj-qwen3vl.gguf"
TEXT = DATA / "qwen3vl-text.gguf"
SIZES = [(20, 20), (333, 517), (517, 333), (1000, 90), (90, 1000), (640, 480), (257, 255)]
DEFAULT = (qwen3vl_processor.MIN_PIXELS, qwen3vl_processor.MAX_PIXELS)
OVERRIDES = [(4096, 65536), (256 * 32 * 32, 300 * 32 * 32), (32 * 32, 32 * 32 * 4)]


@cache
def args() -> ModelArgs:
    with open_mmproj(MMPROJ) as g:
        return ModelArgs.from_gguf(g.metadata)


def image(w: int, h: int) -> Image.Image:
    rng = np.random.default_rng(w * 7919 + h)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def hf(img, lo, hi):
    from transformers import Qwen2VLImageProcessorPil

    a = args()
    ip = Qwen2VLImageProcessorPil(
        size={"shortest_edge": lo, "longest_edge": hi}, patch_size=a.patch_size,
        image_mean=list(a.image_mean), image_std=list(a.image_std),
    )  # fmt: skip
    got = ip(images=[img], return_tensors="np")
    return got["pixel_values"], got["image_grid_thw"][0].tolist()


@pytest.mark.parametrize("bounds", [DEFAULT, *OVERRIDES], ids=lambda b: f"{b[0]}-{b[1]}")
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_qwen3vl_pixels_and_grid_equal_transformers(size, bounds):
    lo, hi = bounds
    img = image(*size)
    ours, grid = qwen3vl_processor.Processor(args(), lo, hi).preprocess(img)
    want, thw = hf(img, lo, hi)
    assert list(grid.thw) == thw
    np.testing.assert_array_equal(ours, want)


def test_settings_are_read_from_transformers_sidecar_files(tmp_path):
    from transformers import Qwen2_5_VLConfig, Qwen2VLImageProcessorPil

    size = {"shortest_edge": 8192, "longest_edge": 262144}
    Qwen2VLImageProcessorPil(size=size, patch_size=16).save_pretrained(tmp_path)
    Qwen2_5_VLConfig(vision_config={"tokens_per_second": 4}).save_pretrained(tmp_path)
    video = {
        "size": {"shortest_edge": 4096, "longest_edge": 1 << 20},
        "fps": 1,
        "min_frames": 2,
        "max_frames": 32,
        "video_processor_type": "Qwen3VLVideoProcessor",
    }
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(video))  # fmt: skip
    assert pconfig.from_folder(tmp_path) == {
        "min_pixels": 8192, "max_pixels": 262144, "video_min_pixels": 4096,
        "video_max_pixels": 1 << 20, "video_fps": 1.0, "video_min_frames": 2,
        "video_max_frames": 32, "tokens_per_second": 4.0,
    }  # fmt: skip
    assert pconfig.from_folder(tmp_path / "nothing-here") == {}


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"preprocessor_config.json": "{not json"}, "not readable JSON"),
        ({"preprocessor_config.json": '{"min_pixels": -4}'}, "min_pixels is -4"),
        ({"preprocessor_config.json": '{"min_pixels": 9000, "max_pixels": 10}'}, "above"),
        ({"video_preprocessor_config.json": '{"fps": "fast"}'}, "fps is 'fast'"),
        ({"config.json": '{"vision_config": {"tokens_per_second": 0}}'}, "tokens_per_second"),
    ],
)
def test_a_malformed_sidecar_is_a_one_line_error(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(VisionConfigError, match=message) as e:
        pconfig.from_folder(tmp_path)
    assert "\n" not in str(e.value)


def test_mmproj_pixel_keys_are_read():
    meta = {"clip.vision.image_min_pixels": 1024, "clip.vision.image_max_pixels": 4096}
    assert pconfig.from_mmproj(meta) == {"min_pixels": 1024, "max_pixels": 4096}
    with pytest.raises(VisionConfigError, match="image_max_pixels is 0"):
        pconfig.from_mmproj({"clip.vision.image_max_pixels": 0})


@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(str(TEXT), EngineArgs(max_num_seqs=1))
    yield eng
    eng.close()


def test_the_pipeline_gives_the_processor_the_models_settings(engine, tmp_path):
    vp = VisionPipeline(MMPROJ, engine)  # a GGUF model: the mmproj's settings, else defaults
    try:
        p = vp.processor
        assert (p.min_pixels, p.max_pixels) == DEFAULT
        assert p.tokens_per_second == 2.0 and vp.video_sampling == {}
    finally:
        vp.close()
    given = {"min_pixels": 4096, "max_pixels": 65536, "tokens_per_second": 4, "video_fps": 1}
    vp = VisionPipeline(MMPROJ, engine, preprocess=given)
    try:
        p = vp.processor
        assert (p.min_pixels, p.max_pixels, p.tokens_per_second) == (4096, 65536, 4.0)
        assert vp.video_sampling == {"fps": 1.0}
        img = image(640, 480)
        ours = vp.prepare(_png(img))
        want, thw = hf(img, 4096, 65536)
        assert list(ours.layout.thw) == thw
        np.testing.assert_array_equal(ours.pixels.numpy(), want)
    finally:
        vp.close()
    with pytest.raises(MMProjError, match="unknown preprocessing settings"):
        VisionPipeline(MMPROJ, engine, preprocess={"min_pixel": 4})


def test_a_setting_the_family_does_not_take_is_refused():
    from tests.media.vision_fixture import MMPROJ as IDEFICS3
    from tests.media.vision_fixture import TEXT as IDEFICS3_TEXT

    eng = LLMEngine(str(IDEFICS3_TEXT), EngineArgs(max_num_seqs=1))
    try:
        with pytest.raises(MMProjError, match=r"takes no \['min_pixels'\]"):
            VisionPipeline(IDEFICS3, eng, preprocess={"min_pixels": 4096})
    finally:
        eng.close()


def _png(img) -> bytes:
    import io

    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()
