"""LLaVA-1.5 image preprocessing and prompt layout, equal to transformers'
`LlavaImageProcessorPil` / `CLIPImageProcessor` (llava-1.5-hf's settings: no padding to a
square) and `LlavaProcessor`.

The image's shortest edge is resized to the tower's `image_size` (336 for the released models)
with Pillow's BICUBIC on uint8 pixels, the other edge in ratio (truncated); the centre
`image_size` square is cropped (offsets rounded down); pixels are rescaled by 1/255 (in float64,
stored as float32) and normalized with the mmproj's mean/std. The chat template writes `<image>`
for an image; the processor repeats it once per patch ((336/14)^2 = 576 for the released ones).
"""

import numpy as np
from PIL import Image

from localllm.media.vision.llava import ModelArgs

RESCALE = 1 / 255
IMAGE = "<image>"


class Processor:
    image_token = IMAGE
    special_tokens = (IMAGE,)

    def __init__(self, args: ModelArgs):
        self.args = args
        self.size = args.tower.image_size
        self.mean = np.array(args.image_mean, dtype=np.float32)
        self.std = np.array(args.image_std, dtype=np.float32)
        self.salt = f"llava:{self.size}:{args.image_mean}:{args.image_std}"

    def preprocess(self, img: Image.Image) -> tuple[np.ndarray, None]:
        """An RGB image -> (pixel values [1, 3, S, S] float32, no layout: one view)."""
        s = self.size
        w, h = img.size
        if w <= h:
            w, h = s, int(s * h / w)
        else:
            w, h = int(s * w / h), s
        img = img.resize((w, h), Image.Resampling.BICUBIC)
        top, left = (h - s) // 2, (w - s) // 2
        px = np.asarray(img, dtype=np.uint8)[top : top + s, left : left + s].transpose(2, 0, 1)
        px = (px[None].astype(np.float64) * RESCALE).astype(np.float32)
        px = (px - self.mean[:, None, None]) / self.std[:, None, None]
        return px, None

    def num_tokens(self, layout: None) -> int:
        return self.args.tokens_per_image

    def placeholder(self, layout: None) -> str:
        return IMAGE * self.args.tokens_per_image

    def layout_tokens(self, layout: None) -> tuple[str, ...]:
        return ()
