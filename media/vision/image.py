"""Image decoding: bytes of a PNG/JPEG/WebP/GIF/BMP/TIFF file to an RGB `PIL.Image`, bounded.

Every limit is checked on the header, before a pixel is decoded: the byte size, the pixel count
(a 20k x 20k file is refused, never decoded), the format. Colour conversion follows the Hugging
Face image processors (`convert_to_rgb`): transparency is composited onto white; the EXIF
orientation is applied as transformers' `load_image` does. Errors are `ImageError` (a
ValueError) with one line that says what is wrong.
"""

import hashlib
import io
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

# Raster formats Pillow decodes that we accept; the first frame of an animation is the image.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


class ImageError(ValueError):
    """The input is not an image we take (corrupt, too large, vector, an unknown format)."""


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """Bounds on one input image (defaults documented in docs/vision.md)."""

    max_bytes: int = 20 * 1024 * 1024  # the encoded file
    max_pixels: int = 40_000_000  # width x height, read from the header before decoding
    max_side: int = 16_384  # the longer side, in pixels


DEFAULT_LIMITS = ImageLimits()


def decode_image(data: bytes, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    """The image in `data` as an RGB `PIL.Image`; `ImageError` when it is not one we take."""
    if not data:
        raise ImageError("the image is empty (0 bytes)")
    if len(data) > limits.max_bytes:
        raise ImageError(f"the image is {len(data)} bytes, more than {limits.max_bytes} allowed")
    if _looks_like_svg(data):
        raise ImageError("SVG images are not supported (vector graphics): send a PNG or JPEG")
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
    except Image.DecompressionBombError as e:  # Pillow's own header check, far past ours
        raise ImageError(
            f"the image is larger than the {limits.max_pixels} pixels allowed: {e}"
        ) from None
    except UnidentifiedImageError:
        raise ImageError(
            f"not an image in a supported format ({', '.join(FORMATS)}), or a corrupt one"
        ) from None
    except (OSError, ValueError, SyntaxError) as e:  # Pillow's header parsers raise these
        raise ImageError(f"corrupt image: {e}") from None
    w, h = img.size
    if w < 1 or h < 1:
        raise ImageError(f"the image has no pixels ({w}x{h})")
    if w * h > limits.max_pixels or max(w, h) > limits.max_side:
        raise ImageError(
            f"the image is {w}x{h} pixels, larger than the {limits.max_pixels} pixels "
            f"(or {limits.max_side} a side) allowed"
        )
    try:
        img.load()  # the decode proper: truncated or corrupt data fails here
        img = ImageOps.exif_transpose(img)
        return to_rgb(img)
    except Image.DecompressionBombError as e:  # a frame larger than its header said
        raise ImageError(f"the image is too large to decode: {e}") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"corrupt image ({img.format}): {e}") from None


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB as Hugging Face's `convert_to_rgb`: transparent pixels composited onto white."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def thumbnail(data: bytes, width: int, height: int) -> np.ndarray:
    """The image in `data` shrunk (aspect kept, never enlarged) to fit width x height pixels,
    RGB [h, w, 3] uint8: a preview (the TUI's); `ImageError` as `decode_image`."""
    img = decode_image(data)
    img.thumbnail((width, height), Image.Resampling.BOX)
    return np.asarray(img, dtype=np.uint8)


def image_digest(img: Image.Image, salt: str = "") -> str:
    """A content hash of the decoded pixels (and `salt`: what else shapes the embeddings), so
    the same picture sent as PNG or as a lossless WebP shares the encoder and prefix caches."""
    h = hashlib.sha256()
    h.update(f"{salt}\x00{img.mode}\x00{img.width}x{img.height}\x00".encode())
    h.update(img.tobytes())
    return h.hexdigest()


def _looks_like_svg(data: bytes) -> bool:
    head = data[:1024].lstrip().lower()
    return head.startswith((b"<svg", b"<?xml")) or b"<svg" in head
