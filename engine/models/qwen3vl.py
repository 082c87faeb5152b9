"""The `qwen3vl` GGUF architecture: the text model of Qwen3-VL.

Qwen3's decoder (per-head q/k norms) with interleaved M-RoPE (`rope.dimension_sections` over the
frequencies t,h,w,t,h,w,...; llama.cpp's IMROPE) and deepstack: an image's embeddings arrive
`n_deepstack_layers + 1` times as wide as the model (the vision tower's main embedding, then one
per deepstack merger); the main part replaces the placeholder tokens' embeddings and part i is
added to the hidden states of those tokens after layer i.
"""

from dataclasses import dataclass
from typing import Any

import torch

from localllm.engine.layers.rope import MRotary, RopeConfig
from localllm.engine.models import qwen2, qwen2vl, qwen3
from localllm.engine.models.common import arch_key
from localllm.engine.models.hparams import HyperparameterError
from localllm.kernels.fused import WeightedRows


@dataclass(frozen=True)
class ModelArgs(qwen2vl.ModelArgs):
    n_deepstack: int = 0

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], vocab_size: int) -> "ModelArgs":
        base = qwen2vl.ModelArgs.from_gguf(meta, vocab_size)
        n = int(arch_key(meta)("n_deepstack_layers", 0))
        return cls(**vars(base), n_deepstack=n)

    def check(self) -> None:
        super().check()
        if not 0 <= self.n_deepstack <= self.n_layers:
            raise HyperparameterError(
                f"n_deepstack_layers {self.n_deepstack} is not within the {self.n_layers} layers"
            )


class Model(qwen2.Model):
    block_cls = qwen3.Block
    mrope = True  # prompts with images need `RopePositions` (engine.multimodal)

    @property
    def mm_width(self) -> int:
        """The width of a multimodal embedding row: main + one per deepstack layer."""
        return self.args.dim * (1 + self.args.n_deepstack)

    def finish_load(self, extra) -> None:
        super().finish_load(extra)
        a = self.args
        cfg = RopeConfig(a.head_dim, a.rope_base, neox=True, linear_scale=a.rope_linear_scale)
        self.rotary = MRotary(cfg, a.rope_sections, interleaved=True)

    def forward(self, ids, positions, batch, kv) -> torch.Tensor:
        if batch.embeds is None or not self.args.n_deepstack:
            return super().forward(ids, positions, batch, kv)
        return deepstack_forward(self, ids, positions, batch, kv)


def deepstack_forward(model, ids, positions, batch, kv) -> torch.Tensor:
    """A `Decoder` forward (blocks that defer their residual) whose multimodal rows carry
    deepstack parts: part i is added to those rows' hidden states after layer i."""
    rows, values = batch.embeds
    d = model.args.dim
    x = model.token_embd(ids)
    x = x.index_copy(0, rows, values[:, :d].to(x.dtype))
    cos_sin = model.rotary.cos_sin(positions)
    r = None
    for i, blk in enumerate(model.blk):
        x, r = blk(x, r, positions, cos_sin, model.rotary, batch, kv, i)
        if i < model.args.n_deepstack:  # the pending output first, then this layer's part
            pending = r.total().to(x.dtype) if isinstance(r, WeightedRows) else r
            x = (x + pending).index_add(0, rows, values[:, d * (i + 1) : d * (i + 2)].to(x.dtype))
            r = None
    if r is not None:
        return model.output_norm.residual(x, r)[1]
    return model.output_norm(x)
