"""Record the Gemma 3 vision fixtures: a tiny random-weight Gemma3ForConditionalGeneration
(SigLIP tower + pooled projector + gemma3 text model) built with transformers, converted to a
text GGUF + an mmproj GGUF by llama.cpp's own `convert_hf_to_gguf.py` (then `--mmproj`), with
transformers' fp32 references.

Runs like `record_vision_fixtures.py` (same Python, same llama.cpp export, whose converter shim it
reuses), from the repository root:

    python tests/tools/record_gemma3_vision_fixtures.py --llama-cpp /path/to/llama.cpp

Reads `tests/data/vision/tall.png` and `wide.png` (made by `record_vision_fixtures.py`) and
writes into tests/data/vision/:
* `gemma3-text.gguf`, `mmproj-gemma3.gguf`: the converter's outputs (`--outtype f16`; weights
  drawn with a fixed seed and rounded to float16 first, so both sides compute with the same
  values). Six text layers: five sliding-window layers (window 8, shorter than an image's 16
  tokens, so the window and the bidirectional image mask meet) and one global layer.
* `gemma3.json`: per image the `Gemma3ImageProcessorPil` pixel values and the tower + projector
  output; per conversation the chat template's text, the processor's `input_ids` and
  `token_type_ids`, transformers' greedy tokens and the fp32 logits of the last prompt position
  and every greedy step (teacher-forced with the image mask of a prefill), plus the same logits
  with a causal-only mask (`causal_logits`: shows the bidirectional mask matters).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_vision_fixtures import OUT, b64, convert

SEED = 0
N_GREEDY = 8
TILE = 32  # the tower's image_size: the processor resizes every image to TILE x TILE
PATCH = 4  # 8 x 8 patches
TOKENS = 16  # mm_tokens_per_image: 4 x 4 after a 2 x 2 average pool
WINDOW = 8

# Gemma 3's chat template (google/gemma-3-4b-it chat_template.json).
TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- if messages[0]['content'] is "
    "string -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    '{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = "" -%}'
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}{{ raise_exception("
    '"Conversation roles must alternate user/assistant/user/assistant/...") }}{%- endif -%}'
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}{{ '<start_of_turn>' + role + '\n' + "
    "(first_user_prefix if loop.first else \"\") }}{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}{%- elif message['content'] is iterable -%}{%- for item in "
    "message['content'] -%}{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}"
    '{%- else -%}{{ raise_exception("Invalid content type") }}{%- endif -%}'
    "{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}"
    "{{'<start_of_turn>model\n'}}{%- endif -%}"
)
CORPUS = [
    "What is in this image? A cat sitting on a warm mat.",
    "Describe the picture. There is a red car, a blue sky and two trees.",
    "Compare the two images: the first is tall and the second is wide.",
    "Numbers 1 2 3 10 42. How many dogs are there? There are 3 dogs.\n\n",
]
SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
            "<end_of_image>", "<image_soft_token>"]  # fmt: skip
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
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token=None, chat_template=TEMPLATE,
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"},
    )  # fmt: skip


def build(tok):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(SEED)
    ids = tok.convert_tokens_to_ids
    cfg = Gemma3Config(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32,
                           intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=TILE, patch_size=PATCH, layer_norm_eps=1e-6,
                           vision_use_head=False),
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, query_pre_attn_scalar=16, rms_norm_eps=1e-6,
                         sliding_window=WINDOW, max_position_embeddings=1024,
                         bos_token_id=ids("<bos>"), eos_token_id=ids("<eos>"),
                         pad_token_id=ids("<pad>")),
        mm_tokens_per_image=TOKENS,
        boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"),
    )  # fmt: skip
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                # Gemma's norms scale by (1 + w), SigLIP's LayerNorms by w: both far from no-op
                one = 0.0 if "language_model" in name or "soft_emb" in name else 1.0
                p.copy_(one + 0.2 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(0.2 * torch.randn_like(p))
            else:  # larger than the default init: logits far apart, attention not uniform
                p.copy_(torch.randn_like(p) * 0.08)
            p.copy_(p.half().float())  # what the F16 file holds
    return model


def processor(tok):
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    ip = Gemma3ImageProcessorPil(
        size={"height": TILE, "width": TILE}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    return Gemma3Processor(ip, tok, chat_template=TEMPLATE, image_seq_length=TOKENS)


def released_layout(path: Path) -> None:
    """The tower's tensors under `vision_tower.vision_model.`, as the released checkpoints (and
    llama.cpp's tensor map) name them; transformers 5 saves them one level up."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    renamed = {
        k.replace("vision_tower.", "vision_tower.vision_model.", 1)
        if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.")
        else k: v
        for k, v in tensors.items()
    }
    save_file(renamed, path, metadata={"format": "pt"})


def record_images(model, proc, names) -> dict:
    from PIL import Image

    out = {}
    for name in names:
        enc = proc.image_processor([Image.open(OUT / name)], return_tensors="pt")
        pv = enc["pixel_values"]  # [1, 3, TILE, TILE]
        with torch.no_grad():
            feats = model.model.get_image_features(pv).pooler_output.reshape(-1, 64)
        out[name] = {
            "pixel_shape": list(pv.shape),
            "pixel_values": b64(pv.numpy()),
            "feature_shape": list(feats.shape),
            "image_features": b64(feats.numpy()),
        }
    return out


def record_chats(model, proc) -> dict:
    from PIL import Image

    tok = proc.tokenizer
    eos = tok.eos_token_id
    out = {}
    for name, messages in CONVERSATIONS.items():
        text = proc.apply_chat_template(messages, add_generation_prompt=True)
        images = [Image.open(OUT / n) for n in IMAGES[name]]
        enc = proc(text=text, images=images, return_tensors="pt")
        n = enc["input_ids"].shape[1]
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=N_GREEDY, do_sample=False)
            new = gen[0, n:].tolist()
            types = torch.cat([enc["token_type_ids"], torch.zeros_like(gen[:, n:])], 1)
            full = dict(enc, input_ids=gen, attention_mask=torch.ones_like(gen))
            full.pop("token_type_ids")
            logits = model(**full, token_type_ids=types).logits[0]
            # the same positions with a causal mask only (no token types: no image blocks)
            causal = model(**full).logits[0]
        rows = slice(n - 1, n - 1 + len(new) + 1)
        out[name] = {
            "messages": messages,
            "images": IMAGES[name],
            "text": text,
            "input_ids": enc["input_ids"][0].tolist(),
            "token_type_ids": enc["token_type_ids"][0].tolist(),
            "greedy_ids": new,
            "stopped_at_eos": bool(new and new[-1] == eos),
            # rows: the last prompt position, then each greedy step's position
            "logits": b64(logits[rows].numpy()),
            "causal_logits": b64(causal[rows].numpy()),
        }
    return out


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
        model.config.architectures = ["Gemma3ForConditionalGeneration"]
        model.save_pretrained(hf)
        released_layout(hf / "model.safetensors")
        proc.save_pretrained(hf)
        cfg = hf / "tokenizer_config.json"  # the template writes <bos>: the tokenizer must not
        cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "add_bos_token": False}))
        convert(args.llama_cpp, hf, OUT / "gemma3-text.gguf")
        convert(args.llama_cpp, hf, OUT / "mmproj-gemma3.gguf", "--mmproj")
    stamp = args.llama_cpp / "COMMIT"
    commit = stamp.read_text().strip() if stamp.is_file() else None
    record = {
        "recorder": {
            "script": "tests/tools/record_gemma3_vision_fixtures.py",
            "llama_cpp_commit": commit,
            "python": platform.python_version(),
            "versions": {
                p: md.version(p) for p in ("torch", "transformers", "tokenizers", "pillow", "numpy")
            },
            "seed": SEED,
            "dtype": "float32 (weights rounded to float16)",
            "image_processor": "Gemma3ImageProcessorPil",
        },
        "processor": {"size": TILE, "image_seq_length": TOKENS, "sliding_window": WINDOW},
        "vocab_size": len(tok),
        "image_token_id": tok.convert_tokens_to_ids("<image_soft_token>"),
        "eos_id": tok.eos_token_id,
        "images": record_images(model, proc, ["tall.png", "wide.png"]),
        "chats": record_chats(model, proc),
    }
    (OUT / "gemma3.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
