"""How far the bfloat16 codebook LM (`--dtype bfloat16`, the `auto` choice on CPUs with native
bf16) is from float32 on the same weights and the same inputs: teacher-forced logits of every
step of one sampled float32 generation, their relative error, and how often the top code and the
top-250 set (MusicGen's default sampling) agree.

    python tests/perf/music_bf16_drift.py [--dir /tmp/musicgen-small-random] [--frames 100]

A folder from bench_music.py (random weights of the real shape) or a real checkpoint folder.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from localllm.media.music import MusicGen, SamplingOptions, delay
from localllm.media.music.steps import CachedSteps

PROMPT = "80s pop track with bassy drums and synth"


def step_logits(m: MusicGen, seq: torch.Tensor, start: int) -> torch.Tensor:
    """Guided logits (steps, K, vocab) of every step after `start`, the codes teacher-forced."""
    opts = SamplingOptions()
    cond = m._condition(m.tokenize(PROMPT), None, opts, cached=True)
    steps = CachedSteps(m.lm, cond, seq.shape[1])
    out = [steps.first(seq[:, :start])]
    for t in range(start + 1, seq.shape[1]):
        out.append(steps.next(seq[:, :t]))
    logits = torch.stack(out)  # (steps, 2, K, vocab)
    return logits[:, 1] + (logits[:, 0] - logits[:, 1]) * opts.guidance_scale


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/musicgen-small-random"))
    ap.add_argument("--frames", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    f32 = MusicGen(args.dir)
    with torch.inference_mode():
        codes = f32.codes(PROMPT, args.frames, SamplingOptions(seed=0))
        k = f32.config.decoder.num_codebooks
        pat = delay.pattern(args.frames, k, f32.channels, f32.config.decoder.pad_token_id, codes)
        start = delay.first_free(delay.pattern(args.frames, k, f32.channels, 0))
        a = step_logits(f32, pat, start)
        del f32
        b = step_logits(MusicGen(args.dir, dtype=torch.bfloat16), pat, start)
    rel = ((b - a).norm(dim=-1) / a.norm(dim=-1)).flatten()
    top = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    ka, kb = a.topk(250, dim=-1).indices, b.topk(250, dim=-1).indices
    pairs = zip(ka.flatten(0, 1), kb.flatten(0, 1), strict=True)
    overlap = torch.tensor([len(set(x.tolist()) & set(y.tolist())) / 250 for x, y in pairs])
    out = {"folder": str(args.dir), "steps": a.shape[0], "codebooks": a.shape[1]}
    out.update(logits_rel_err_mean=rel.mean().item(), logits_rel_err_max=rel.max().item(),
               top1_agree=top, top250_overlap_mean=overlap.mean().item())  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
