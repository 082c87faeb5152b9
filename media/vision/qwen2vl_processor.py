"""Qwen2-VL preprocessing: Qwen2.5-VL's (`qwen25vl_processor`: the same image and video
processors and prompt), except that a video's temporal M-RoPE positions count its temporal
patches one by one (transformers' Qwen2-VL `get_rope_index` has no time scaling)."""

from localllm.media.vision import qwen25vl_processor as base


class Processor(base.Processor):
    def __init__(self, args, *a, **kw):
        super().__init__(args, *a, **kw)
        self.salt = "qwen2vl:" + self.salt

    def time_step(self, grid) -> float:
        return 1  # one position per temporal patch, whatever the video's time
