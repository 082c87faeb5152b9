"""Encode time of a Qwen2.5-VL-7B-shaped vision tower (random F16 weights, built in memory): one
image of SIDE x SIDE pixels preprocessed as Qwen2VLImageProcessor does, then the tower + merger,
best of R runs after a warm-up. Prints a Markdown row for tests/perf/results/vision.md.

    python tests/perf/bench_vision_qwen.py --device cuda --side 1024 -r 3
"""

import argparse
import time

import numpy as np
import torch
from PIL import Image

from localllm.engine.layers.linear import QuantLinear
from localllm.engine.layers.shared import RMSNorm
from localllm.kernels.quant import QuantType
from localllm.media.vision.qwen25vl import Model, ModelArgs, PatchEmbedding, SecondFrame
from localllm.media.vision.qwen25vl_processor import Processor
from localllm.offload import QuantWeight

# Qwen2.5-VL-7B-Instruct's vision_config (depth 32, 1280 wide, 16 heads, MLP 3420, window 112,
# full attention every 8th block) projecting to the 3584-wide text model
SHAPE_7B = dict(dim=1280, hidden_dim=3420, n_layers=32, n_heads=16, patch_size=14, norm_eps=1e-6,
                out_dim=3584, wa_pattern=8, window=112,
                image_mean=(0.48145466, 0.4578275, 0.40821073),
                image_std=(0.26862954, 0.26130258, 0.27577711))  # fmt: skip


def f16(shape, device, scale=0.02) -> QuantWeight:
    t = (torch.randn(shape) * scale).to(torch.float16).to(device)
    return QuantWeight(t.view(torch.uint8), QuantType.F16, tuple(shape))


def build(device) -> Model:
    torch.manual_seed(0)
    model = Model(ModelArgs(**SHAPE_7B))
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.load_tensor("weight", f16((m.out_features, m.in_features), device))
            m.load_tensor("bias", f16((m.out_features,), device))
        elif isinstance(m, RMSNorm):
            m.load_tensor("weight", f16((m.weight.shape[0],), device, 1.0))
        elif isinstance(m, PatchEmbedding):
            m.load_tensor("weight", f16(m.shape, device))
        elif isinstance(m, SecondFrame):
            m.load_tensor("1", f16(m.shape, device))
    model.inv_freq = model.inv_freq.to(device)
    return model.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("-r", "--repeats", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device(args.device)
    model = build(dev)
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (args.side, args.side, 3), dtype=np.uint8))
    proc = Processor(model.args)
    t0 = time.perf_counter()
    patches, grid = proc.preprocess(img)
    prep = time.perf_counter() - t0
    x = torch.from_numpy(patches)
    times = []
    with torch.inference_mode():
        for _ in range(args.repeats + 1):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(x.to(dev), grid.thw)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print("| device | image | patches | tokens | preprocess ms | encode ms (best) | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {name} | {args.side}x{args.side} | {len(patches)} | {out.shape[0]} | "
          f"{prep * 1e3:.1f} | {min(times[1:]) * 1e3:.1f} | {peak:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
