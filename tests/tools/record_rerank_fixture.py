"""Record the cross-encoder (reranker) fixture: a tiny random-weight BertForSequenceClassification,
converted by llama.cpp's own converter, and transformers' fp32 scores on query-document pairs.

Runs with a Python that has torch, transformers, safetensors and numpy (this script never imports
localllm), from the repository root, with a checkout of llama.cpp (`convert_hf_to_gguf.py`,
`conversion/`, `gguf-py/`):

    python tests/tools/record_rerank_fixture.py --llama-cpp /path/to/llama.cpp

Writes into tests/data/rerank/:

* `tiny-bert-reranker.gguf`: llama.cpp's conversion of the model (F32). Like every
  BertForSequenceClassification GGUF the converter makes, it has no `bert.pooler.dense` (the
  converter drops it by name), only the classifier as `cls.output`: llama.cpp's graph then scores
  `classifier(h[CLS])`, not transformers' `classifier(tanh(pooler(h[CLS])))`.
* `tiny-bert-reranker-pooler.gguf`: the same model with the pooler saved under RoBERTa's head
  name `classifier.dense`, which the converter keeps as `cls`: llama.cpp's graph then runs
  `cls.output(tanh(cls(h[CLS])))`, which is exactly transformers' logit.
* `tiny-bert-reranker.json`: the pairs, transformers' tokenization of each pair (`input_ids`,
  `token_type_ids`), its logits (`logit`, the full model) and `logit_without_pooler`
  (`classifier(h[CLS])`, what the first file encodes), plus versions.

One shim: the converter names a tokenizer's pre-tokenizer from a hash of its output on a fixed
text and refuses unknown ones; this tiny vocabulary is unknown, so the recorder makes it answer
"default" (llama.cpp ignores `tokenizer.ggml.pre` for WordPiece vocabularies).
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

OUT = Path(__file__).resolve().parents[1] / "data" / "rerank"
SEED = 0

WORDS = ["the", "cat", "sat", "on", "mat", "dog", "run", "park", "in", "where", "does", "sleep",
         "hello", "world", "hat", "and", "what", "is", "capital", "of", "france", "paris",
         "berlin", "people", "live", "how", "many", "city"]  # fmt: skip
PIECES = ["##s", "##ing", "##ed", "##ly"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *".,!?'-", *"abcdehlmnoprstuwy", *WORDS,
         *PIECES]  # fmt: skip

PAIRS = {
    "where does the cat sleep?": [
        "the cat sleeps on the mat.",
        "dogs run in the park",
        "hello, world!",
        "a cat sat on a hat and slept",
        "xyz",
    ],
    "what is the capital of france?": [
        "paris is the capital of france.",
        "berlin is a city",
        "how many people live in paris?",
    ],
}

BOOTSTRAP = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root + "/gguf-py", root]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv = [root + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def build_model():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(SEED)
    cfg = BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=48,
        type_vocab_size=2,
        layer_norm_eps=1e-12,
        initializer_range=0.3,  # larger than BERT's 0.02: scores far apart, attention not uniform
        num_labels=1,
    )
    model = BertForSequenceClassification(cfg).eval()
    with torch.no_grad():  # non-trivial norms: weight 1 +- 0.2, bias +- 0.2
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.endswith("weight") else 0.0))
    return model


def save_hf(model, tokenizer, out: Path, pooler_as_head: bool) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    model.config.architectures = ["BertForSequenceClassification"]  # the converter's dispatch
    model.config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if pooler_as_head:  # RobertaClassificationHead's name for the same dense + tanh
        for suffix in ("weight", "bias"):
            state[f"classifier.dense.{suffix}"] = state.pop(f"bert.pooler.dense.{suffix}")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def convert(llama_cpp: Path, hf_dir: Path, out: Path) -> None:
    cmd = [sys.executable, "-c", BOOTSTRAP, str(llama_cpp), str(hf_dir),
           "--outfile", str(out), "--outtype", "f32"]  # fmt: skip
    subprocess.run(cmd, check=True)


def record(model, tokenizer) -> list[dict]:
    rows = []
    for query, docs in PAIRS.items():
        for doc in docs:
            enc = tokenizer(query, doc, return_tensors="pt")
            with torch.no_grad():
                out = model(**enc, output_hidden_states=True)
                h = out.hidden_states[-1][0, 0]
                bare = model.classifier(h)
            rows.append(
                {
                    "query": query,
                    "document": doc,
                    "input_ids": enc["input_ids"][0].tolist(),
                    "token_type_ids": enc["token_type_ids"][0].tolist(),
                    "logit": float(out.logits[0, 0]),
                    "logit_without_pooler": float(bare[0]),
                }
            )
    return rows


def git_head(repo: Path) -> str | None:
    try:
        cmd = ["git", "-C", str(repo), "rev-parse", "HEAD"]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp checkout")
    ap.add_argument("--llama-cpp-commit", help="its commit, when the checkout is no git tree")
    args = ap.parse_args()
    from transformers import BertTokenizerFast

    torch.set_num_threads(1)
    model = build_model()
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "vocab.txt").write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
        # from a folder: transformers 5 ignores a `vocab_file` argument (5 special tokens only)
        tokenizer = BertTokenizerFast.from_pretrained(tmp, do_lower_case=True)
        assert len(tokenizer.vocab) == len(VOCAB), len(tokenizer.vocab)
        for name, pooler in (("tiny-bert-reranker", False), ("tiny-bert-reranker-pooler", True)):
            hf = save_hf(model, tokenizer, Path(tmp) / name, pooler)
            convert(args.llama_cpp, hf, OUT / f"{name}.gguf")
        rows = record(model, tokenizer)
    fixture = {
        "model": {
            "class": "BertForSequenceClassification",
            "seed": SEED,
            "config": {k: v for k, v in model.config.to_dict().items() if not k.startswith("_")},
            "vocab": VOCAB,
        },
        "files": {
            "tiny-bert-reranker.gguf": "llama.cpp's conversion: no pooler, head = cls.output",
            "tiny-bert-reranker-pooler.gguf": "pooler kept as cls: head = cls.output(tanh(cls))",
        },
        "recorder": {
            "script": "tests/tools/record_rerank_fixture.py",
            "llama_cpp_commit": args.llama_cpp_commit or git_head(args.llama_cpp),
            "torch": torch.__version__,
            "transformers": md.version("transformers"),
            "tokenizers": md.version("tokenizers"),
            "python": platform.python_version(),
            "dtype": "float32",
        },
        "pairs": rows,
    }
    path = OUT / "tiny-bert-reranker.json"
    path.write_text(json.dumps(fixture, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path} and the two GGUFs ({len(rows)} pairs)")


if __name__ == "__main__":
    main()
