"""Qwen3-VL preprocessing: Qwen2.5-VL's (`qwen25vl_processor`) with Qwen3-VL's defaults (16-px
patches from the mmproj, so sides are multiples of 32; transformers' Qwen3-VL
preprocessor_config bounds: 65,536 to 16,777,216 pixels).
"""

from localllm.media.vision import qwen25vl_processor as base

MIN_PIXELS = 65_536
MAX_PIXELS = 16_777_216


class Processor(base.Processor):
    def __init__(self, args, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS, **kw):
        super().__init__(args, min_pixels, max_pixels, **kw)
        self.salt = "qwen3vl:" + self.salt
