"""Record the Qwen3-VL vision fixtures: a tiny random-weight Qwen3-VL built with transformers,
converted to a text GGUF (arch `qwen3vl`: interleaved M-RoPE, deepstack) + an mmproj GGUF
(projector `qwen3vl_merger`) by llama.cpp's own `convert_hf_to_gguf.py`, with transformers' fp32
references for the two images and the video of the Qwen2.5-VL fixtures.

Same requirements and call as `record_qwen_vl_fixtures.py` (torchvision for the video
processor; that script must have written `qtall.png`, `qwide.png` and `clip.mp4` first):

    python tests/tools/record_qwen3_vl_fixtures.py --llama-cpp /path/to/llama.cpp
    python tests/tools/record_qwen3_vl_fixtures.py --llama-cpp /path/to/llama.cpp --moe

Writes into tests/data/vision/: `qwen3vl-text.gguf`, `mmproj-qwen3vl.gguf` (`--outtype f16`,
weights rounded to float16 first) and `qwen3vl.json` (as `qwen25vl.json`: pixel values, grids,
the tower's output with its deepstack features, per conversation the ids, M-RoPE positions,
greedy tokens and fp32 logits; the video's frame indices and timestamps). With `--moe`, a
Qwen3-VL-MoE (4 experts, 2 used, text arch `qwen3vlmoe`) into `qwen3vlmoe-text.gguf`,
`mmproj-qwen3vlmoe.gguf` and `qwen3vlmoe.json`.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import platform
import tempfile
from pathlib import Path

import torch
from record_qwen_vl_fixtures import (
    CONVERSATIONS,
    IMAGES,
    N_GREEDY,
    OUT,
    SEED,
    TEMPLATE,
    VIDEOS,
    b64,
    convert,
    tokenizer,
    video_input,
)

MIN_PIXELS, MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 24
VIDEO_MIN, VIDEO_MAX = 32 * 32 * 4, 32 * 32 * 64
VIDEO_FPS = 2.0


def build(tok, moe: bool = False):
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    torch.manual_seed(SEED)
    config, model_cls = (
        (Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration)
        if moe
        else (Qwen3VLConfig, Qwen3VLForConditionalGeneration)
    )
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if moe else {}
    cfg = config(
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           out_hidden_size=64, num_position_embeddings=16,
                           deepstack_visual_indexes=[1, 2]),
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3], "mrope_interleaved": True},
                         tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.pad_token_id, pad_token_id=tok.pad_token_id,
                         **experts),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
        tie_word_embeddings=False,
    )  # fmt: skip
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(0.2 * torch.randn_like(p))
            elif "pos_embed" in name:
                p.copy_(torch.randn_like(p) * 0.5)
            else:
                p.copy_(torch.randn_like(p) * 0.08)
            p.copy_(p.half().float())
    return model


def hub_expert_layout(hf: Path) -> None:
    """transformers 5 saves packed experts as it runs them (gate_up [E, 2F, D], down [E, D, F]);
    the Hub's Qwen3-VL-MoE files, which llama.cpp's converter reads, hold them transposed."""
    from safetensors.torch import load_file, save_file

    for f in hf.glob("*.safetensors"):
        tensors = load_file(f)
        for k in tensors:
            if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                tensors[k] = tensors[k].transpose(1, 2).contiguous()
        save_file(tensors, f, metadata={"format": "pt"})


def processor(tok):
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLProcessor, Qwen3VLVideoProcessor

    half = [0.5, 0.5, 0.5]
    ip = Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        patch_size=16, image_mean=half, image_std=half,
    )  # fmt: skip
    vp = Qwen3VLVideoProcessor(
        size={"shortest_edge": VIDEO_MIN, "longest_edge": VIDEO_MAX}, fps=VIDEO_FPS,
        cap_pixels_per_frame=True,
    )  # fmt: skip
    return Qwen3VLProcessor(ip, tok, vp, chat_template=TEMPLATE)


def _visual(model, pv, grid) -> dict:
    with torch.no_grad():
        out = model.model.visual(pv, grid_thw=grid)
    feats = torch.cat([out.pooler_output, *out.deepstack_features], 1)
    return {
        "grid_thw": grid[0].tolist(),
        "pixel_shape": list(pv.shape),
        "pixel_values": b64(pv.numpy()),
        "feature_shape": list(feats.shape),  # [tokens, dim * (1 + deepstack layers)]
        "image_features": b64(feats.numpy()),
    }


def record_visuals(model, proc) -> dict:
    from PIL import Image

    out = {}
    for name in ("qtall.png", "qwide.png"):
        enc = proc.image_processor([Image.open(OUT / name)], return_tensors="pt")
        out[name] = _visual(model, enc["pixel_values"], enc["image_grid_thw"])
    frames, meta = video_input(OUT / "clip.mp4")
    enc = proc.video_processor(videos=[frames], video_metadata=[meta], return_tensors="pt",
                               return_metadata=True)  # fmt: skip
    rec = _visual(model, enc["pixel_values_videos"], enc["video_grid_thw"])
    m = enc["video_metadata"][0]
    rec.update(frames_indices=[int(i) for i in m.frames_indices], fps=meta.fps,
               timestamps=proc._calculate_timestamps(m.frames_indices, meta.fps, 2))  # fmt: skip
    out["clip.mp4"] = rec
    return out


def record_chats(model, proc) -> dict:
    from PIL import Image

    eos = proc.tokenizer.eos_token_id
    out = {}
    for name, messages in CONVERSATIONS.items():
        text = proc.apply_chat_template(messages, add_generation_prompt=True)
        kw = {}
        if IMAGES[name]:
            kw["images"] = [Image.open(OUT / n) for n in IMAGES[name]]
        if VIDEOS[name]:
            frames, meta = video_input(OUT / "clip.mp4")
            kw.update(videos=[frames], video_metadata=[meta])
        enc = proc(text=text, return_tensors="pt", **kw)
        with torch.no_grad():
            pos, delta = model.model.get_rope_index(
                enc["input_ids"], enc["mm_token_type_ids"], enc.get("image_grid_thw"),
                enc.get("video_grid_thw"),
            )  # fmt: skip
            gen = model.generate(**enc, max_new_tokens=N_GREEDY, do_sample=False)
            new = gen[0, enc["input_ids"].shape[1] :].tolist()
            full = dict(enc, input_ids=gen, attention_mask=torch.ones_like(gen))
            full["mm_token_type_ids"] = torch.nn.functional.pad(
                enc["mm_token_type_ids"], (0, len(new))
            )
            logits = model(**full).logits[0]
        n = enc["input_ids"].shape[1]
        out[name] = {
            "messages": messages,
            "images": IMAGES[name],
            "videos": VIDEOS[name],
            "text": text,
            "input_ids": enc["input_ids"][0].tolist(),
            "positions": pos[:, 0].tolist(),
            "delta": int(delta[0, 0]),
            "greedy_ids": new,
            "stopped_at_eos": bool(new and new[-1] == eos),
            "logits": b64(logits[n - 1 : n - 1 + len(new) + 1].numpy()),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp export")
    ap.add_argument("--moe", action="store_true", help="Qwen3-VL-MoE instead")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = tokenizer()
    model = build(tok, args.moe)
    proc = processor(tok)
    name = "qwen3vlmoe" if args.moe else "qwen3vl"
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        model.config.architectures = [type(model).__name__]
        model.save_pretrained(hf)
        proc.save_pretrained(hf)
        if args.moe:
            hub_expert_layout(hf)
        convert(args.llama_cpp, hf, OUT / f"{name}-text.gguf")
        convert(args.llama_cpp, hf, OUT / f"mmproj-{name}.gguf", "--mmproj")
    stamp = args.llama_cpp / "COMMIT"
    record = {
        "recorder": {
            "script": "tests/tools/record_qwen3_vl_fixtures.py",
            "llama_cpp_commit": stamp.read_text().strip() if stamp.is_file() else None,
            "python": platform.python_version(),
            "versions": {
                p: md.version(p)
                for p in ("torch", "transformers", "tokenizers", "pillow", "numpy", "av")
            },
            "seed": SEED,
            "dtype": "float32 (weights rounded to float16)",
            "image_processor": "Qwen2VLImageProcessorPil",
            "video_processor": "Qwen3VLVideoProcessor",
        },
        "processor": {
            "min_pixels": MIN_PIXELS,
            "max_pixels": MAX_PIXELS,
            "video_min_pixels": VIDEO_MIN,
            "video_max_pixels": VIDEO_MAX,
            "video_fps": VIDEO_FPS,
        },
        "vocab_size": len(tok),
        "image_token_id": tok.convert_tokens_to_ids("<|image_pad|>"),
        "video_token_id": tok.convert_tokens_to_ids("<|video_pad|>"),
        "eos_id": tok.eos_token_id,
        "deepstack_layers": len(model.config.vision_config.deepstack_visual_indexes),
        "visuals": record_visuals(model, proc),
        "chats": record_chats(model, proc),
    }
    (OUT / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
