"""Time per decode step of `localllm music` with its native CPU linears, the same step with
torch's linears (the code before them), and transformers' MusicGen, in one process on the same
weights, alternating: `FRAMES` frames each (T5 and EnCodec included), the faster round kept.

    python tests/perf/bench_music_step.py [THREADS] [ROUNDS] [FRAMES]   # defaults 2 2 10

The folder is bench_music.py's random-weight musicgen-small (made there first).
"""

import sys
import time

import torch

from localllm.media.music import MusicGen, SamplingOptions

PATH = "/tmp/musicgen-small-random"
PROMPT = "80s pop track"


def main() -> None:
    threads, rounds, frames = (
        int(a) for a in (sys.argv[1:] + ["2", "2", "10"][len(sys.argv) - 1 :])
    )
    torch.set_num_threads(threads)
    from transformers import AutoTokenizer, MusicgenForConditionalGeneration

    ours = MusicGen(PATH)
    hf = MusicgenForConditionalGeneration.from_pretrained(PATH).eval()
    ids = AutoTokenizer.from_pretrained(PATH)(PROMPT, return_tensors="pt").input_ids
    opts = SamplingOptions(seed=0)

    def run_ours(native: bool) -> float:
        kernel = ours.lm.gemv
        ours.lm.gemv = kernel if native else None
        t = time.perf_counter()
        ours.codes(PROMPT, frames, opts)
        ours.lm.gemv = kernel
        return (time.perf_counter() - t) / (frames + 3)

    def run_hf() -> float:
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                        top_k=250, guidance_scale=3.0, max_new_tokens=frames + 3)  # fmt: skip
        return (time.perf_counter() - t) / (frames + 3)

    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, fn in (("ours-torch", lambda: run_ours(False)),
                         ("ours-native", lambda: run_ours(True)), ("hf", run_hf)):  # fmt: skip
            best[name] = min(best.get(name, float("inf")), fn())
        print({k: round(v * 1e3, 1) for k, v in best.items()}, flush=True)


if __name__ == "__main__":
    main()
