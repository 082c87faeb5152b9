"""Record the LLaVA-1.5 fixtures: a tiny random-weight LlavaForConditionalGeneration (CLIP tower,
`mlp` projector, llama text model) built with transformers, converted the way llama.cpp converts
LLaVA-1.5: the text model by `convert_hf_to_gguf.py`, the tower + projector by its
`tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py` (`--clip-model-is-vision
--llava-projector`: the tower without its last layer and post-layernorm, as LLaVA's
`vision_feature_layer = -2` uses it; its legacy names swap `ffn_up`/`ffn_down`).

Runs like `record_vision_fixtures.py`, from the repository root, with an export of llama.cpp
that also holds `tools/mtmd/legacy-models/`:

    git --git-dir=/work/.mirror/ngxson+llama.cpp/repo archive HEAD convert_hf_to_gguf.py \\
        conversion gguf-py tools/mtmd/legacy-models | tar -x -C /tmp/llama.cpp
    python tests/tools/record_llava_fixtures.py --llama-cpp /tmp/llama.cpp

Reads `tests/data/vision/tall.png` and `wide.png`; writes `llava-text.gguf`,
`mmproj-llava.gguf` (F16 matrices, F32 vectors; weights drawn with a fixed seed and rounded to
float16 first) and `llava.json`: per image the `LlavaImageProcessorPil` pixel values (shortest
edge to 32 px with BICUBIC, centre crop 32 x 32, CLIP's mean/std, as llava-1.5-hf's processor
at 336 px) and the tower + projector output; per conversation the template's text, the
processor's `input_ids`, transformers' greedy tokens and teacher-forced fp32 logits.

It also records LLaVA-1.6 (LLaVA-NeXT, anyres): the same weights in a
LlavaNextForConditionalGeneration with an `image_newline` vector and the grid pinpoints below
(336-px tiles scaled down to 32), converted by the same legacy script with the pinpoints and
`spatial_unpad` in the tower's config, as llama.cpp's `llava_surgery_v2.py` leaves them. The text
model is the same file (`llava-text.gguf`); `mmproj-llava16.gguf` and `llava16.json` (pixel
values of every tile, `image_sizes`, the packed features, ids, greedy tokens, logits).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_vision_fixtures import BOOTSTRAP, OUT, b64, convert

SEED = 0
N_GREEDY = 8
TILE = 32
PATCH = 4  # 8 x 8 = 64 image tokens (the CLS position is dropped)
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
PINPOINTS = [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]]  # (height, width), as 1.6's / 10.5

# llava-hf/llava-1.5-7b-hf's chat template without its `{% generation %}` markers (training only)
TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
CORPUS = [
    "USER: What is in this image? ASSISTANT: A cat sitting on a warm mat.",
    "Describe the picture. There is a red car, a blue sky and two trees.",
    "Compare the two images: the first is tall and the second is wide.",
    "Numbers 1 2 3 10 42. How many dogs are there? There are 3 dogs.",
]
SPECIALS = ["<unk>", "<s>", "</s>", "<image>", "<pad>"]
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

# One shim, for transformers 5, which dropped CLIPVisionModel's `vision_model` level: the legacy
# script reaches the layers through it and maps tensor names that start with it.
LEGACY = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root + "/gguf-py"]
import transformers
C = transformers.CLIPVisionModel
load = C.from_pretrained.__func__
def from_pretrained(cls, *a, **k):
    m = load(cls, *a, **k)
    if "vision_model" not in m._modules:
        object.__setattr__(m, "vision_model", m)  # not a submodule: no cycle
        sd = m.state_dict
        m.state_dict = lambda *x, **y: {"vision_model." + n: v for n, v in sd(*x, **y).items()}
    return m
C.from_pretrained = classmethod(from_pretrained)
script = root + "/tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py"
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
"""


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
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>", chat_template=TEMPLATE, extra_special_tokens={"image_token": "<image>"},
    )  # fmt: skip


def build(tok):
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(SEED)
    cfg = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=3, num_attention_heads=2, image_size=TILE,
                           patch_size=PATCH, layer_norm_eps=1e-5, hidden_act="quick_gelu",
                           projection_dim=64),
        text_config=dict(model_type="llama", vocab_size=len(tok), hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=1024, tie_word_embeddings=False,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )  # fmt: skip
    model = LlavaForConditionalGeneration(cfg).eval()
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
    from transformers import LlavaImageProcessorPil, LlavaProcessor

    ip = LlavaImageProcessorPil(
        size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE},
        image_mean=CLIP_MEAN, image_std=CLIP_STD, do_pad=False,
    )  # fmt: skip
    return LlavaProcessor(
        ip, tok, patch_size=PATCH, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=TEMPLATE,
    )  # fmt: skip


def convert_tower(llama_cpp: Path, model, work: Path, out: Path, anyres: bool = False) -> None:
    vdir = work / "vision"
    model.model.vision_tower.save_pretrained(vdir)
    proj = {k: v.float() for k, v in model.model.multi_modal_projector.state_dict().items()}
    proj = {f"multi_modal_projector.{k}": v for k, v in proj.items()}
    if anyres:  # what llava_surgery_v2 leaves: the newline beside the projector, grids in config
        proj["image_newline"] = model.model.image_newline.detach().float()
        cfg = json.loads((vdir / "config.json").read_text())
        cfg.update(image_grid_pinpoints=PINPOINTS, mm_patch_merge_type="spatial_unpad",
                   image_aspect_ratio="anyres")  # fmt: skip
        (vdir / "config.json").write_text(json.dumps(cfg))
    torch.save(proj, work / "llava.projector")
    cmd = [sys.executable, "-c", LEGACY, str(llama_cpp), "-m", str(vdir),
           "--clip-model-is-vision", "--llava-projector", str(work / "llava.projector"),
           "--output-dir", str(work / "mm"), "--image-mean", *map(str, CLIP_MEAN),
           "--image-std", *map(str, CLIP_STD)]  # fmt: skip
    subprocess.run(cmd, check=True)
    (work / "mm" / "mmproj-model-f16.gguf").replace(out)


def build_next(model):
    """LLaVA-1.6: the 1.5 model's weights, plus an image_newline vector and grid pinpoints."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    c = model.config
    cfg = LlavaNextConfig(
        vision_config=c.vision_config.to_dict(), text_config=c.text_config.to_dict(),
        image_token_index=c.image_token_index, vision_feature_layer=-2,
        vision_feature_select_strategy="default", projector_hidden_act="gelu",
        image_grid_pinpoints=PINPOINTS, tie_word_embeddings=False,
    )  # fmt: skip
    nxt = LlavaNextForConditionalGeneration(cfg).eval()
    result = nxt.load_state_dict(model.state_dict(), strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"model.image_newline"}
    with torch.no_grad():
        torch.manual_seed(SEED + 1)
        nxt.model.image_newline.copy_((torch.randn(64) * 0.5).half().float())
    return nxt


def next_processor(tok):
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

    ip = LlavaNextImageProcessorPil(
        size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE},
        image_mean=CLIP_MEAN, image_std=CLIP_STD, image_grid_pinpoints=PINPOINTS, do_pad=True,
    )  # fmt: skip
    return LlavaNextProcessor(
        ip, tok, patch_size=PATCH, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=TEMPLATE,
    )  # fmt: skip


def record_next_images(model, proc, names) -> dict:
    from PIL import Image

    out = {}
    for name in names:
        enc = proc.image_processor([Image.open(OUT / name)], return_tensors="pt")
        pv, sizes = enc["pixel_values"], enc["image_sizes"]
        with torch.no_grad():
            feats = model.model.get_image_features(pv, sizes).pooler_output[0]
        out[name] = {
            "image_size": sizes[0].tolist(),
            "pixel_shape": list(pv[0].shape),
            "pixel_values": b64(pv[0].numpy()),
            "feature_shape": list(feats.shape),
            "image_features": b64(feats.numpy()),
        }
    return out


def record_images(model, proc, names) -> dict:
    from PIL import Image

    out = {}
    for name in names:
        enc = proc.image_processor([Image.open(OUT / name)], return_tensors="pt")
        pv = enc["pixel_values"]
        with torch.no_grad():
            feats = model.model.get_image_features(
                pv, vision_feature_layer=-2, vision_feature_select_strategy="default"
            )
            feats = getattr(feats, "pooler_output", feats)
            feats = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats
            feats = feats.reshape(-1, 64)
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
    out = {}
    for name, messages in CONVERSATIONS.items():
        text = proc.apply_chat_template(messages, add_generation_prompt=True)
        images = [Image.open(OUT / n) for n in IMAGES[name]]
        enc = proc(text=text, images=images, return_tensors="pt")
        n = enc["input_ids"].shape[1]
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=N_GREEDY, do_sample=False)
            new = gen[0, n:].tolist()
            full = dict(enc, input_ids=gen, attention_mask=torch.ones_like(gen))
            logits = model(**full).logits[0]
        out[name] = {
            "messages": messages,
            "images": IMAGES[name],
            "text": text,
            "input_ids": enc["input_ids"][0].tolist(),
            "greedy_ids": new,
            "stopped_at_eos": bool(new and new[-1] == tok.eos_token_id),
            "logits": b64(logits[n - 1 : n - 1 + len(new) + 1].numpy()),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp export")
    args = ap.parse_args()
    assert BOOTSTRAP  # the text model goes through the same converter shim as the SmolVLM one
    torch.set_num_threads(1)
    tok = tokenizer()
    model = build(tok)
    proc = processor(tok)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        model.config.architectures = ["LlavaForConditionalGeneration"]
        model.save_pretrained(hf)
        proc.save_pretrained(hf)
        cfg = hf / "tokenizer_config.json"  # the template writes no <s>: nor does the tokenizer
        cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "add_bos_token": False}))
        convert(args.llama_cpp, hf, OUT / "llava-text.gguf")
        convert_tower(args.llama_cpp, model, Path(tmp), OUT / "mmproj-llava.gguf")
        nxt = build_next(model)
        with tempfile.TemporaryDirectory() as tmp2:
            convert_tower(args.llama_cpp, nxt, Path(tmp2), OUT / "mmproj-llava16.gguf", True)
    stamp = args.llama_cpp / "COMMIT"
    record = {
        "recorder": {
            "script": "tests/tools/record_llava_fixtures.py",
            "llama_cpp_commit": stamp.read_text().strip() if stamp.is_file() else None,
            "python": platform.python_version(),
            "versions": {
                p: md.version(p) for p in ("torch", "transformers", "tokenizers", "pillow", "numpy")
            },
            "seed": SEED,
            "dtype": "float32 (weights rounded to float16)",
            "image_processor": "LlavaImageProcessorPil",
        },
        "processor": {
            "size": TILE,
            "patch_size": PATCH,
            "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD,
        },
        "vocab_size": len(tok),
        "image_token_id": tok.convert_tokens_to_ids("<image>"),
        "eos_id": tok.eos_token_id,
        "images": record_images(model, proc, ["tall.png", "wide.png"]),
        "chats": record_chats(model, proc),
    }
    (OUT / "llava.json").write_text(json.dumps(record, indent=1) + "\n")
    nproc = next_processor(tok)
    record16 = {
        **{k: record[k] for k in ("recorder", "vocab_size", "image_token_id", "eos_id")},
        "processor": {**record["processor"], "image_grid_pinpoints": PINPOINTS},
        "images": record_next_images(nxt, nproc, ["tall.png", "wide.png"]),
        "chats": record_chats(nxt, nproc),
    }
    record16["recorder"] = {**record["recorder"], "image_processor": "LlavaNextImageProcessorPil"}
    (OUT / "llava16.json").write_text(json.dumps(record16, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
