"""Record the vision fixtures: a tiny random-weight Idefics3 (SmolVLM's architecture) built with
transformers, converted to a text GGUF + an mmproj GGUF by llama.cpp's own
`convert_hf_to_gguf.py` (the text part, then `--mmproj`), with transformers' fp32 references.

Runs with a Python that has torch, transformers, tokenizers, safetensors, numpy and Pillow (this
script never imports localllm), from the repository root, with an export of llama.cpp
(`convert_hf_to_gguf.py`, `conversion/`, `gguf-py/`; fetch the source, never vendor it):

    python tests/tools/record_vision_fixtures.py --llama-cpp /path/to/llama.cpp

Writes into tests/data/vision/:
* `idefics3-text.gguf`, `mmproj-idefics3.gguf`: the converter's outputs (`--outtype f16`). The
  weights are drawn (fixed seed), then rounded to float16 before anything else, so the F16 files
  hold exactly the values transformers computes with in float32 (the converter keeps the patch
  and position embeddings in F32).
* `tall.png` (40x56, RGB) and `wide.png` (70x20, RGBA with transparent pixels): two images
  drawn from a fixed seed, whose HF layouts differ (2x2 tiles, 1x2 tiles, each + the global).
* `idefics3.json`: the processor settings; per image the HF image processor's `pixel_values`
  (base64 float32), rows/cols and the encoder + connector output (`image_features`, base64
  float32 [tiles * tokens, dim]); per conversation the chat template's text, the processor's
  expanded `input_ids`, transformers' greedy tokens and the fp32 logits of the last prompt
  position and of every greedy step (teacher-forced, base64 float32 [steps + 1, vocab]).

The converter runs unchanged in a subprocess with the export's gguf-py first on sys.path; one
shim: it names a BPE pre-tokenizer from a hash of its output on a fixed text and refuses unknown
ones, so the recorder makes it answer `smollm` (SmolVLM's own: digits split one by one, then
GPT-2's regex), the shape of this tiny vocabulary.
"""

from __future__ import annotations

import argparse
import base64
import importlib.metadata as md
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

OUT = Path(__file__).resolve().parents[1] / "data" / "vision"
SEED = 0
N_GREEDY = 8
TILE = 32  # the vision tower's image_size: one tile
LONGEST_EDGE = 64  # the processor's resize target (two tiles a side at most)
PATCH = 4
SCALE = 2  # pixel shuffle: (32 / 4)^2 / 2^2 = 16 tokens a tile

# SmolVLM's chat template (HuggingFaceTB/SmolVLM-*-Instruct chat_template.json).
TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
CORPUS = [
    "User: What is in this image? Assistant: A cat sitting on a warm mat.",
    "Describe the picture. There is a red car, a blue sky and two trees.",
    "Compare the two images: the first is tall and the second is wide.",
    "Numbers 1 2 3 10 42. How many dogs are there? There are 3 dogs.",
]
SPECIALS = ["<|im_start|>", "<end_of_utterance>", "<|im_end|>", "<fake_token_around_image>",
            "<image>", "<global-img>",
            *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]  # fmt: skip
CONVERSATIONS = {
    "one_image": [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What is in this image?"}],
        },
    ],
    "two_images": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare the two images:"},
                {"type": "image"},
                {"type": "image"},
            ],
        },
    ],
}
IMAGES = {"one_image": ["tall.png"], "two_images": ["tall.png", "wide.png"]}

BOOTSTRAP = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root + "/gguf-py", root]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
sys.argv = [root + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def b64(a) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype="<f4").tobytes()).decode()


def make_images() -> dict[str, Path]:
    from PIL import Image

    rng = np.random.default_rng(SEED)
    out = {}
    for name, (w, h, mode) in {"tall.png": (40, 56, "RGB"), "wide.png": (70, 20, "RGBA")}.items():
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h)], -1)
        px = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
        if mode == "RGBA":  # transparent stripes: HF composites them onto white
            alpha = np.where((x // 7) % 3 == 0, 0, 255).astype(np.uint8)[..., None]
            px = np.concatenate([px, alpha], -1)
        path = OUT / name
        Image.fromarray(px, mode).save(path)
        out[name] = path
    return out


def tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False)]
    )
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<end_of_utterance>",
        pad_token="<|im_end|>", unk_token=None, chat_template=TEMPLATE,
        extra_special_tokens={"image_token": "<image>"},
    )  # fmt: skip


def build(tok):
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    torch.manual_seed(SEED)
    cfg = Idefics3Config(
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
    model = Idefics3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):  # not a no-op: 1 +- noise
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(0.2 * torch.randn_like(p))
            else:  # larger than the default init: logits far apart, attention not uniform
                p.copy_(torch.randn_like(p) * 0.08)
            p.copy_(p.half().float())  # what the F16 file holds
    return model


def processor(tok):
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    ip = Idefics3ImageProcessorPil(
        size={"longest_edge": LONGEST_EDGE}, max_image_size={"longest_edge": TILE}
    )
    seq = (TILE // PATCH) ** 2 // SCALE**2
    return Idefics3Processor(ip, tok, image_seq_len=seq, chat_template=TEMPLATE)


def convert(llama_cpp: Path, hf_dir: Path, out: Path, *extra: str) -> None:
    cmd = [sys.executable, "-c", BOOTSTRAP, str(llama_cpp), str(hf_dir),
           "--outfile", str(out), "--outtype", "f16", *extra]  # fmt: skip
    subprocess.run(cmd, check=True)


def record_images(model, proc, paths) -> dict:
    from PIL import Image

    out = {}
    for name, path in paths.items():
        enc = proc.image_processor(
            [Image.open(path)], return_tensors="pt", return_row_col_info=True
        )
        pv = enc["pixel_values"][0]  # [tiles, 3, TILE, TILE]
        with torch.no_grad():
            feats = model.model.get_image_features(
                enc["pixel_values"], enc["pixel_attention_mask"]
            ).pooler_output[0]
        out[name] = {
            "rows": int(enc["rows"][0][0]),
            "cols": int(enc["cols"][0][0]),
            "pixel_shape": list(pv.shape),
            "pixel_values": b64(pv.numpy()),
            "feature_shape": list(feats.shape),
            "image_features": b64(feats.numpy()),
        }
    return out


def record_chats(model, proc, paths) -> dict:
    from PIL import Image

    tok = proc.tokenizer
    eos = tok.eos_token_id
    out = {}
    for name, messages in CONVERSATIONS.items():
        text = proc.apply_chat_template(messages, add_generation_prompt=True)
        images = [Image.open(paths[n]) for n in IMAGES[name]]
        enc = proc(text=text, images=images, return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=N_GREEDY, do_sample=False)
            new = gen[0, enc["input_ids"].shape[1] :].tolist()
            full = dict(enc, input_ids=gen, attention_mask=torch.ones_like(gen))
            logits = model(**full).logits[0]
        n = enc["input_ids"].shape[1]
        out[name] = {
            "messages": messages,
            "images": IMAGES[name],
            "text": text,
            "input_ids": enc["input_ids"][0].tolist(),
            "greedy_ids": new,
            "stopped_at_eos": bool(new and new[-1] == eos),
            # rows: the last prompt position, then each greedy step's position
            "logits": b64(logits[n - 1 : n - 1 + len(new) + 1].numpy()),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp export")
    args = ap.parse_args()
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    paths = make_images()
    tok = tokenizer()
    model = build(tok)
    proc = processor(tok)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        model.config.architectures = ["Idefics3ForConditionalGeneration"]
        model.config.text_config.architectures = ["VLlama3ForCausalLM"]  # as SmolVLM ships it
        model.save_pretrained(hf)
        proc.save_pretrained(hf)
        convert(args.llama_cpp, hf, OUT / "idefics3-text.gguf")
        convert(args.llama_cpp, hf, OUT / "mmproj-idefics3.gguf", "--mmproj")
    stamp = args.llama_cpp / "COMMIT"  # written by the export, when it was made from git
    commit = stamp.read_text().strip() if stamp.is_file() else None
    ip = proc.image_processor
    record = {
        "recorder": {
            "script": "tests/tools/record_vision_fixtures.py",
            "llama_cpp_commit": commit,
            "python": platform.python_version(),
            "versions": {
                p: md.version(p) for p in ("torch", "transformers", "tokenizers", "pillow", "numpy")
            },
            "seed": SEED,
            "dtype": "float32 (weights rounded to float16)",
            "image_processor": "Idefics3ImageProcessorPil",
        },
        "processor": {
            "size": {"longest_edge": LONGEST_EDGE},
            "max_image_size": {"longest_edge": TILE},
            "image_seq_len": proc.image_seq_len,
            "image_mean": ip.image_mean,
            "image_std": ip.image_std,
            "resample": int(ip.resample),
        },
        "vocab_size": len(tok),
        "image_token_id": tok.convert_tokens_to_ids("<image>"),
        "eos_id": tok.eos_token_id,
        "images": record_images(model, proc, paths),
        "chats": record_chats(model, proc, paths),
    }
    (OUT / "idefics3.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
