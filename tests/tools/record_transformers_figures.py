"""Measure transformers (fp32, GGUF loader) against a recorded llama.cpp golden.

Runs under the reference venv (transformers + accelerate + gguf + torch), never imports localllm::

    HF_HUB_OFFLINE=1 /root/refvenv/bin/python tests/tools/record_transformers_figures.py \
        --golden tests/data/goldens/smollm2.json --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf

Writes ``tests/data/goldens/<name>.transformers.json`` with:

* ``tokenizer``: does the HF tokenizer reproduce llama.cpp's prompt/text token ids, and does
  ``apply_chat_template`` reproduce the recorded rendered chat prompts;
* ``teacher_forced``: :func:`golden_metrics.teacher_forced_metrics` over the golden text (top-1
  agreement with llama.cpp's argmax, mean KL(P_llama || Q_hf) top-K+tail estimate, both PPLs);
* ``greedy``: :func:`golden_metrics.greedy_report` (greedy prefix match per prompt, llama.cpp's
  log-prob gap at the first divergence, plus transformers' own gap there) and
  :func:`golden_metrics.greedy_teacher_forced_report` on llama.cpp's greedy sequences.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import golden_metrics as gm


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def load(gguf: Path, with_tokenizer: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tok = (
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if with_tokenizer
        else None
    )
    t1 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    model.eval()
    t2 = time.perf_counter()
    return tok, model, {"tokenizer_load_s": round(t1 - t0, 2), "model_load_s": round(t2 - t1, 2)}


def tokenizer_checks(tok, golden: dict) -> dict:
    per = {}
    for p in golden["greedy"]["prompts"]:
        ids = tok(p["text"], add_special_tokens=True)["input_ids"]
        entry = {"ids_match": list(ids) == list(p["prompt_ids"])}
        if p["kind"] == "chat":
            rendered = tok.apply_chat_template(
                p["messages"], tokenize=False, add_generation_prompt=True
            )
            entry["chat_template_match"] = rendered == p["text"]
        per[p["name"]] = entry
    tf = golden["teacher_forced"]
    tf_ids = tok(tf["text"], add_special_tokens=True)["input_ids"]
    return {
        "per_prompt": per,
        "all_prompt_ids_match": all(e["ids_match"] for e in per.values()),
        "teacher_forced_ids_match": list(tf_ids) == list(tf["token_ids"]),
        "has_chat_template": bool(getattr(tok, "chat_template", None)),
    }


@torch.no_grad()
def forward_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits (T, V) of one uncached forward pass over ids."""
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], n_predict: int, eog: set[int]):
    """Greedy decoding with the KV cache; returns (ids, per-step float32 logits rows)."""
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=1)
    # transformers 5.2x renamed past_key_values to cache (the old name warns)
    kw = "cache" if "cache" in out else "past_key_values"
    past, logits = out[kw], out.logits[0, -1]
    gen, rows = [], []
    for step in range(n_predict):
        t = int(torch.argmax(logits))
        gen.append(t)
        rows.append(logits.float().numpy().copy())
        if t in eog or step + 1 == n_predict:
            break
        out = model(input_ids=torch.tensor([[t]]), use_cache=True, **{kw: past})
        past, logits = out[kw], out.logits[0, -1]
    return gen, rows


def greedy_figures(model, golden: dict) -> dict:
    steps_rows: dict[str, list[np.ndarray]] = {}
    texts: dict[str, list[int]] = {}

    def gen_fn(prompt_ids, n_predict, eog):
        ids, rows = hf_greedy(model, prompt_ids, n_predict, eog)
        key = json.dumps(prompt_ids)
        steps_rows[key], texts[key] = rows, ids
        return ids

    rep = gm.greedy_report(golden, gen_fn)
    for p, r in zip(golden["greedy"]["prompts"], rep["per_prompt"], strict=True):
        key = json.dumps(p["prompt_ids"])
        r["our_ids"] = texts[key]
        d = r.get("diverged_at")
        if "our_choice" in r:  # transformers' own margin between its choice and llama.cpp's
            lp = gm.log_softmax(steps_rows[key][d])
            r["hf_logprob_gap"] = float(lp[r["our_choice"]] - lp[r["ref_choice"]])
    tfr = []
    for p in golden["greedy"]["prompts"]:
        ids, first, n = gm.greedy_sequence(p)
        logits = forward_logits(model, ids)[first : first + n].numpy()
        tfr.append(gm.greedy_teacher_forced_report(p, logits))
    rep["teacher_forced_on_llamacpp_greedy"] = {
        "per_prompt": tfr,
        "n_steps": sum(x["n_steps"] for x in tfr),
        "n_argmax_agree": sum(x["n_argmax_agree"] for x in tfr),
        "first_step_top1_match_all": all(x["first_step_top1_match"] for x in tfr),
        "max_ref_token_margin": max(x["max_ref_token_margin"] for x in tfr),
        "max_abs_top10_diff": max(x["max_abs_top10_diff"] for x in tfr),
        "mean_abs_top10_diff": float(np.mean([x["mean_abs_top10_diff"] for x in tfr])),
    }
    rep["summary_n_match"] = {r["name"]: f"{r['n_match']}/{r['n_ref']}" for r in rep["per_prompt"]}
    return rep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--golden", required=True, help="tests/data/goldens/<name>.json[.gz]")
    ap.add_argument("--gguf", required=True, help="the same GGUF file the golden was recorded on")
    ap.add_argument("--out", default=None, help="default: <golden dir>/<name>.transformers.json")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-tokenizer", action="store_true", help="skip tokenizer checks (slow load)")
    ap.add_argument("--no-greedy", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    golden = gm.load_golden(a.golden)
    name = golden["model"]["name"]
    out = Path(a.out) if a.out else Path(a.golden).parent / f"{name}.transformers.json"
    gguf = Path(a.gguf).resolve()

    tok, model, timings = load(gguf, not a.no_tokenizer)
    print(f"[{name}] loaded {timings}", file=sys.stderr)
    res = {
        "schema_version": 1,
        "golden": Path(a.golden).name,
        "golden_model_sha256": golden["model"]["sha256"],
        "script": "tests/tools/record_transformers_figures.py",
        "versions": {
            d: _version(d)
            for d in (
                "transformers",
                "torch",
                "accelerate",
                "gguf",
                "numpy",
                "tokenizers",
                "sentencepiece",
            )
        },
        "python": platform.python_version(),
        "settings": {
            "dtype": "float32",
            "threads": a.threads,
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "model_class": type(model).__name__,
            "greedy": "argmax of fp32 logits with DynamicCache, stop after an EOG id "
            "from the golden's model.eog_ids",
            "kl": "top-K + tail estimate of KL(P_llama || Q_hf), see golden_metrics",
        },
        "timings": timings,
    }
    if tok is not None:
        res["tokenizer"] = tokenizer_checks(tok, golden)
        print(f"[{name}] tokenizer: {json.dumps(res['tokenizer'])}", file=sys.stderr)

    t0 = time.perf_counter()
    logits = forward_logits(model, golden["teacher_forced"]["token_ids"])
    n = golden["teacher_forced"]["n_positions"]
    blocks = (logits[s : min(n, s + 128)].numpy() for s in range(0, n, 128))
    res["teacher_forced"] = gm.teacher_forced_metrics(golden, blocks)
    del logits
    res["timings"]["teacher_forced_s"] = round(time.perf_counter() - t0, 2)
    print(f"[{name}] teacher-forced: {json.dumps(res['teacher_forced'])}", file=sys.stderr)

    if not a.no_greedy:
        t0 = time.perf_counter()
        res["greedy"] = greedy_figures(model, golden)
        res["timings"]["greedy_s"] = round(time.perf_counter() - t0, 2)
        print(f"[{name}] greedy: {json.dumps(res['greedy']['summary_n_match'])}", file=sys.stderr)
    out.write_text(json.dumps(res, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"[{name}] wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
