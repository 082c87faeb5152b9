"""Record the SmolVLM2 video fixtures: a tiny random-weight SmolVLM (SmolVLM2's architecture)
built with transformers, converted to a text GGUF + an `idefics3` mmproj by llama.cpp's own
`convert_hf_to_gguf.py`, with transformers' fp32 references for the 8-frame `clip.mp4` of the
Qwen fixtures (frames as single-tile images, each after its timestamp).

Needs what `record_vision_fixtures.py` needs plus av, num2words and torchvision (the HF video
processor; see `record_qwen_vl_fixtures.py` for a CPU-only torch), from the repository root:

    python tests/tools/record_smolvlm2_video_fixtures.py --llama-cpp /path/to/llama.cpp

Writes into tests/data/vision/: `smolvlm2-text.gguf`, `mmproj-smolvlm2.gguf` (`--outtype f16`,
weights rounded to float16 first) and `smolvlm2.json`: the video processor's settings, frame
indices, pixel values and the tower's output; the video chat's text, the processor's ids,
transformers' greedy tokens and fp32 logits (teacher-forced).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from record_qwen_vl_fixtures import decode_video
from record_vision_fixtures import (
    BOOTSTRAP,
    LONGEST_EDGE,
    N_GREEDY,
    OUT,
    PATCH,
    SCALE,
    SEED,
    TILE,
    b64,
    tokenizer,
)

VIDEO_FPS = 2  # frames sampled per second (SmolVLM2 ships 1)
MAX_FRAMES = 64
QUESTION = {"type": "text", "text": "What is in this image?"}
MESSAGES = [{"role": "user", "content": [{"type": "video"}, QUESTION]}]


def convert(llama_cpp: Path, hf_dir: Path, out: Path, *extra: str) -> None:
    """The converter without this script's PYTHONPATH (its torchvision would break the
    converter's transformers imports)."""
    cmd = [sys.executable, "-c", BOOTSTRAP, str(llama_cpp), str(hf_dir),
           "--outfile", str(out), "--outtype", "f16", *extra]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run(cmd, check=True, env=env, cwd=hf_dir.parent)  # not the repo: its kernels/


def build(tok):
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    torch.manual_seed(SEED)
    cfg = SmolVLMConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=TILE, patch_size=PATCH,
                           layer_norm_eps=1e-6),
        text_config=dict(model_type="llama", vocab_size=len(tok), hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=1024, tie_word_embeddings=False,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id),
        scale_factor=SCALE,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
    )  # fmt: skip
    model = SmolVLMForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.08)
            p.copy_(p.half().float())
    return model


def processor(tok):
    from transformers import SmolVLMImageProcessorPil, SmolVLMProcessor, SmolVLMVideoProcessor
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    ip = SmolVLMImageProcessorPil(
        size={"longest_edge": LONGEST_EDGE}, max_image_size={"longest_edge": TILE}
    )
    vp = SmolVLMVideoProcessor(
        video_sampling={"fps": VIDEO_FPS, "max_frames": MAX_FRAMES,
                        "video_size": {"longest_edge": LONGEST_EDGE}},
        max_image_size={"longest_edge": TILE},
    )  # fmt: skip
    seq = (TILE // PATCH) ** 2 // SCALE**2
    tok.chat_template = DEFAULT_CHAT_TEMPLATE
    return SmolVLMProcessor(ip, tok, vp, image_seq_len=seq, chat_template=DEFAULT_CHAT_TEMPLATE)


def video_input():
    from transformers.video_utils import VideoMetadata

    frames, fps = decode_video(OUT / "clip.mp4")
    meta = VideoMetadata(total_num_frames=len(frames), fps=fps, width=frames.shape[2],
                         height=frames.shape[1], duration=len(frames) / fps)  # fmt: skip
    return frames, meta


def record(model, proc) -> dict:
    frames, meta = video_input()
    enc = proc.video_processor(videos=[frames], video_metadata=[meta], return_tensors="pt",
                               do_sample_frames=True,
                               return_metadata=True)  # fmt: skip
    pv = enc["pixel_values"][0]  # [frames, 3, TILE, TILE]
    with torch.no_grad():
        feats = model.model.get_image_features(enc["pixel_values"]).pooler_output
    feats = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats
    feats = feats.reshape(-1, feats.shape[-1])
    m = enc["video_metadata"][0]
    text = proc.apply_chat_template(MESSAGES, add_generation_prompt=True)
    frames, meta = video_input()
    chat = proc(
        text=text,
        videos=[frames],
        video_metadata=[meta],
        return_tensors="pt",
        do_sample_frames=True,
    )
    with torch.no_grad():
        gen = model.generate(**chat, max_new_tokens=N_GREEDY, do_sample=False)
        new = gen[0, chat["input_ids"].shape[1] :].tolist()
        full = dict(chat, input_ids=gen, attention_mask=torch.ones_like(gen))
        logits = model(**full).logits[0]
    n = chat["input_ids"].shape[1]
    return {
        "frames_indices": [int(i) for i in m.frames_indices],
        "fps": meta.fps,
        "pixel_shape": list(pv.shape),
        "pixel_values": b64(pv.numpy()),
        "feature_shape": list(feats.shape),
        "image_features": b64(feats.numpy()),
        "chat": {
            "messages": MESSAGES,
            "text": text,
            "input_ids": chat["input_ids"][0].tolist(),
            "greedy_ids": new,
            "logits": b64(logits[n - 1 : n - 1 + len(new) + 1].numpy()),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp export")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = tokenizer()
    model = build(tok)
    proc = processor(tok)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        model.config.architectures = ["SmolVLMForConditionalGeneration"]
        model.config.text_config.architectures = ["VLlama3ForCausalLM"]
        model.save_pretrained(hf)
        proc.save_pretrained(hf)
        convert(args.llama_cpp, hf, OUT / "smolvlm2-text.gguf")
        convert(args.llama_cpp, hf, OUT / "mmproj-smolvlm2.gguf", "--mmproj")
    stamp = args.llama_cpp / "COMMIT"
    out = {
        "recorder": {
            "script": "tests/tools/record_smolvlm2_video_fixtures.py",
            "llama_cpp_commit": stamp.read_text().strip() if stamp.is_file() else None,
            "python": platform.python_version(),
            "versions": {
                p: md.version(p)
                for p in ("torch", "transformers", "tokenizers", "numpy", "av", "num2words")
            },
            "seed": SEED,
            "dtype": "float32 (weights rounded to float16)",
            "video_processor": "SmolVLMVideoProcessor",
        },
        "processor": {
            "video_fps": VIDEO_FPS,
            "max_frames": MAX_FRAMES,
            "video_size": LONGEST_EDGE,
            "tile": TILE,
        },
        "vocab_size": len(tok),
        "image_token_id": tok.convert_tokens_to_ids("<image>"),
        "video": record(model, proc),
    }
    (OUT / "smolvlm2.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
