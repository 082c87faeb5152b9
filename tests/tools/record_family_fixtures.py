"""Record the converted-family fixtures: tiny random-weight transformers models of the families the
engine gained (SmolLM3, OLMo 2, Gemma 2, GLM-4.5/4.6 MoE), converted by llama.cpp's own
`convert_hf_to_gguf.py`, with transformers' fp32 outputs as JSON goldens.

Runs with a Python that has torch, transformers, tokenizers, sentencepiece and safetensors (this
script never imports localllm), from the repository root, with an export of llama.cpp
(`convert_hf_to_gguf.py`, `conversion/`, `gguf-py/`, `models/templates/`):

    python tests/tools/record_family_fixtures.py --llama-cpp /path/to/llama.cpp [--only NAME,..]

Per family NAME it writes into tests/data/families/:
* `NAME.gguf`: the converter's output (`--outtype f16`). The weights are drawn (fixed seed),
  then rounded to float16 before anything else, so the F16 file holds exactly the values
  transformers computes with in float32.
* `NAME.json`: the config, the tokenizer's ids of a plain prompt, transformers' greedy tokens
  from it, the fp32 logits of every position of prompt + greedy tokens (teacher-forced, base64
  float32), and the real chat template's renders (text and ids) of a few conversations.

The converter runs unchanged in a subprocess with the export's own gguf-py first on sys.path (the
installed gguf may predate the architectures); one shim: it names a BPE pre-tokenizer from a hash
of its output on a fixed text and refuses unknown ones, so the recorder makes it answer the real
model's name (`llama-bpe`, `dbrx`, `glm4`) for these tiny vocabularies, which use that regex.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_tokenizers
from family_specs import FAMILIES, OLMO2_TEMPLATE, Family

OUT = Path(__file__).resolve().parents[1] / "data" / "families"
SEED = 0
PROMPT = "The capital of France is Paris. What is the weather in Paris"
N_GREEDY = 10

BOOTSTRAP = """
import runpy, sys
root, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [root + "/gguf-py", root]
import conversion.base as base
if pre:
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [root + "/convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def template_source(family: Family, llama_cpp: Path) -> str:
    if family.template == "olmo2":
        return OLMO2_TEMPLATE
    return (llama_cpp / "models" / "templates" / family.template).read_text(encoding="utf-8")


def build_tokenizer(family: Family, template: str, out: Path):
    from transformers import AutoTokenizer

    if family.pre:
        tiny_tokenizers.byte_bpe(out, 140, family.added, chat_template=template, **family.special)
    else:
        tiny_tokenizers.gemma_spm(out, 150, template)
    return AutoTokenizer.from_pretrained(out)


@torch.no_grad()
def randomize(model, family: Family) -> None:
    """Weights that keep activations O(1) and logits spread out: linears N(0, 1/fan_in), the
    router 3x wider (clear-cut expert choices), norms 1 + N(0, 0.1^2), embeddings N(0, 0.2^2)
    (small beside what the layers add: a tied head then does not just echo the input token);
    every value then rounded to float16 (the file stores F16)."""
    g = torch.Generator().manual_seed(SEED)
    for name, p in model.named_parameters():
        if p.ndim == 1 or "norm" in name:
            base = 0.0 if family.gemma_norms or name.endswith("bias") else 1.0
            scale = 0.5 if name.endswith("bias") else 0.1
            p.copy_(base + scale * torch.randn(p.shape, generator=g))
        elif "embed_tokens" in name:
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
        else:
            gain = 3.0 if name.endswith("mlp.gate.weight") else 1.0
            p.copy_(gain * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # the router's learned choice bias
            b.copy_(0.2 * torch.randn(b.shape, generator=g))
    stored = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    for t in (*model.parameters(), *stored):  # (not rope's inv_freq: computed, never stored)
        t.copy_(t.half().float())


def add_mtp_layer(hf_dir: Path, model) -> None:
    """The NextN (multi-token prediction) layer GLM checkpoints ship after the last layer: a full
    MoE layer plus eh_proj, enorm, hnorm and shared_head.norm (transformers ignores it)."""
    from safetensors.torch import load_file, save_file

    path = hf_dir / "model.safetensors"
    state = load_file(path)
    last, mtp = model.config.num_hidden_layers - 1, model.config.num_hidden_layers
    g = torch.Generator().manual_seed(SEED + 1)
    prefix = f"model.layers.{last}."
    for k in [k for k in state if k.startswith(prefix)]:
        t = state[k]
        state[k.replace(prefix, f"model.layers.{mtp}.")] = (
            (t + 0.1 * torch.randn(t.shape, generator=g)).half().float()
        )
    d = model.config.hidden_size
    state[f"model.layers.{mtp}.eh_proj.weight"] = torch.randn(d, 2 * d, generator=g).half().float()
    for n in ("enorm", "hnorm", "shared_head.norm"):
        state[f"model.layers.{mtp}.{n}.weight"] = torch.ones(d)
    save_file(state, str(path), metadata={"format": "pt"})


def convert(llama_cpp: Path, hf_dir: Path, pre: str, out: Path) -> None:
    cmd = [sys.executable, "-c", BOOTSTRAP, str(llama_cpp), pre, str(hf_dir),
           "--outfile", str(out), "--outtype", "f16"]  # fmt: skip
    subprocess.run(cmd, check=True)


def b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.detach().float().contiguous().numpy().tobytes()).decode("ascii")


@torch.no_grad()
def record(model, tokenizer, family: Family) -> dict:
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, max_new_tokens=N_GREEDY, do_sample=False, min_new_tokens=N_GREEDY,
                         pad_token_id=0, eos_token_id=None)  # fmt: skip
    greedy = out[0, len(prompt_ids) :].tolist()
    seq = prompt_ids + greedy
    logits = model(torch.tensor([seq])).logits[0]
    renders = {}
    for name, kw in family.renders.items():
        rest = {k: v for k, v in kw.items() if k != "messages"}
        text = tokenizer.apply_chat_template(
            kw["messages"], add_generation_prompt=True, tokenize=False, **rest
        )
        renders[name] = {
            "kwargs": {k: v for k, v in kw.items() if k not in ("messages", "tools")},
            "messages": kw["messages"],
            "tools": kw.get("tools"),
            "text": text,
            "ids": tokenizer(text, add_special_tokens=False)["input_ids"],
        }
    return {
        "prompt": {"text": PROMPT, "ids": prompt_ids},
        "greedy_ids": greedy,
        "logits": {"shape": list(logits.shape), "dtype": "float32", "base64": b64(logits)},
        "renders": renders,
    }


def record_family(name: str, family: Family, llama_cpp: Path, tmp: Path) -> Path:
    import transformers

    hf_dir = tmp / name
    template = template_source(family, llama_cpp)
    tokenizer = build_tokenizer(family, template, hf_dir)
    cfg_cls = getattr(transformers, family.config_class)
    special = {k: tokenizer.convert_tokens_to_ids(v) for k, v in family.special.items()}
    cfg = cfg_cls(
        vocab_size=len(tokenizer),
        bos_token_id=special.get("bos_token", tokenizer.bos_token_id),
        eos_token_id=special.get("eos_token", tokenizer.eos_token_id),
        pad_token_id=special.get("pad_token", tokenizer.pad_token_id),
        attn_implementation="eager",
        **family.config,
    )
    torch.manual_seed(SEED)
    model = getattr(transformers, family.model_class)(cfg).eval()
    randomize(model, family)
    model.save_pretrained(hf_dir)
    if family.mtp:
        add_mtp_layer(hf_dir, model)
    gguf = OUT / f"{name}.gguf"
    convert(llama_cpp, hf_dir, family.pre, gguf)
    golden = {
        "model": {
            "class": family.model_class,
            "seed": SEED,
            "config": {k: v for k, v in cfg.to_dict().items() if not k.startswith("_")},
            "file": gguf.name,
            "weights": "drawn, rounded to float16, computed in float32",
        },
        "recorder": {
            "script": "tests/tools/record_family_fixtures.py",
            "llama_cpp_commit": git_head(llama_cpp),
            "chat_template": family.template,
            "torch": torch.__version__,
            "transformers": md.version("transformers"),
            "tokenizers": md.version("tokenizers"),
            "python": platform.python_version(),
            "dtype": "float32",
            "attn_implementation": "eager",
        },
        **record(model, tokenizer, family),
    }
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(golden, indent=1) + "\n", encoding="utf-8")
    return path


def git_head(repo: Path) -> str | None:
    marker = repo / "COMMIT"  # an export (git archive) carries its commit here
    if marker.is_file():
        return marker.read_text().strip()
    try:
        cmd = ["git", "-C", str(repo), "rev-parse", "HEAD"]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp checkout or export")
    ap.add_argument("--only", help="comma-separated family names (default: all)")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(FAMILIES)
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            path = record_family(name, FAMILIES[name], args.llama_cpp, Path(tmp))
            print(f"wrote {path} and {path.with_suffix('.gguf').name}")


if __name__ == "__main__":
    main()
