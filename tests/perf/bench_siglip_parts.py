"""Where a Gemma-3-4B-shaped SigLIP tower's encode time goes (27 blocks, 1152 wide, 16 heads of 72,
MLP 4304, 896-px images: 4,096 patches; random F16 weights, `bench_vision_gemma3.build`), and what
the half paths change (issues 35 / 38):

1. the tower + projector on one image: as shipped before commit 6172ae4 (F16 weights widened
   per call in float32 row tiles, `DequantTilesLinear`: reproduced by `precise` linears), the
   same with TF32 allowed (torch's global switch, set for this line only), the F16 linears on
   tensor cores (`half_gemm`, `kernels/quant/linear_half.py`) with float32 blocks
   (`use_half(None)`), and the half blocks (`use_half(float16)`: the new CUDA default for an F16
   tower; bfloat16): best of R, and the outputs' largest difference from the float32 tiles';
2. the largest |activation| entering each kind of block linear (float32 blocks): how near
   float16's 65504 the F16 path's inputs come (random weights: real ones may differ);
3. one block's parts at the tower's shapes: `ffn_up` (4,096 x 1152 -> 4304) as float32 tiles,
   as `half_gemm`, one float32 GEMM, TF32, plain float16 F.linear; attention (16 heads x 4,096 x
   72) through SDPA in float32 and float16, each backend alone (unsupported ones say so);
4. with --profile, the ten CUDA kernels taking most of one encode in the CUDA default.

Prints Markdown for tests/perf/results/vision.md.

    python tests/perf/bench_siglip_parts.py --device cuda -r 5 --profile
    python tests/perf/bench_siglip_parts.py --device cpu --layers 1 --side 224 -r 1   # a dry run
"""

import argparse
import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from localllm.engine.layers.linear import QuantLinear
from localllm.kernels.quant import QuantType, prepare_linear
from localllm.media.vision.siglip import LINEARS
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


def linears(model) -> list[QuantLinear]:
    return [m for m in model.modules() if isinstance(m, QuantLinear) and m.weight is not None]


def set_precise(model, precise: bool) -> None:
    """Re-prepare every linear: `precise` takes the float32 tiles (the CUDA path before)."""
    for m in linears(model):
        m.precise = precise
        m.load_tensor("weight", m.weight)


def tower(model, pixels, repeats, dev) -> None:
    def encode():
        with torch.inference_mode():
            return model(pixels)

    set_precise(model, True)
    model.v.use_half(None)
    ref = encode().float()
    scale = ref.abs().max().item()
    print("| tower + projector, one image | ms (best) | largest difference from float32 tiles |")
    print("|---|---|---|")
    row("float32 tiles (before)", best(encode, repeats, dev), f"(outputs up to {scale:.3g})")
    if dev.type == "cuda":
        with tf32():
            diff = (encode().float() - ref).abs().max().item()
            row("float32 tiles, TF32 allowed", best(encode, repeats, dev), f"{diff:.3g}")
    set_precise(model, False)
    kind = linears(model)[0].kernels()[0].kind
    diff = (encode().float() - ref).abs().max().item()
    row(f"{kind} linears, float32 blocks", best(encode, repeats, dev), f"{diff:.3g}")
    for dtype in (torch.float16, torch.bfloat16):
        model.v.use_half(dtype)
        diff = (encode().float() - ref).abs().max().item()
        default = " (CUDA default)" if dtype == model.v.stored_half_dtype() else ""
        row(f"use_half({dtype}){default}", best(encode, repeats, dev), f"{diff:.3g}")
    model.v.use_half(None)


def activations(model, pixels) -> None:
    """The largest |input| of each block linear kind over one encode (float32 blocks)."""
    seen: dict[str, float] = {}

    def hook(name):
        def record(_m, args, _out):
            seen[name] = max(seen.get(name, 0.0), args[0].abs().amax().item())

        return record

    handles = [
        getattr(blk, name).register_forward_hook(hook(name))
        for blk in model.v.blk
        for name in LINEARS
    ]
    try:
        with torch.inference_mode():
            model(pixels)
    finally:
        for h in handles:
            h.remove()
    print("\n| block linear | largest input, float32 blocks (float16 saturates at 65504) |")
    print("|---|---|")
    for name in LINEARS:
        print(f"| {name} | {seen[name]:.4g} |")


def parts(model, repeats, dev) -> None:
    blk, a = model.v.blk[0], model.args.tower
    n = a.patches_per_side**2
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(n, a.dim, generator=g).to(dev)
    up = blk.ffn_up
    w32 = up.weight.data.reshape(a.hidden_dim, -1).view(torch.float16).float()
    w16, x16 = w32.half(), x.half()
    shape = (a.hidden_dim, a.dim)
    tiles = prepare_linear(up.weight.data, QuantType.F16, shape, strategy="dequant_tiles")
    half = prepare_linear(up.weight.data, QuantType.F16, shape, strategy="half_gemm")
    print(f"\n| one block's part, {n} patches | ms (best) | note |")
    print("|---|---|---|")
    with torch.inference_mode():
        row(f"ffn_up {a.dim} -> {a.hidden_dim}, float32 tiles (before)",
            best(lambda: tiles.matmul(x), repeats, dev))  # fmt: skip
        row("ffn_up, half_gemm (float32 in and out)", best(lambda: half.matmul(x), repeats, dev))
        row("ffn_up, one float32 GEMM", best(lambda: F.linear(x, w32), repeats, dev))
        if dev.type == "cuda":
            with tf32():
                row("ffn_up, one TF32 GEMM", best(lambda: F.linear(x, w32), repeats, dev))
        row("ffn_up, float16 F.linear", best(lambda: F.linear(x16, w16), repeats, dev))
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

    model.v.use_half(model.v.stored_half_dtype())  # the CUDA default
    with torch.inference_mode(), prof(activities=[ProfilerActivity.CUDA]) as p:
        model(pixels)
        torch.cuda.synchronize()
    keys = p.key_averages()
    sort = "self_device_time_total" if hasattr(keys[0], "self_device_time_total") else (
        "self_cuda_time_total")  # fmt: skip
    print("\nOne encode in the CUDA default, CUDA kernels by time:\n")
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
    activations(model, pixels)
    parts(model, args.repeats, dev)
    if args.profile and dev.type == "cuda":
        profile(model, pixels)


if __name__ == "__main__":
    main()
