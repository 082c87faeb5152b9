"""Top-k expert routing: which experts each token visits and with what weight.

`route_topk_reference` is the literal recipe (softmax over all experts, top-k, optional
renormalisation: Qwen3-MoE, Mixtral, llama.cpp's `norm_w`); `route_topk` is the fast path that
selects on the raw logits (softmax is monotonic) and normalises only the k chosen values.
"""

import torch


def route_topk_reference(
    logits: torch.Tensor, k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) from router logits [T, E]."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_topk(
    logits: torch.Tensor, k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as the reference without the full softmax when the weights are renormalised:
    softmax over the k selected logits equals the renormalised top-k probabilities."""
    logits = logits.float()
    top, ids = torch.topk(logits, k, dim=-1)
    if norm_topk_prob:
        return torch.softmax(top, dim=-1), ids
    return torch.exp(top - torch.logsumexp(logits, dim=-1, keepdim=True)), ids
