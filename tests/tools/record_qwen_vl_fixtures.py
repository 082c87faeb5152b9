"""Record the Qwen2.5-VL vision fixtures: a tiny random-weight Qwen2.5-VL built with
transformers, converted to a text GGUF (arch `qwen2vl`) + an mmproj GGUF (projector
`qwen2.5vl`) by llama.cpp's own `convert_hf_to_gguf.py`, with transformers' fp32 references for
two images and one short video (written here with PyAV).

Runs with a Python that has torch, transformers, tokenizers, safetensors, numpy, Pillow and av,
plus torchvision for the HF video processor (this script never imports localllm), from the
repository root, with an export of llama.cpp (`convert_hf_to_gguf.py`, `conversion/`,
`gguf-py/`; fetch the source, never vendor it):

    python tests/tools/record_qwen_vl_fixtures.py --llama-cpp /path/to/llama.cpp
    python tests/tools/record_qwen_vl_fixtures.py --llama-cpp /path/to/llama.cpp --qwen2

(A CPU-only torch has no matching torchvision wheel on PyPI: `pip install --no-deps --target
DIR torchvision` and `PYTHONPATH=DIR` work, since the script keeps torchvision's compiled ops
out; only its pure-torch resize is used.)

Writes into tests/data/vision/:
* `qwen25vl-text.gguf`, `mmproj-qwen25vl.gguf` (`--outtype f16`; weights drawn with a fixed seed
  and rounded to float16 first, so the files hold exactly what transformers computes with).
* `qtall.png` (140x168: 2x2 attention windows) and `qwide.png` (420x100: past max_pixels, so
  smart_resize scales it down), `clip.mp4` (8 frames of 64x48 at 4 fps, mpeg4).
* `qwen25vl.json`: processor settings; per image and for the video the HF processor's pixel
  values and grid, and the tower's output; per conversation the text, the processor's input ids,
  the M-RoPE position ids and delta, transformers' greedy tokens and the fp32 logits of the last
  prompt position and of every greedy step (teacher-forced).
* with `--qwen2`: the same for a tiny Qwen2-VL (`qwen2vl_merger` mmproj: LayerNorm blocks,
  quick-GELU MLP, no windows; video positions step one per temporal patch) into
  `qwen2vl-text.gguf`, `mmproj-qwen2vl.gguf`, `qwen2vl.json`, on the files above (not rewritten).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import platform
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch

sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("tv_meta"))
from record_vision_fixtures import b64  # noqa: E402  (the script's folder is on sys.path)

OUT = Path(__file__).resolve().parents[1] / "data" / "vision"
SEED = 0
N_GREEDY = 8
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 40
VIDEO_FPS = 2.0  # frames sampled per second of video
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "What is in this image? A cat sitting on a warm mat.",
    "Describe the picture. There is a red car, a blue sky and two trees.",
    "Compare the two images: the first is tall and the second is wide.",
    "What happens in the video? A ball rolls to the left, then stops.",
    "user assistant system Numbers 1 2 3 10 42.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]  # fmt: skip
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CONVERSATIONS = {
    "one_image": [
        {"role": "user", "content": [{"type": "image"},
                                     {"type": "text", "text": "What is in this image?"}]},
    ],
    "two_images": [
        {"role": "user", "content": [{"type": "text", "text": "Compare the two images:"},
                                     {"type": "image"}, {"type": "image"}]},
    ],
    "video": [
        {"role": "user", "content": [{"type": "video"},
                                     {"type": "text", "text": "What happens in the video?"}]},
    ],
}  # fmt: skip
IMAGES = {"one_image": ["qtall.png"], "two_images": ["qtall.png", "qwide.png"], "video": []}
VIDEOS = {"one_image": [], "two_images": [], "video": ["clip.mp4"]}

BOOTSTRAP = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root + "/gguf-py", root]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = [root + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def make_images() -> dict[str, Path]:
    from PIL import Image

    rng = np.random.default_rng(SEED)
    out = {}
    for name, (w, h) in {"qtall.png": (140, 168), "qwide.png": (420, 100)}.items():
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h)], -1)
        px = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(px, "RGB").save(OUT / name)
        out[name] = OUT / name
    return out


def make_video() -> Path:
    """8 frames of 64x48 at 4 fps: a bright square moving over a noisy gradient."""
    import av

    rng = np.random.default_rng(SEED + 1)
    path = OUT / "clip.mp4"
    with av.open(str(path), "w") as c:
        s = c.add_stream("mpeg4", rate=4)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        s.options = {"qscale": "2"}
        for i in range(8):
            y, x = np.mgrid[0:48, 0:64]
            base = np.stack([x * 4, y * 5, (x + y) * 2], -1).astype(np.float64)
            base += rng.normal(0, 20, base.shape)
            base[10:26, 4 + 6 * i : 20 + 6 * i] = (250, 240, 30)
            frame = av.VideoFrame.from_ndarray(np.clip(base, 0, 255).astype(np.uint8), "rgb24")
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def decode_video(path: Path):
    import av

    with av.open(str(path)) as c:
        s = c.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(s)]
        fps = float(s.average_rate)
    return np.stack(frames), fps


def tokenizer():
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None, chat_template=TEMPLATE,
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
    )  # fmt: skip


def build(tok):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(SEED)
    cfg = Qwen2_5_VLConfig(
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           window_size=112, fullatt_block_indexes=[1, 3], out_hidden_size=64,
                           tokens_per_second=2),
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         rms_norm_eps=1e-6, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3]},
                         bos_token_id=tok.pad_token_id,
                         tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
        bos_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("norm" in name or "ln_q" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))  # not a no-op: 1 +- noise
            elif "norm" in name:
                p.copy_(0.2 * torch.randn_like(p))
            else:  # larger than the default init: logits far apart, attention not uniform
                p.copy_(torch.randn_like(p) * 0.08)
            p.copy_(p.half().float())  # what the F16 file holds
    return model


def build_qwen2(tok):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(SEED)
    cfg = Qwen2VLConfig(
        vision_config=dict(depth=3, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         rms_norm_eps=1e-6, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3]},
                         bos_token_id=tok.pad_token_id, tie_word_embeddings=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
        bos_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )  # fmt: skip
    return _randomize(Qwen2VLForConditionalGeneration(cfg).eval())


def _randomize(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("norm" in name or "ln_q" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in name or "ln_q" in name:
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.08)
            p.copy_(p.half().float())
    return model


def processor(tok, qwen2: bool = False):
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil, Qwen2VLVideoProcessor

    size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    ip = Qwen2VLImageProcessorPil(size=size)
    vp = Qwen2VLVideoProcessor(
        size=size, do_sample_frames=True, fps=VIDEO_FPS, cap_pixels_per_frame=True
    )
    if qwen2:
        from transformers import Qwen2VLProcessor

        return Qwen2VLProcessor(ip, tok, vp, chat_template=TEMPLATE)
    return Qwen2_5_VLProcessor(ip, tok, vp, chat_template=TEMPLATE)


def convert(llama_cpp: Path, hf_dir: Path, out: Path, *extra: str) -> None:
    cmd = [sys.executable, "-c", BOOTSTRAP, str(llama_cpp), str(hf_dir),
           "--outfile", str(out), "--outtype", "f16", *extra]  # fmt: skip
    subprocess.run(cmd, check=True)


def video_input(path: Path):
    from transformers.video_utils import VideoMetadata

    frames, fps = decode_video(path)
    meta = VideoMetadata(total_num_frames=len(frames), fps=fps, width=frames.shape[2],
                         height=frames.shape[1], duration=len(frames) / fps)  # fmt: skip
    return frames, meta


def record_visuals(model, proc, paths, video) -> dict:
    from PIL import Image

    out = {}
    for name, path in paths.items():
        enc = proc.image_processor([Image.open(path)], return_tensors="pt")
        out[name] = _visual(model, enc["pixel_values"], enc["image_grid_thw"])
    frames, meta = video_input(video)
    enc = proc.video_processor(videos=[frames], video_metadata=[meta], return_tensors="pt",
                               return_metadata=True)  # fmt: skip
    rec = _visual(model, enc["pixel_values_videos"], enc["video_grid_thw"])
    m = enc["video_metadata"][0]
    rec.update(frames_indices=[int(i) for i in m.frames_indices], fps=meta.fps,
               sampled_fps=m.sampled_fps)  # fmt: skip
    out[video.name] = rec
    return out


def _visual(model, pv, grid) -> dict:
    with torch.no_grad():
        feats = model.model.get_image_features(pv, grid).pooler_output
    feats = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats
    return {
        "grid_thw": grid[0].tolist(),
        "pixel_shape": list(pv.shape),
        "pixel_values": b64(pv.numpy()),
        "feature_shape": list(feats.shape),
        "image_features": b64(feats.numpy()),
    }


def record_chats(model, proc, paths, video) -> dict:
    from PIL import Image

    eos = proc.tokenizer.eos_token_id
    out = {}
    for name, messages in CONVERSATIONS.items():
        text = proc.apply_chat_template(messages, add_generation_prompt=True)
        kw = {}
        if IMAGES[name]:
            kw["images"] = [Image.open(paths[n]) for n in IMAGES[name]]
        if VIDEOS[name]:
            frames, meta = video_input(video)
            kw.update(videos=[frames], video_metadata=[meta])
        enc = proc(text=text, return_tensors="pt", **kw)
        with torch.no_grad():
            extra = (
                {"second_per_grid_ts": enc["second_per_grid_ts"]}
                if "second_per_grid_ts" in enc
                else {}
            )
            grids = {k: enc.get(k) for k in ("image_grid_thw", "video_grid_thw")}
            pos, delta = model.model.get_rope_index(
                enc["input_ids"], enc["mm_token_type_ids"], **grids, **extra
            )
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
            "second_per_grid_ts": [float(x) for x in enc.get("second_per_grid_ts", [])],
            "greedy_ids": new,
            "stopped_at_eos": bool(new and new[-1] == eos),
            "logits": b64(logits[n - 1 : n - 1 + len(new) + 1].numpy()),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp export")
    ap.add_argument("--qwen2", action="store_true", help="Qwen2-VL instead (same media)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    if args.qwen2:
        paths = {n: OUT / n for n in ("qtall.png", "qwide.png")}
        video = OUT / "clip.mp4"
    else:
        paths = make_images()
        video = make_video()
    tok = tokenizer()
    model = build_qwen2(tok) if args.qwen2 else build(tok)
    proc = processor(tok, args.qwen2)
    name = "qwen2vl" if args.qwen2 else "qwen25vl"
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        model.config.architectures = [type(model).__name__]
        model.save_pretrained(hf)
        proc.save_pretrained(hf)
        convert(args.llama_cpp, hf, OUT / f"{name}-text.gguf")
        convert(args.llama_cpp, hf, OUT / f"mmproj-{name}.gguf", "--mmproj")
    stamp = args.llama_cpp / "COMMIT"
    commit = stamp.read_text().strip() if stamp.is_file() else None
    ip = proc.image_processor
    vcfg = model.config.vision_config
    record = {
        "recorder": {
            "script": "tests/tools/record_qwen_vl_fixtures.py",
            "llama_cpp_commit": commit,
            "python": platform.python_version(),
            "versions": {
                p: md.version(p)
                for p in ("torch", "transformers", "tokenizers", "pillow", "numpy", "av")
            },
            "seed": SEED,
            "dtype": "float32 (weights rounded to float16)",
            "image_processor": "Qwen2VLImageProcessorPil",
            "video_processor": "Qwen2VLVideoProcessor",
        },
        "processor": {
            "min_pixels": MIN_PIXELS,
            "max_pixels": MAX_PIXELS,
            "video_fps": VIDEO_FPS,
            "image_mean": list(ip.image_mean),
            "image_std": list(ip.image_std),
            "tokens_per_second": getattr(vcfg, "tokens_per_second", 0),  # Qwen2-VL: none
        },
        "vocab_size": len(tok),
        "image_token_id": tok.convert_tokens_to_ids("<|image_pad|>"),
        "video_token_id": tok.convert_tokens_to_ids("<|video_pad|>"),
        "eos_id": tok.eos_token_id,
        "visuals": record_visuals(model, proc, paths, video),
        "chats": record_chats(model, proc, paths, video),
    }
    (OUT / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
