"""MoE math: expert routing and grouped expert matmul (torch reference + fast paths)."""

from localllm.kernels.moe.experts import (
    ExpertBiases,
    ExpertBlocks,
    ExpertFormat,
    expert_ffn_grouped,
    expert_ffn_reference,
    group_by_expert,
)
from localllm.kernels.moe.routing import route_scored, route_topk, route_topk_reference

__all__ = [
    "ExpertBiases",
    "ExpertBlocks",
    "ExpertFormat",
    "expert_ffn_grouped",
    "expert_ffn_reference",
    "group_by_expert",
    "route_scored",
    "route_topk",
    "route_topk_reference",
]
