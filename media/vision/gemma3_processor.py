"""Gemma 3 image preprocessing and prompt layout, equal to transformers' `Gemma3ImageProcessorPil`
(pan-and-scan off, its default) and `Gemma3Processor`.

An image is resized to the tower's square `image_size` (896 for the released models) with
Pillow's BILINEAR on uint8 pixels, whatever its aspect ratio; pixels are then rescaled by 1/255
(in float64, stored as float32) and normalized with the mmproj's mean/std. The chat template
writes `<start_of_image>` for an image; the processor replaces it by
`\\n\\n<start_of_image>` + `<image_soft_token>` x tokens + `<end_of_image>\\n\\n`, and the soft
tokens are the image's span (the text model attends over them both ways: `engine.models.gemma3`).
"""

import numpy as np
from PIL import Image

from localllm.media.vision.gemma3 import ModelArgs

RESCALE = 1 / 255
BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"


class Processor:
    image_token = BOI  # what the chat template writes for an image
    embed_token = SOFT  # the tokens whose embeddings the image replaces
    special_tokens = (BOI, EOI, SOFT)  # the vocabulary must have each as one token

    def __init__(self, args: ModelArgs):
        self.args = args
        self.size = args.tower.image_size
        self.mean = np.array(args.image_mean, dtype=np.float32)
        self.std = np.array(args.image_std, dtype=np.float32)
        # what else shapes the embeddings of given pixels (content hashes include it)
        self.salt = f"gemma3:{self.size}:{args.image_mean}:{args.image_std}"

    def preprocess(self, img: Image.Image) -> tuple[np.ndarray, None]:
        """An RGB image -> (pixel values [1, 3, S, S] float32, no layout: one view)."""
        img = img.resize((self.size, self.size), Image.Resampling.BILINEAR)
        px = np.asarray(img, dtype=np.uint8).transpose(2, 0, 1)[None]
        px = (px.astype(np.float64) * RESCALE).astype(np.float32)
        px = (px - self.mean[:, None, None]) / self.std[:, None, None]
        return px, None

    def num_tokens(self, layout: None) -> int:
        return self.args.tokens_per_image

    def placeholder(self, layout: None) -> str:
        """The text that stands for one image in the prompt."""
        return f"\n\n{BOI}{SOFT * self.args.tokens_per_image}{EOI}\n\n"

    def layout_tokens(self, layout: None) -> tuple[str, ...]:
        return ()
