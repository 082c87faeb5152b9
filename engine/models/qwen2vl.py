"""The `qwen2vl` GGUF architecture: the text model of Qwen2-VL / Qwen2.5-VL.

Qwen2's decoder with M-RoPE: `rope.dimension_sections` splits the rotary frequencies between the
temporal, height and width axes of a 3-row position (`layers.rope.MRotary`). Text tokens have
the three axes equal, which is plain rope; image and video tokens get their grid positions from
the request (`engine.multimodal.RopePositions`).
"""

from dataclasses import dataclass
from typing import Any

from localllm.engine.layers.rope import MRotary, RopeConfig
from localllm.engine.models import qwen2
from localllm.engine.models.common import arch_key
from localllm.engine.models.hparams import HyperparameterError


@dataclass(frozen=True)
class ModelArgs(qwen2.ModelArgs):
    rope_sections: tuple[int, ...] = ()

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], vocab_size: int) -> "ModelArgs":
        base = qwen2.ModelArgs.from_gguf(meta, vocab_size)
        sections = tuple(int(x) for x in arch_key(meta)("rope.dimension_sections"))
        return cls(**vars(base), rope_sections=sections)

    def check(self) -> None:
        if any(s < 0 for s in self.rope_sections) or sum(self.rope_sections) > self.head_dim // 2:
            raise HyperparameterError(
                f"rope.dimension_sections {list(self.rope_sections)} do not fit a head of "
                f"{self.head_dim} (at most {self.head_dim // 2} frequencies)"
            )


class Model(qwen2.Model):
    mrope = True  # prompts with images need `RopePositions` (engine.multimodal)

    def finish_load(self, extra) -> None:
        super().finish_load(extra)
        a = self.args
        cfg = RopeConfig(a.head_dim, a.rope_base, neox=True, linear_scale=a.rope_linear_scale)
        self.rotary = MRotary(cfg, a.rope_sections)
