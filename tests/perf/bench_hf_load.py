"""Load time and peak RSS of a Hugging Face folder against the same weights as GGUF.

    python tests/perf/bench_hf_load.py make DIR --llama-cpp /path/to/llama.cpp
    python tests/perf/bench_hf_load.py measure DIR [--reps 3]

`make` writes DIR/folder (a SmolLM2-135M-shaped Llama: 30 layers, width 576, FFN 1536, 9/3 heads,
vocabulary 49152, tied; random bf16 weights from transformers, the tiny test tokenizer padded)
and llama.cpp's conversions DIR/bf16.gguf and DIR/q8_0.gguf (`convert_hf_to_gguf.py --outtype`).
`measure` loads each case in a fresh process (open, tokenizer, `build_model`: what `LLMEngine`
does before sizing its KV cache) and prints a markdown row: wall seconds (best of --reps), peak
RSS (ru_maxrss, which includes one 16-token forward), RSS after load and after that forward
(mapped file pages count once read), all MiB.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = [  # label, path under DIR, --quantize ("-": import only, nothing loaded)
    ("nothing (imports only)", "-", None),
    ("folder bf16 (as stored)", "folder", None),
    ("GGUF bf16", "bf16.gguf", None),
    ("folder --quantize q8_0", "folder", "q8_0"),
    ("GGUF q8_0", "q8_0.gguf", None),
    ("folder --quantize f32", "folder", "f32"),
    ("folder --quantize q4_k", "folder", "q4_k"),
]

CHILD = """
import json, resource, sys, time
import psutil
t0 = time.perf_counter()
from localllm.engine.loader import build_model, load_tokenizer, open_weights
t_import = time.perf_counter() - t0
t0 = time.perf_counter()
if sys.argv[1] == "-":
    rss = psutil.Process().memory_info().rss / 2**20
    print(json.dumps({"wall": 0.0, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                      / 1024, "rss": rss, "used": rss}))
    sys.exit()
src = open_weights(sys.argv[1], sys.argv[2] if sys.argv[2] != "-" else None)
load_tokenizer(src).warm_up()
model = build_model(src)
if hasattr(src, "plan"):  # a folder: LLMEngine lets go of the mappings no weight views
    src.close()
import gc; gc.collect()
wall = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
now = psutil.Process().memory_info().rss / 2**20
import torch
from localllm.engine.core.batch import BatchMeta
from localllm.engine.runtime.kv_cache import PagedKVCache
layers, heads, hd = model.kv_shape()
kv = PagedKVCache(layers, 2, 16, heads, hd, dtype="f16")
with torch.inference_mode():  # one 16-token forward: every weight page read once
    model.logits(model(torch.arange(16), torch.arange(16), BatchMeta.contiguous(16, 16, 16), kv))
used = psutil.Process().memory_info().rss / 2**20
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"wall": wall, "peak": peak, "rss": now, "used": used, "import": t_import}))
"""


def make(out: Path, llama_cpp: Path) -> None:
    import importlib.util

    import torch
    import transformers

    spec = importlib.util.spec_from_file_location(
        "hf_fixtures", HERE.parent / "engine" / "hf_fixtures.py"
    )
    fx = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fx)
    cfg = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    folder = out / "folder"
    model.save_pretrained(folder)
    fx.tokenizer().save_pretrained(folder)
    boot = (HERE.parent / "tools" / "record_hf_fixtures.py").read_text()
    bootstrap = boot.split('BOOTSTRAP = """')[1].split('"""')[0]
    for kind in ("bf16", "q8_0"):
        cmd = [sys.executable, "-c", bootstrap, str(llama_cpp), str(folder),
               "--outfile", str(out / f"{kind}.gguf"), "--outtype", kind]  # fmt: skip
        subprocess.run(cmd, check=True)


def measure(out: Path, reps: int, only: str | None = None) -> None:
    print(
        f"| case | load s (best of {reps}) | RSS after load MiB | RSS after a 16-token "
        "forward MiB | peak RSS MiB |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, name, quant in CASES:
        if only and only not in label:
            continue
        runs = []
        for _ in range(reps):
            target = name if name == "-" else str(out / name)
            cmd = [sys.executable, "-c", CHILD, target, quant or "-"]
            res = subprocess.run(cmd, check=True, capture_output=True, text=True)
            runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
        best = min(runs, key=lambda r: r["wall"])
        peak = max(r["peak"] for r in runs)
        print(f"| {label} | {best['wall']:.2f} | {best['rss']:.0f} | {best['used']:.0f} | "
              f"{peak:.0f} |", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=("make", "measure"))
    ap.add_argument("dir", type=Path)
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp checkout (make)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", help="measure only the cases whose label contains this")
    args = ap.parse_args()
    if args.action == "make":
        make(args.dir, args.llama_cpp)
    else:
        measure(args.dir, args.reps, args.only)


if __name__ == "__main__":
    main()
