"""Real-time factor of `localllm music` next to transformers' MusicGen on the same weights, in
the same run: a random-weight folder of the real musicgen-small (or -medium) shape is made once
with transformers (`--dir`), then each implementation makes `--seconds` of audio with MusicGen's
default sampling (top-k 250, guidance 3) and the time is divided by the audio's length.

    python tests/perf/bench_music.py --threads 2 --seconds 10 [--size small|medium] [--runs 2]
    python tests/perf/bench_music.py --device cuda --impls ours,ours-eager,hf --size medium

On CUDA each implementation first makes 0.5 s (CUDA context, kernels) outside the timing; ours
runs its captured decode graph (`ours-eager`: the same step without the graph).

The prompt is tokenized with the tiny test tokenizer (its ids are valid T5 ids); the weights are
transformers' random init (its EnCodec codebooks are zeros: the audio is silence, the work the
same). Prints one JSON object per measurement and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "tests" / "data" / "music" / "musicgen"
PROMPT = "80s pop track with bassy drums and synth"
SHAPES = {  # the published facebook/musicgen-* decoders; all use t5-base and encodec_32khz
    "small": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, ffn_dim=4096),
    "medium": dict(hidden_size=1536, num_hidden_layers=48, num_attention_heads=24, ffn_dim=6144),
}


def make_folder(path: Path, size: str, device: str = "cpu") -> None:
    from transformers import (
        EncodecConfig,
        MusicgenConfig,
        MusicgenDecoderConfig,
        MusicgenForConditionalGeneration,
        T5Config,
    )

    if (path / "config.json").is_file():
        return
    t5 = T5Config(vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_heads=12,
                  feed_forward_proj="relu")  # fmt: skip
    codec = EncodecConfig(
        sampling_rate=32000, num_filters=64, hidden_size=128, upsampling_ratios=[8, 5, 4, 4],
        codebook_size=2048, target_bandwidths=[2.2], use_causal_conv=False,
        use_conv_shortcut=False, num_lstm_layers=2,
    )  # fmt: skip
    dec = MusicgenDecoderConfig(vocab_size=2048, num_codebooks=4, max_position_embeddings=2048,
                                pad_token_id=2048, bos_token_id=2048, **SHAPES[size])  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU is much faster for -medium
        model = MusicgenForConditionalGeneration(
            MusicgenConfig(text_encoder=t5, audio_encoder=codec, decoder=dec)
        )
    model.save_pretrained(path)
    del model
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, path / name)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_ours(path: Path, seconds: float, seed: int, device: str = "cpu", dtype=torch.float32,
               steps: str = "auto") -> dict:  # fmt: skip
    from localllm.media.music import MusicGen, SamplingOptions

    t0 = time.perf_counter()
    model = MusicGen(path, device=device, dtype=dtype)
    model.steps = steps
    load = time.perf_counter() - t0
    if device == "cuda":  # CUDA context, cuBLAS handles, kernels: outside the timing
        model.generate(PROMPT, 0.5, SamplingOptions(seed=seed))
    _sync(device)
    t1 = time.perf_counter()
    music = model.generate(PROMPT, seconds, SamplingOptions(seed=seed))
    _sync(device)
    took = time.perf_counter() - t1
    how = ["graph" if steps == "auto" and device == "cuda" else steps if steps != "auto" else ""]
    how += [] if dtype == torch.float32 else [f"LM in {str(dtype)[6:]}"]
    name = "localllm" + (f" ({', '.join(h for h in how if h)})" if any(how) else "")
    return {"impl": name, "load_s": load, "gen_s": took, "audio_s": music.seconds}


def bench_transformers(path: Path, seconds: float, seed: int, device: str = "cpu",
                       dtype=torch.float32) -> dict:  # fmt: skip
    from transformers import AutoTokenizer, MusicgenForConditionalGeneration

    t0 = time.perf_counter()
    model = MusicgenForConditionalGeneration.from_pretrained(path, dtype=dtype).to(device).eval()
    tok = AutoTokenizer.from_pretrained(path)
    load = time.perf_counter() - t0
    ids = tok(PROMPT, return_tensors="pt").input_ids.to(device)

    def run(frames: int):
        with torch.no_grad():
            return model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=250,
                guidance_scale=3.0, max_new_tokens=frames + 3,
            )  # fmt: skip

    torch.manual_seed(seed)
    if device == "cuda":
        run(25)
    _sync(device)
    t1 = time.perf_counter()
    audio = run(round(seconds * 50))
    _sync(device)
    took = time.perf_counter() - t1
    name = "transformers" + ("" if dtype == torch.float32 else f" (all in {str(dtype)[6:]})")
    return {"impl": name, "load_s": load, "gen_s": took, "audio_s": audio.shape[-1] / 32000}


IMPLS = {  # name: (function, keyword arguments)
    "ours": (bench_ours, {}),
    "ours-bf16": (bench_ours, {"dtype": torch.bfloat16}),
    "ours-eager": (bench_ours, {"steps": "cached"}),  # CUDA without the graph
    "ours-fp16": (bench_ours, {"dtype": torch.float16}),
    "hf": (bench_transformers, {}),
    "hf-bf16": (bench_transformers, {"dtype": torch.bfloat16}),
    "hf-fp16": (bench_transformers, {"dtype": torch.float16}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SHAPES), default="small")
    ap.add_argument("--dir", type=Path, default=None, help="the random-weight folder (made once)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=1, help="alternating runs of each")
    ap.add_argument("--impls", default="ours,ours-bf16,hf", help=f"of {', '.join(IMPLS)}")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.dir or Path(f"/tmp/musicgen-{args.size}-random")
    t0 = time.perf_counter()
    make_folder(path, args.size, args.device)
    print(json.dumps({"folder": str(path), "made_s": round(time.perf_counter() - t0, 1)}))
    rows = []
    for run in range(args.runs):
        for fn, kw in (IMPLS[name] for name in args.impls.split(",")):
            load0, cpu0 = os.getloadavg()[0], time.process_time()
            r = fn(path, args.seconds, run, args.device, **kw)
            r["cpu_s"] = time.process_time() - cpu0  # this process's CPU time, loading included
            r.update(run=run, size=args.size, threads=args.threads, rtf=r["gen_s"] / r["audio_s"],
                     load=(load0 + os.getloadavg()[0]) / 2)  # fmt: skip
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
            rows.append(r)
    cpu = platform.processor() or platform.machine()
    if args.device == "cuda":
        cpu = torch.cuda.get_device_name()
    print(f"\n{cpu}, torch {torch.__version__}, {args.threads} threads, "
          f"musicgen-{args.size} shape, {args.seconds:g} s of audio\n")  # fmt: skip
    print("| run | implementation | load s | generate s | RTF | load average |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['impl']} | {r['load_s']:.1f} | {r['gen_s']:.1f} | "
              f"{r['rtf']:.2f} | {r['load']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
