"""Where a Gemma-3-4B-shaped SigLIP tower's encode time goes (27 blocks, 1152 wide, 16 heads of 72,
MLP 4304, 896-px images: 4,096 patches; random F16 weights, `bench_vision_gemma3.build`), and what
the opt-in half tower (`siglip.Tower.use_half`) changes:

1. the tower + projector on one image as shipped (float32: F16 weights widened per call in row
   tiles, `DequantTilesLinear` on CUDA), with TF32 matmuls allowed (torch's global switch, set for
   this line only), and with `use_half(float16)` / `use_half(bfloat16)`: best of R, and the half
   outputs' largest difference from the float32 ones;
2. one block's parts at the tower's shapes: `ffn_up` (4,096 x 1152 -> 4304) as shipped, as one
   float32 GEMM, TF32, float16; attention (16 heads x 4,096 x 72) through SDPA in float32 and
   float16, each backend torch offers alone (unsupported ones say so);
3. with --profile, the ten CUDA kernels taking most of one shipped encode (torch.profiler).

Prints Markdown for tests/perf/results/vision.md.

    python tests/perf/bench_siglip_parts.py --device cuda -r 5 --profile
    python tests/perf/bench_siglip_parts.py --device cpu --layers 1 --side 224 -r 1   # a dry run
"""

import argparse
import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.perf.bench_vision_gemma3 import best, build


@contextlib.contextmanager
def tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def row(name: str, seconds: float | None, note: str = "") -> None:
    ms = "-" if seconds is None else f"{seconds * 1e3:.2f}"
    print(f"| {name} | {ms} | {note} |")


def tower(model, pixels, repeats, dev) -> None:
    def encode():
        with torch.inference_mode():
            return model(pixels)

    ref = encode().float()
    scale = ref.abs().max().item()
    print("| tower + projector, one image | ms (best) | largest difference from float32 |")
    print("|---|---|---|")
    row("float32, as shipped", best(encode, repeats, dev), f"(outputs up to {scale:.3g})")
    if dev.type == "cuda":
        with tf32():
            diff = (encode().float() - ref).abs().max().item()
            row("float32 with TF32 matmuls allowed", best(encode, repeats, dev), f"{diff:.3g}")
    for dtype in (torch.float16, torch.bfloat16):
        model.v.use_half(dtype)
        diff = (encode().float() - ref).abs().max().item()
        row(f"use_half({dtype})", best(encode, repeats, dev), f"{diff:.3g}")
    model.v.use_half(None)


def parts(model, repeats, dev) -> None:
    blk, a = model.v.blk[0], model.args.tower
    n = a.patches_per_side**2
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(n, a.dim, generator=g).to(dev)
    up = blk.ffn_up
    w32 = up.weight.data.reshape(a.hidden_dim, -1).view(torch.float16).float()
    w16, x16 = w32.half(), x.half()
    print(f"\n| one block's part, {n} patches | ms (best) | note |")
    print("|---|---|---|")
    with torch.inference_mode():
        row(f"ffn_up {a.dim} -> {a.hidden_dim}, as shipped ({up.kernels()[0].kind})",
            best(lambda: up(x), repeats, dev))  # fmt: skip
        row("ffn_up, one float32 GEMM", best(lambda: F.linear(x, w32), repeats, dev))
        if dev.type == "cuda":
            with tf32():
                row("ffn_up, one TF32 GEMM", best(lambda: F.linear(x, w32), repeats, dev))
        row("ffn_up, float16", best(lambda: F.linear(x16, w16), repeats, dev))
        h, hd = a.n_heads, a.dim // a.n_heads
        q, k, v = (torch.randn(1, h, n, hd, generator=g).to(dev) for _ in range(3))
        backends = {
            "default": None,
            "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
            "math": SDPBackend.MATH,
        }
        for dtype in (torch.float32, torch.float16):
            qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
            for name, backend in backends.items():
                ctx = contextlib.nullcontext() if backend is None else sdpa_kernel([backend])
                label = f"attention {h} x {n} x {hd}, {dtype}, {name}"
                try:
                    with ctx:
                        row(label, best(lambda t=(qd, kd, vd): F.scaled_dot_product_attention(*t),
                                        repeats, dev))  # fmt: skip
                except RuntimeError as e:
                    row(label, None, f"not available: {str(e).splitlines()[0][:80]}")


def profile(model, pixels) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with torch.inference_mode(), prof(activities=[ProfilerActivity.CUDA]) as p:
        model(pixels)
        torch.cuda.synchronize()
    keys = p.key_averages()
    sort = "self_device_time_total" if hasattr(keys[0], "self_device_time_total") else (
        "self_cuda_time_total")  # fmt: skip
    print("\nOne shipped encode, CUDA kernels by time:\n")
    print("```")
    print(keys.table(sort_by=sort, row_limit=10, max_name_column_width=70))
    print("```")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("-r", "--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=27, help="tower depth (fewer: a quick check)")
    ap.add_argument("--side", type=int, default=896, help="image side in pixels (multiple of 14)")
    ap.add_argument("--profile", action="store_true", help="the top CUDA kernels of one encode")
    args = ap.parse_args()
    dev = torch.device(args.device)
    model = build(dev, args.layers, args.side)
    g = torch.Generator(device="cpu").manual_seed(0)
    pixels = (torch.rand(1, 3, args.side, args.side, generator=g) * 2 - 1).to(dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"SigLIP so400m shape, {args.layers} blocks, {args.side} px, {name}, "
          f"torch {torch.__version__}\n")  # fmt: skip
    tower(model, pixels, args.repeats, dev)
    parts(model, args.repeats, dev)
    if args.profile and dev.type == "cuda":
        profile(model, pixels)


if __name__ == "__main__":
    main()
