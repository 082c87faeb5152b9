"""The skeleton every decoder family shares: embedding, a stack of blocks, final norm, output head.

Families subclass `Decoder`, pass their blocks and set up rope in `finish_load`; everything
architecture-specific stays in the family file.
"""

from typing import ClassVar

import torch
from torch import nn

from localllm.engine.core.batch import BatchMeta
from localllm.engine.layers.linear import QuantLinear
from localllm.engine.layers.native_decode import NativeDecode, split_step
from localllm.engine.layers.rope import Rotary
from localllm.engine.layers.shared import QuantEmbedding, RMSNorm
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.kernels.fused import WeightedRows
from localllm.kernels.quant.linear_native import prompt_rows


class Decoder(nn.Module):
    # GGUF names the MLP tensors at block level; GatedMLP sits one module deeper.
    tensor_aliases: ClassVar[dict[str, str]] = {
        "ffn_gate": "mlp.ffn_gate",
        "ffn_up": "mlp.ffn_up",
        "ffn_down": "mlp.ffn_down",
    }
    optional_tensors: ClassVar[tuple[str, ...]] = ("output.weight",)
    takes_embeds: ClassVar[bool] = True  # the forward splices `batch.embeds` (images) in

    def __init__(self, args, blocks: list[nn.Module], precise: bool = False):
        super().__init__()
        self.args = args
        self.token_embd = QuantEmbedding(args.vocab_size, args.dim)
        self.blk = nn.ModuleList(blocks)
        self.output_norm = RMSNorm(args.dim, args.norm_eps)
        self.output = QuantLinear(args.dim, args.vocab_size, precise)
        self.rotary: Rotary | None = None
        self._native_step = None  # `NativeDecode` (CPU steps in one native call), False: none

    def tie_output(self) -> None:
        """Reuse the embedding table as the output head when the file has no `output.weight`."""
        if not self.output.loaded:
            self.output.load_tensor("weight", self.token_embd.weight)

    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) for the runner's cache allocation."""
        return self.args.n_layers, self.args.n_kv_heads, self.args.head_dim

    def kv_value_dim(self) -> int | None:
        """Width of a cached V row when it differs from K's (deepseek2's latent), else None."""
        return getattr(self.args, "v_cache_dim", None)

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, batch: BatchMeta, kv: PagedKVCache
    ) -> torch.Tensor:
        """Hidden states [T, dim] after the final norm."""
        x = self.native_decode(ids, positions, batch, kv)
        if x is not None:
            return self.output_norm(x)
        h = self.native_split(ids, positions, batch, kv)
        if h is not None:
            return h
        x = batch.splice(self.token_embd(ids))
        cos_sin = self.rotary.cos_sin(positions)
        r = None  # a block's last output not yet added to the stream (see `defers_residual`)
        for i, blk in enumerate(self.blk):
            if getattr(blk, "defers_residual", False):
                x, r = blk(x, r, positions, cos_sin, self.rotary, batch, kv, i)
                continue
            if r is not None:  # a block that adds its input itself: sum a pending output now
                x, r = x + (r.total().to(x.dtype) if isinstance(r, WeightedRows) else r), None
            x = blk(x, positions, cos_sin, self.rotary, batch, kv, i)
        if r is not None:
            return self.output_norm.residual(x, r)[1]
        return self.output_norm(x)

    def native_decode(self, ids: torch.Tensor, positions: torch.Tensor, batch: BatchMeta, kv):
        """The stream after the last layer [T, dim] from one native call on CPU decode steps
        (`engine.layers.native_decode`; families whose blocks it knows), else None."""
        if ids.is_cuda:
            return None
        if self._native_step is None:
            self._native_step = NativeDecode.for_model(self) or False
        return self._native_step(ids, positions, batch, kv) if self._native_step else None

    def native_split(self, ids: torch.Tensor, positions: torch.Tensor, batch: BatchMeta, kv):
        """Hidden states [T, dim] of a CPU step mixing decode and prompt rows, the decode rows
        through the native step and the rest through `forward` (`native_decode.split_step`),
        else None."""
        if ids.is_cuda or not self._native_step:
            return None
        parts = split_step(batch, self)
        if parts is None:
            return None
        drows, dbatch, rrows, rbatch = parts
        x = self._native_step(ids[drows], positions[drows], dbatch, kv)
        if x is None:
            return None
        with prompt_rows(rbatch.prompt_mask()):  # (the step's mask covered all its rows)
            rest = self.forward(ids[rrows], positions[rrows], rbatch, kv)
        out = rest.new_empty(ids.shape[0], rest.shape[-1])
        out[drows] = self.output_norm(x).to(rest.dtype)
        out[rrows] = rest
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(hidden)
