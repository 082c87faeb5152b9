"""Gemma 3 vision costs on one device: (1) encode time of a Gemma-3-4B-shaped tower (SigLIP
so400m: 27 blocks, 1152 wide, 16 heads, MLP 4304, 896-px images in 14-px patches, pooled to 256
tokens, projected to 2560; random F16 weights built in memory) on one image, and (2) one layer's
prompt attention over a prompt holding a 256-token image, Gemma-3-4B's shape (8 query heads, 4 KV
heads, head dim 256, f16 keys): the chunk with the image span (flash prefill with spans on CUDA),
the same without spans, and the dense torch path with the span. Best of R runs after a warm-up;
prints Markdown rows for tests/perf/results/vision.md.

    python tests/perf/bench_vision_gemma3.py --device cuda -r 5 --prompt 1024
"""

import argparse
import dataclasses
import time

import numpy as np
import torch
from PIL import Image

from localllm.engine.layers.linear import QuantLinear
from localllm.engine.models.bert import LayerNorm
from localllm.kernels.attention.paged import _chunk, chunk_dense
from localllm.kernels.quant import QuantType
from localllm.media.vision.gemma3 import Model, ModelArgs
from localllm.media.vision.gemma3_processor import Processor
from localllm.media.vision.siglip import TowerArgs
from localllm.offload import QuantWeight

TOWER_4B = TowerArgs(dim=1152, hidden_dim=4304, n_layers=27, n_heads=16, image_size=896,
                     patch_size=14, norm_eps=1e-6)  # fmt: skip
ARGS_4B = ModelArgs(TOWER_4B, scale=4, out_dim=2560, image_mean=(0.5,) * 3, image_std=(0.5,) * 3)


def f16(shape, device, scale=0.02) -> QuantWeight:
    t = (torch.randn(shape) * scale).to(torch.float16).to(device)
    return QuantWeight(t.view(torch.uint8), QuantType.F16, tuple(shape))


def build(device, layers: int, image_size: int = TOWER_4B.image_size) -> Model:
    torch.manual_seed(0)
    t = dataclasses.replace(TOWER_4B, n_layers=layers, image_size=image_size)
    model = Model(dataclasses.replace(ARGS_4B, tower=t))
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.load_tensor("weight", f16((m.out_features, m.in_features), device))
            m.load_tensor("bias", f16((m.out_features,), device))
        elif isinstance(m, LayerNorm):
            m.load_tensor("weight", f16(tuple(m.weight.shape), device, 1.0))
            m.load_tensor("bias", f16(tuple(m.weight.shape), device))
    model.v.patch_embd.load_tensor("weight", f16(model.v.patch_embd.shape, device))
    model.v.patch_embd.load_tensor("bias", f16((t.dim,), device))
    model.v.position_embd.load_tensor("weight", f16(model.v.position_embd.shape, device))
    model.mm.soft_emb_norm.load_tensor("weight", f16((t.dim,), device, 1.0))
    model.mm.input_projection.load_tensor("weight", f16((t.dim, ARGS_4B.out_dim), device))
    return model.eval()


def best(fn, repeats: int, device) -> float:
    fn()  # warm-up (compiles, allocates)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens for the attention")
    ap.add_argument("-r", "--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=27, help="tower depth (fewer: a quick check)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    model = build(dev, args.layers)
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (1024, 768, 3), dtype=np.uint8))
    proc = Processor(model.args)

    def encode():
        px, _ = proc.preprocess(img)
        with torch.inference_mode():
            return model(torch.from_numpy(px).to(dev))

    assert tuple(encode().shape) == (256, 2560)
    enc = best(encode, args.repeats, dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"| Gemma-3-4B-shaped tower ({args.layers} blocks), 1024x768 image -> 256 tokens "
          f"| {name} | {enc * 1e3:.1f} ms |")  # fmt: skip

    t = args.prompt
    g = torch.Generator(device="cpu").manual_seed(1)
    q = torch.randn(t, 8, 256, generator=g).to(dev)
    k = torch.randn(t, 4, 256, generator=g).to(dev, torch.float16)
    v = torch.randn(t, 4, 256, generator=g).to(dev, torch.float16)
    span = [(t // 4, t // 4 + 256)]
    with torch.inference_mode():
        spans = best(lambda: _chunk(q, k, v, 0, 0.0625, None, None, None, span),
                     args.repeats, dev)  # fmt: skip
        plain = best(lambda: _chunk(q, k, v, 0, 0.0625, None, None), args.repeats, dev)
        dense = best(lambda: chunk_dense(q, k, v, 0, 0.0625, None, None, None, span),
                     args.repeats, dev)  # fmt: skip
    path = "flash prefill" if dev.type == "cuda" else "dense"
    print(f"| one layer's prompt attention, {t} tokens, a 256-token image span ({path}) | {name} "
          f"| {spans * 1e3:.2f} ms |")  # fmt: skip
    print(f"| the same without spans ({path}) | {name} | {plain * 1e3:.2f} ms |")
    print(f"| the same with the span, dense torch path | {name} | {dense * 1e3:.2f} ms |")


if __name__ == "__main__":
    main()
