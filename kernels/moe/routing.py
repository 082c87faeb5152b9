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


def route_scored(
    logits: torch.Tensor,
    k: int,
    scoring: str = "softmax",
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    norm: bool = True,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek routing (llama.cpp's build_moe_ffn): softmax or sigmoid scores; `bias`
    (V3's exp_probs_b) shifts only the choice; with groups, only the `topk_group` groups whose
    two best choice scores sum highest compete; weights are the unbiased scores of the chosen,
    optionally renormalised, times `scale`. Returns (weights [T, k] float32, ids [T, k])."""
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        t, e = choice.shape
        best = choice.view(t, n_group, e // n_group).topk(2, dim=-1)[0].sum(-1)  # [T, groups]
        keep = torch.zeros_like(best, dtype=torch.bool)
        keep.scatter_(1, best.topk(topk_group, dim=-1)[1], True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), -torch.inf)
    ids = choice.topk(k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scale, ids
