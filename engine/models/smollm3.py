"""The `smollm3` GGUF architecture: SmolLM3 (3B).

Llama's decoder (RMSNorm, GQA attention with NORM rope on the converter-permuted Q/K, SwiGLU, tied
output when `output.weight` is absent) except that every fourth layer ((il + 1) % 4 == 0) has no
rope at all (NoPE): its queries and keys attend by content alone. The GGUF carries no key for this;
llama.cpp fixes the step at 4 (`n_no_rope_layer_step`), which is what the released model's
`no_rope_layers` says.
"""

import torch

from localllm.engine.models import llama
from localllm.engine.models.decoder import Decoder

ModelArgs = llama.ModelArgs
NOPE_STEP = 4


def unrotated(cos_sin: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """cos = 1, sin = 0 for every position: rope that leaves q and k as they are, so a NoPE layer
    runs the same (fused) rope-attention path as its neighbours."""
    cos, sin = cos_sin
    return torch.ones_like(cos), torch.zeros_like(sin)


class Block(llama.Block):
    def __init__(self, args: ModelArgs, rope: bool, precise: bool):
        super().__init__(args, precise)
        self.rope = rope

    def forward(self, x, r, positions, cos_sin, rotary, batch, kv, layer):
        if not self.rope:
            cos_sin = unrotated(cos_sin)
        return super().forward(x, r, positions, cos_sin, rotary, batch, kv, layer)


class Model(llama.Model):
    def __init__(self, args: ModelArgs, precise: bool = False):
        # (llama.Model's own constructor only numbers MoE layers, which SmolLM3 has none of)
        ropes = [(i + 1) % NOPE_STEP != 0 for i in range(args.n_layers)]
        Decoder.__init__(self, args, [Block(args, r, precise) for r in ropes], precise)
