"""The mixture-of-experts FFN shared by MoE families: router, top-k routing, grouped experts.

Submodules are named after the GGUF tensors (`ffn_gate_inp`, `ffn_gate_exps`, `ffn_up_exps`,
`ffn_down_exps`) so the loader's name walk fills them. Expert weights are not multiplied from
here directly: after loading, `attach(source)` gives the block an `ExpertSource` (resident
slices, or the disk-streaming slot cache) chosen by the residency plan; the math lives in
`kernels.moe`.
"""

import torch
from torch import nn

from localllm.engine.layers import QuantLinear
from localllm.kernels.moe import ExpertBlocks, ExpertFormat, expert_ffn_grouped, route_topk
from localllm.offload import QuantWeight
from localllm.offload.expert_cache import ExpertSource, ResidentExperts

EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


class ExpertTensor(nn.Module):
    """One `ffn_*_exps` tensor: [n_expert, rows, cols] raw ggml blocks, one slice per expert."""

    def __init__(self, n_expert: int, rows: int, cols: int):
        super().__init__()
        self.shape = (n_expert, rows, cols)
        self.weight: QuantWeight | None = None

    def load_tensor(self, suffix: str, w: QuantWeight) -> None:
        if suffix != "weight" or tuple(w.shape) != self.shape:
            raise ValueError(f"expected expert weight {self.shape}, got {tuple(w.shape)}")
        self.weight = w

    @property
    def loaded(self) -> bool:
        return self.weight is not None


class MoEFeedForward(nn.Module):
    """Routed experts: softmax top-k over `ffn_gate_inp` logits, then the grouped expert FFN."""

    def __init__(
        self,
        layer: int,
        dim: int,
        hidden: int,
        n_expert: int,
        n_used: int,
        norm_topk_prob: bool = True,
        act: str = "silu",
        precise: bool = False,
    ):
        super().__init__()
        self.layer, self.dim, self.hidden = layer, dim, hidden
        self.n_used, self.norm_topk_prob, self.act = n_used, norm_topk_prob, act
        # The router decides which experts run: keep it fp32 so routing never flips on rounding.
        self.ffn_gate_inp = QuantLinear(dim, n_expert, precise=True)
        self.ffn_gate_exps = ExpertTensor(n_expert, hidden, dim)
        self.ffn_up_exps = ExpertTensor(n_expert, hidden, dim)
        self.ffn_down_exps = ExpertTensor(n_expert, dim, hidden)
        self.format: ExpertFormat | None = None
        self.source: ExpertSource | None = None

    def expert_weights(self) -> tuple[QuantWeight, QuantWeight, QuantWeight]:
        return self.ffn_gate_exps.weight, self.ffn_up_exps.weight, self.ffn_down_exps.weight

    def fuse(self) -> None:
        """Set the expert format and, unless a plan attached another source, resident experts."""
        g, u, d = self.expert_weights()
        self.format = ExpertFormat(g.qtype, u.qtype, d.qtype, self.dim, self.hidden, self.act)
        if self.source is None:
            self.attach(ResidentExperts({self.layer: (g.data, u.data, d.data)}))

    def attach(self, source: ExpertSource) -> None:
        self.source = source

    def fetch(self, expert: int) -> ExpertBlocks:
        return self.source.fetch(self.layer, expert)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) for hidden states x [T, dim]."""
        logits = self.ffn_gate_inp(x.reshape(-1, self.dim))
        return route_topk(logits, self.n_used, self.norm_topk_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        self.source.routed(self.layer, ids)
        y = expert_ffn_grouped(x.reshape(-1, self.dim), weights, ids, self.fetch, self.format)
        return y.reshape(x.shape).to(x.dtype)
