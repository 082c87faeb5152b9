"""Encode time of a Qwen2.5-VL-7B-shaped vision tower (random F16 weights, built in memory): one
image of SIDE x SIDE pixels preprocessed as Qwen2VLImageProcessor does, then the tower + merger,
best of R runs after a warm-up. Prints a Markdown row for tests/perf/results/vision.md. `--hf`
times transformers' `Qwen2_5_VisionTransformerPretrainedModel` of the same shape (float32, sdpa)
on the same patches, alternating with ours; `--layers N` keeps the first N blocks (CPU runs).

    python tests/perf/bench_vision_qwen.py --device cuda --side 1024 -r 3
    OMP_NUM_THREADS=2 python tests/perf/bench_vision_qwen.py --device cpu --side 448 --layers 8 --hf
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


def build(device, layers: int) -> Model:
    torch.manual_seed(0)
    model = Model(ModelArgs(**{**SHAPE_7B, "n_layers": layers}))
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
    ap.add_argument("--layers", type=int, default=SHAPE_7B["n_layers"])
    ap.add_argument("--hf", action="store_true", help="transformers' tower too, alternating")
    args = ap.parse_args()
    dev = torch.device(args.device)
    model = build(dev, args.layers)
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (args.side, args.side, 3), dtype=np.uint8))
    proc = Processor(model.args)
    t0 = time.perf_counter()
    patches, grid = proc.preprocess(img)
    prep = time.perf_counter() - t0
    x = torch.from_numpy(patches).to(dev)
    runs = {"ours": lambda: model(x, grid.thw)}
    if args.hf:
        hf = hf_tower(args.layers, dev)
        thw = torch.tensor([grid.thw])
        runs["transformers"] = lambda: hf(x, grid_thw=thw).pooler_output
    times = {k: [] for k in runs}
    with torch.inference_mode():
        for _ in range(args.repeats + 1):
            for name, run in runs.items():  # alternating: the box's noise hits both
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = run()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print("| device | image | blocks | patches | tokens | preprocess ms | tower | encode ms (best) "
          "| peak GiB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for tower, ts in times.items():
        print(f"| {name} | {args.side}x{args.side} | {args.layers} | {len(patches)} | "
              f"{out.shape[0]} | {prep * 1e3:.1f} | {tower} | {min(ts[1:]) * 1e3:.1f} | "
              f"{peak:.2f} |")  # fmt: skip


def hf_tower(layers: int, device):
    """transformers' Qwen2.5-VL vision tower of the same shape (random weights, float32)."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    s = SHAPE_7B
    full = [i for i in (7, 15, 23, 31) if i < layers] or [layers - 1]
    cfg = Qwen2_5_VLVisionConfig(
        depth=layers, hidden_size=s["dim"], intermediate_size=s["hidden_dim"],
        num_heads=s["n_heads"], out_hidden_size=s["out_dim"], fullatt_block_indexes=full,
        window_size=s["window"],
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return Qwen2_5_VisionTransformerPretrainedModel(cfg).to(device).eval()


if __name__ == "__main__":
    main()
