"""The `qwen3vlmoe` GGUF architecture: the text model of Qwen3-VL MoE (Qwen3-VL-30B-A3B, ...).

Qwen3-MoE's decoder (`qwen3moe`) with Qwen3-VL's interleaved M-RoPE and deepstack rows
(`qwen3vl`): llama.cpp's converter writes the same keys as for `qwen3vl` plus the experts'.
"""

from dataclasses import dataclass
from typing import Any

import torch

from localllm.engine.layers.rope import MRotary, RopeConfig
from localllm.engine.models import qwen2vl, qwen3moe, qwen3vl
from localllm.engine.models.common import arch_key
from localllm.engine.models.hparams import HyperparameterError


@dataclass(frozen=True)
class ModelArgs(qwen3moe.ModelArgs):
    rope_sections: tuple[int, ...] = ()
    n_deepstack: int = 0

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], vocab_size: int) -> "ModelArgs":
        base = qwen3moe.ModelArgs.from_gguf(meta, vocab_size)
        k = arch_key(meta)
        return cls(
            **{f: getattr(base, f) for f in base.__dataclass_fields__},
            rope_sections=tuple(int(x) for x in k("rope.dimension_sections")),
            n_deepstack=int(k("n_deepstack_layers", 0)),
        )

    def check(self) -> None:
        super().check()
        qwen2vl.ModelArgs.check(self)  # the rope sections fit a head
        if not 0 <= self.n_deepstack <= self.n_layers:
            raise HyperparameterError(
                f"n_deepstack_layers {self.n_deepstack} is not within the {self.n_layers} layers"
            )


class Model(qwen3moe.Model):
    mrope = True  # prompts with images need `RopePositions` (engine.multimodal)

    @property
    def mm_width(self) -> int:
        return self.args.dim * (1 + self.args.n_deepstack)

    def finish_load(self, extra) -> None:
        super().finish_load(extra)
        a = self.args
        cfg = RopeConfig(a.head_dim, a.rope_base, neox=True, linear_scale=a.rope_linear_scale)
        self.rotary = MRotary(cfg, a.rope_sections, interleaved=True)

    def forward(self, ids, positions, batch, kv) -> torch.Tensor:
        if batch.embeds is None or not self.args.n_deepstack:
            return super().forward(ids, positions, batch, kv)
        return qwen3vl.deepstack_forward(self, ids, positions, batch, kv)
