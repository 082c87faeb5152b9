"""Beam search over one 30-second window: CTranslate2's algorithm, the one faster-whisper runs.

Each step scores every live beam's next tokens (Whisper's logit rules, log-softmax, plus the
beam's running sum) and takes the best 2 x beam_size candidates over all beams. It walks the first
beam_size of them: an end token (or the last step) finishes that hypothesis, and the best unused
non-end candidate from the second half takes its beam. The search stops once
round(beam_size x patience) hypotheses have finished (with no length penalty: once the top
candidate has ended); the winner has the best sum_logprob / length ** length_penalty.

openai-whisper's BeamSearchDecoder differs in two details: it draws beam_size + 1 candidates per
beam and keeps every end-token candidate among them, and its length penalty, when set, is
((5 + length) / 6) ** penalty. With the defaults (beam 5, patience 1, penalty 1 = plain average)
the two agree on most windows; we follow CTranslate2 so that the same weights give the same text.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from localllm.media.stt.model import KVCache, Whisper

# rules(logits [vocab] float32 on the CPU, tokens decoded so far): Whisper's filters, in place
Rules = Callable[[torch.Tensor, list[int]], None]


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its tokens (no end token), their log-probability and its rank score."""

    tokens: tuple[int, ...]
    sum_logprob: float  # including the end token's, when it ended with one
    score: float  # sum_logprob / len(tokens) ** length_penalty


def _finish(tokens: list[int], total: float, length_penalty: float) -> Hypothesis:
    denom = len(tokens) ** length_penalty
    # an empty hypothesis scores -inf unless no length penalty applies (0 ** 0 == 1)
    return Hypothesis(tuple(tokens), total, total / denom if denom else -math.inf)


def best_hypothesis(hypotheses: list[Hypothesis]) -> Hypothesis:
    """The best-scoring hypothesis; on a tie, the one that finished first."""
    return max(hypotheses, key=lambda h: h.score)


@torch.inference_mode()
def beam_search(
    model: Whisper,
    cache: KVCache,
    logits: torch.Tensor,
    rules: Rules,
    eot: int,
    beam_size: int,
    patience: float,
    length_penalty: float,
    max_len: int,
) -> list[Hypothesis]:
    """Every hypothesis that finished, in the order they did. `cache` holds one row (the prompt
    and the audio); `logits` [vocab] are the prompt's next-token logits; at most `max_len` tokens
    are decoded, the end token included."""
    n_cand = 2 * beam_size  # half may end: the other half refills their beams
    max_finished = math.floor(beam_size * patience + 0.5)  # C++ std::round
    device = logits.device
    seqs: list[list[int]] = [[]]
    sums = torch.zeros(1)
    step_logits = logits[None]
    finished: list[Hypothesis] = []
    top_finished = False
    for step in range(max_len):
        rows = step_logits.float().cpu()
        for row, seq in zip(rows, seqs, strict=True):
            rules(row, seq)
        vocab = rows.shape[-1]
        total = (sums[:, None] + rows.log_softmax(-1)).flatten()
        top, flat = total.topk(min(n_cand, total.numel()))
        src, tok = (flat // vocab).tolist(), (flat % vocab).tolist()
        last = step + 1 == max_len
        keep, spare = [], beam_size
        for k in range(min(beam_size, len(tok))):
            pick = k
            if tok[k] == eot or last:
                top_finished |= k == 0
                ended = seqs[src[k]] + ([] if tok[k] == eot else [tok[k]])
                finished.append(_finish(ended, float(top[k]), length_penalty))
                for j in range(spare, len(tok)):
                    if tok[j] != eot:
                        pick, spare = j, j + 1
                        break
            keep.append(pick)
        # with no length penalty no later hypothesis can outrank an ended top beam
        done = top_finished if length_penalty == 0 else len(finished) >= max_finished
        if last or done:
            break
        parents = [src[j] for j in keep]
        if parents != list(range(len(seqs))):  # rows that stay in place need no copy
            model.reorder(cache, torch.tensor(parents, device=device))
        seqs = [seqs[src[j]] + [tok[j]] for j in keep]
        sums = top[keep]
        nxt = torch.tensor([[tok[j]] for j in keep], device=device)
        step_logits = model.decoder(nxt, cache)[:, -1]
    return finished
