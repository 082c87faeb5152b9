"""Bad images and bad mmproj files get one clear error each, before any heavy work."""

import io
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from localllm.engine import EngineArgs, LLMEngine
from localllm.media.vision.image import ImageError, ImageLimits, decode_image
from localllm.media.vision.mmproj import MMProjError, build_tower, open_mmproj
from localllm.media.vision.pipeline import VisionPipeline
from tests.media.vision_fixture import MMPROJ, TEXT, image_bytes, rewrite_mmproj


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header says width x height (8-bit RGB) and whose data is one empty row."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * (3 * width + 1))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_a_20k_square_image_is_refused_from_its_header():
    t0 = time.perf_counter()
    with pytest.raises(ImageError, match="larger than the 40000000 pixels allowed"):
        decode_image(png_header(20_000, 20_000))
    with pytest.raises(ImageError, match="8000x8000 pixels, larger than"):
        decode_image(png_header(8_000, 8_000))
    assert time.perf_counter() - t0 < 5  # generous: nothing was decoded


def test_svg_is_refused_as_vector_graphics():
    svg = b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>'
    with pytest.raises(ImageError, match="SVG images are not supported"):
        decode_image(svg)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "empty"),
        (b"hello, this is not an image at all", "not an image in a supported format"),
        (image_bytes("tall.png")[:200], "corrupt"),  # a real PNG cut short
    ],
)
def test_corrupt_or_empty_input_is_an_image_error(data, why):
    with pytest.raises(ImageError, match=why):
        decode_image(data)


def test_limits_apply_to_bytes_and_sides():
    data = image_bytes("tall.png")
    with pytest.raises(ImageError, match="bytes, more than 100 allowed"):
        decode_image(data, ImageLimits(max_bytes=100))
    with pytest.raises(ImageError, match="larger than"):
        decode_image(data, ImageLimits(max_side=50))
    assert decode_image(data).size == (40, 56)


def test_transparency_goes_onto_white_and_grey_becomes_rgb():
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[0, 0] = (10, 20, 30, 255)  # opaque; the rest fully transparent black
    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, "PNG")
    px = np.asarray(decode_image(buf.getvalue()))
    assert px[0, 0].tolist() == [10, 20, 30] and px[1, 1].tolist() == [255, 255, 255]
    buf = io.BytesIO()
    Image.fromarray(np.full((2, 2), 7, np.uint8), "L").save(buf, "PNG")
    assert np.asarray(decode_image(buf.getvalue())).shape == (2, 2, 3)


def test_an_unsupported_projector_type_is_named(tmp_path):
    path = rewrite_mmproj(tmp_path / "mm.gguf", {"clip.projector_type": "cogvlm"})
    with pytest.raises(MMProjError, match=r"'cogvlm' is not supported.*idefics3"):
        open_mmproj(path)


def test_a_text_model_is_not_an_mmproj():
    with pytest.raises(MMProjError, match="not 'clip'"):
        open_mmproj(TEXT)


def test_a_missing_tower_tensor_is_named(tmp_path):
    path = rewrite_mmproj(tmp_path / "mm.gguf", {}, drop=("v.blk.1.attn_q.weight",))
    g = open_mmproj(path)
    try:
        with pytest.raises(MMProjError, match=r"missing tensors: v\.blk\.1\.attn_q"):
            build_tower(g)
    finally:
        g.close()


def test_an_mmproj_of_another_model_is_refused(smollm2_path):
    engine = LLMEngine(str(smollm2_path), EngineArgs(max_model_len=256))
    try:
        with pytest.raises(MMProjError, match="64-wide embeddings but the model's are 576"):
            VisionPipeline(MMPROJ, engine)
    finally:
        engine.close()
