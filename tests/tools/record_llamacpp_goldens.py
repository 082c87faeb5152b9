"""Record llama.cpp reference outputs ("goldens") for a GGUF model into tests/data/goldens/.

Runs under the reference venv (llama-cpp-python), never imports localllm::

    /root/refvenv/bin/python tests/tools/record_llamacpp_goldens.py \
        --name smollm2 --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf --chat

What is recorded (schema in tests/tools/README.md):

* greedy: for each prompt, llama.cpp's tokenization, 48 greedy tokens (stop after an EOG token)
  and at every step the top-10 (id, logprob) of llama.cpp's distribution plus the chosen token's
  logprob.
  Log-probs are log_softmax of the raw float32 logits, computed in float64, rounded to 5 decimals.
* teacher_forced: a ~6,700-character English text from Python's own docs (pydoc_data.topics),
  evaluated in n_batch chunks with logits at every position; per position t (predicting token t+1):
  logprob of the actual next token, argmax id, top-64 (id, logprob) and log of the mass outside
  the top-64; plus llama.cpp's perplexity.
* checks: the whole recording is done twice in fresh contexts (bit-identity of the raw logits,
  via sha256) and a subset once more with 2 threads.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import gzip
import hashlib
import json
import platform
import sys
import time
from pathlib import Path

import jinja2
import jinja2.sandbox
import llama_cpp
import numpy as np
from llama_cpp import Llama

N_PREDICT = 48
TOP_N = 10
TOP_K = 64
ROUND = 5
SETTINGS = dict(n_ctx=2048, n_batch=512, n_threads=1, n_threads_batch=1, logits_all=False)

PLAIN_PROMPTS = [
    ("capital", "The capital of France is"),
    ("fibonacci", "def fibonacci(n):"),
    ("planets_list", "Here is a list of the planets in our solar system:\n1."),
    ("story", "Once upon a time, in a small village at the edge of a dark forest,"),
    ("unicode", "Unicode test: naïve café, Zürich, 東京, Москва, emoji 🙂 → The word for"),
    ("numbers", "1, 2, 3, 5, 8, 13, 21, 34,"),
    ("arithmetic", "Question: What is 17 times 23?\nAnswer: 17 times 23 is"),
    ("python_mean", "import numpy as np\n\n# Compute the mean of each column of a 2-D array\n"),
    ("whitespace", "  Indented line\n\tTabbed line\n\nName:   Alice   Age: 30\nName:"),
]
CHAT_PROMPTS = [  # SmolLM2 only: rendered through the GGUF's chat template
    ("chat_default_system", [{"role": "user", "content": "What is 2+2?"}]),
    ("chat_default_system_haiku", [{"role": "user", "content": "Write a haiku about autumn."}]),
    (
        "chat_system",
        [
            {"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
            {"role": "user", "content": "Why is the sky blue?"},
        ],
    ),
    (
        "chat_multi_turn",
        [
            {"role": "system", "content": "You are a helpful assistant who speaks like a pirate."},
            {"role": "user", "content": "Hi! Who are you?"},
            {
                "role": "assistant",
                "content": "Arr, I be yer trusty helper on the high seas of code!",
            },
            {"role": "user", "content": "Name three colors."},
        ],
    ),
]
GEMMA_TURN_PROMPT = (
    "turn_markers",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
)
TEXT_SECTIONS = ("objects", "exceptions")


def teacher_forced_text() -> tuple[str, str]:
    """The teacher-forced text: two sections of Python's docs, footnotes dropped."""
    from pydoc_data.topics import topics

    parts = [topics[k].split("-[ Footnotes ]-")[0].strip() for k in TEXT_SECTIONS]
    src = (
        f"pydoc_data.topics.topics[{TEXT_SECTIONS!r}] (Python {platform.python_version()}), "
        "each cut before '-[ Footnotes ]-', stripped, joined with a blank line"
    )
    return "\n\n".join(parts), src


def render_chat_hf(template: str, messages: list[dict], special: dict) -> str:
    """Render like transformers' apply_chat_template(add_generation_prompt=True, tokenize=False)."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: _dt.datetime.now().strftime(fmt)
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=True, tools=None, documents=None, **special
    )


def logits_view(llm: Llama, i: int) -> np.ndarray:
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, i)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))


def log_softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    z = x - np.max(x, axis=-1, keepdims=True)
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


def top_n(lp: np.ndarray, n: int) -> np.ndarray:
    """Indices of the n largest entries, by descending value then ascending id."""
    idx = np.argpartition(-lp, n)[:n]
    return idx[np.lexsort((idx, -lp[idx]))]


def r(x) -> float:
    return round(float(x), ROUND)


def make_llm(path: str, threads: int) -> Llama:
    s = dict(SETTINGS, n_threads=threads, n_threads_batch=threads)
    return Llama(model_path=path, verbose=False, **s)


def eog_ids(llm: Llama) -> list[int]:
    vocab = llm._model.vocab
    return [i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]


def detokenize(llm: Llama, ids: list[int]) -> str:
    """Concatenated pieces (special tokens rendered), with a buffer large enough for any piece."""
    buf = ctypes.create_string_buffer(1024)
    out = []
    for t in ids:  # call first, then read the buffer
        n = llama_cpp.llama_token_to_piece(llm._model.vocab, t, buf, 1024, 0, True)
        out.append(buf.raw[:n])
    return b"".join(out).decode("utf-8", errors="replace")


def greedy(llm: Llama, prompt_ids: list[int], eog: set[int], h) -> dict:
    llm.reset()
    llm.eval(prompt_ids)
    gen, chosen, tids, tlps = [], [], [], []
    stopped = False
    for step in range(N_PREDICT):
        logits = logits_view(llm, -1)
        h.update(logits.tobytes())
        lp = log_softmax64(logits)
        tok = int(np.argmax(logits))
        idx = top_n(lp, TOP_N)
        gen.append(tok)
        chosen.append(r(lp[tok]))
        tids.append([int(i) for i in idx])
        tlps.append([r(lp[i]) for i in idx])
        if tok in eog:
            stopped = True
            break
        if step + 1 < N_PREDICT:
            llm.eval([tok])
    text = detokenize(llm, gen)
    return dict(
        generated_ids=gen,
        generated_text=text,
        stopped_at_eog=stopped,
        chosen_logprobs=chosen,
        top_ids=tids,
        top_logprobs=tlps,
    )


def teacher_forced(llm: Llama, ids: list[int], h) -> dict:
    """Evaluate ids in n_batch chunks with logits at every position (low-level batch API)."""
    llm.reset()
    llm._ctx.kv_cache_clear()
    n = len(ids) - 1  # predicting positions
    nxt, amax, kid, klp, tail = [], [], [], [], []
    n_past = 0
    for s in range(0, len(ids), llm.n_batch):
        chunk = ids[s : s + llm.n_batch]
        llm._batch.set_batch(batch=chunk, n_past=n_past, logits_all=True)
        llm._ctx.decode(llm._batch)
        n_past += len(chunk)
        block = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(len(chunk), llm.n_vocab()))
        h.update(block.tobytes())
        for b in range(0, len(chunk), 64):
            lps = log_softmax64(block[b : b + 64])
            for j, lp in enumerate(lps):
                t = s + b + j
                if t >= n:
                    break
                idx = top_n(lp, TOP_K)
                mask = np.ones(lp.shape[0], dtype=bool)
                mask[idx] = False
                rest = lp[mask]
                m = rest.max()
                tail.append(r(m + np.log(np.sum(np.exp(rest - m)))))
                nxt.append(r(lp[ids[t + 1]]))
                amax.append(int(np.argmax(block[b + j])))
                kid.append([int(i) for i in idx])
                klp.append([r(lp[i]) for i in idx])
    llm.n_tokens = 0
    nll = -float(np.mean(nxt))
    return dict(
        n_positions=n,
        top_k=TOP_K,
        next_logprob=nxt,
        argmax_ids=amax,
        topk_ids=kid,
        topk_logprobs=klp,
        log_tail_mass=tail,
        mean_nll=nll,
        ppl=float(np.exp(nll)),
    )


def build_prompts(llm: Llama, chat: bool, gemma_turns: bool) -> list[dict]:
    out = [dict(name=n, kind="plain", text=t, parse_special=False) for n, t in PLAIN_PROMPTS]
    if chat:
        meta = llm.metadata
        tmpl = meta["tokenizer.chat_template"]
        m = llm._model
        special = dict(
            bos_token=m.token_get_text(m.token_bos()), eos_token=m.token_get_text(m.token_eos())
        )
        for n, msgs in CHAT_PROMPTS:
            out.append(
                dict(
                    name=n,
                    kind="chat",
                    messages=msgs,
                    parse_special=True,
                    text=render_chat_hf(tmpl, msgs, special),
                )
            )
    if gemma_turns:
        out.append(
            dict(
                name=GEMMA_TURN_PROMPT[0],
                kind="plain_turn_markers",
                text=GEMMA_TURN_PROMPT[1],
                parse_special=True,
            )
        )
    return out


def record(path: str, threads: int, chat: bool, gemma_turns: bool, only: int | None = None):
    """One full recording in a fresh Llama. Returns (result dict, sha256 per section)."""
    t0 = time.perf_counter()
    llm = make_llm(path, threads)
    load_s = time.perf_counter() - t0
    eog = eog_ids(llm)
    add_bos = bool(llm._model.add_bos_token())
    prompts = build_prompts(llm, chat, gemma_turns)
    if only is not None:
        prompts = [prompts[0], prompts[-1]][:only]
    hg, ht, per_prompt = hashlib.sha256(), hashlib.sha256(), {}
    for p in prompts:
        p["add_special"] = True
        p["add_bos"] = add_bos
        p["prompt_ids"] = llm.tokenize(
            p["text"].encode("utf-8"), add_bos=True, special=p["parse_special"]
        )
        hp = hashlib.sha256()
        p.update(greedy(llm, p["prompt_ids"], set(eog), hp))
        per_prompt[p["name"]] = hp.hexdigest()
        hg.update(hp.digest())
    text, src = teacher_forced_text()
    tf_ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    t1 = time.perf_counter()
    tf = dict(
        source=src,
        text=text,
        add_special=True,
        add_bos=add_bos,
        parse_special=False,
        token_ids=tf_ids,
        **teacher_forced(llm, tf_ids, ht),
    )
    tf_s = time.perf_counter() - t1
    info = dict(llm=llm, eog=eog, add_bos=add_bos, load_s=load_s, tf_s=tf_s)
    hashes = dict(
        greedy=hg.hexdigest(), teacher_forced=ht.hexdigest(), greedy_per_prompt=per_prompt
    )
    return prompts, tf, hashes, info


def model_section(name: str, path: str, llm: Llama, eog: list[int], add_bos: bool) -> dict:
    m, meta = llm._model, llm.metadata
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            sha.update(chunk)
    keep = (
        "general.name",
        "general.architecture",
        "general.file_type",
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_eos_token",
    )
    return {
        "name": name,
        "file": Path(path).name,
        "file_size": Path(path).stat().st_size,
        "sha256": sha.hexdigest(),
        "n_vocab": llm.n_vocab(),
        "n_ctx_train": m.n_ctx_train(),
        "bos_id": m.token_bos(),
        "eos_id": m.token_eos(),
        "eog_ids": eog,
        "add_bos": add_bos,
        "add_eos": bool(m.add_eos_token()),
        "metadata": {k: meta[k] for k in keep if k in meta},
        "chat_template": meta.get("tokenizer.chat_template"),
    }


def settings_section(llm: Llama) -> dict:
    cp = llm.context_params
    return {
        **SETTINGS,
        "n_ubatch": cp.n_ubatch,
        "type_k": int(cp.type_k),
        "type_v": int(cp.type_v),
        "type_k_name": "f16" if cp.type_k == 1 else str(cp.type_k),
        "flash_attn_type": int(cp.flash_attn_type),
        "flash_attn_note": "-1 auto, 0 disabled, 1 enabled; llama-cpp-python's Llama("
        "flash_attn=False) default sets 0 (disabled)",
        "swa_full": bool(cp.swa_full),
        "logprobs": "log_softmax(float64(raw float32 logits)), rounded to 5 decimals",
        "greedy": "numpy argmax of raw logits (lowest id on ties)",
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--name", required=True, help="golden name, e.g. smollm2 or gemma3")
    ap.add_argument("--gguf", required=True, help="path of the GGUF file")
    ap.add_argument("--chat", action="store_true", help="add chat-templated prompts (ChatML)")
    ap.add_argument("--gemma-turns", action="store_true", help="add the Gemma turn-marker prompt")
    ap.add_argument("--out", default=None, help="default tests/data/goldens/<name>.json")
    ap.add_argument("--no-checks", action="store_true", help="skip the repeat/2-thread checks")
    a = ap.parse_args(argv)
    root = Path(__file__).resolve().parents[2]
    out = Path(a.out) if a.out else root / "tests" / "data" / "goldens" / f"{a.name}.json"

    prompts, tf, hashes, info = record(a.gguf, 1, a.chat, a.gemma_turns)
    llm = info["llm"]
    print(
        f"[{a.name}] load {info['load_s']:.2f}s, teacher-forced {len(tf['token_ids'])} tokens "
        f"in {info['tf_s']:.1f}s, ppl {tf['ppl']:.4f}",
        file=sys.stderr,
    )
    golden = {
        "schema_version": 1,
        "model": model_section(a.name, a.gguf, llm, info["eog"], info["add_bos"]),
        "recorder": {
            "script": "tests/tools/record_llamacpp_goldens.py",
            "llama_cpp_python": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode().strip(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "jinja2": jinja2.__version__,
            "machine": platform.machine(),
            "date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "settings": settings_section(llm),
        },
        "checks": {"logits_sha256": hashes},
        "greedy": {"n_predict": N_PREDICT, "top_n": TOP_N, "prompts": prompts},
        "teacher_forced": tf,
    }
    del llm, info
    if not a.no_checks:
        p2, tf2, h2, _ = record(a.gguf, 1, a.chat, a.gemma_turns)
        same = h2 == hashes and p2 == prompts and tf2 == tf
        golden["checks"]["repeat_bit_identical"] = same
        p3, tf3, h3, _ = record(a.gguf, 2, a.chat, a.gemma_turns, only=2)
        per = {}
        for q in p3:
            ref = next(p for p in prompts if p["name"] == q["name"])
            per[q["name"]] = {
                "raw_logits_sha256_identical": h3["greedy_per_prompt"][q["name"]]
                == hashes["greedy_per_prompt"][q["name"]],
                "rounded_identical": q == ref,
            }
        golden["checks"]["two_threads"] = {
            "n_threads": 2,
            "greedy_prompts": per,
            "teacher_forced_logits_sha256_identical": h3["teacher_forced"]
            == hashes["teacher_forced"],
            "teacher_forced_identical_rounded": tf3 == tf,
        }
        print(f"[{a.name}] checks: {json.dumps(golden['checks'])}", file=sys.stderr)
    data = json.dumps(golden, ensure_ascii=False, separators=(",", ":"))
    out.parent.mkdir(parents=True, exist_ok=True)
    if len(data) > 4_000_000:
        out = out.with_suffix(".json.gz")
        with gzip.GzipFile(out, "wb", mtime=0) as f:
            f.write(data.encode())
    else:
        out.write_text(data + "\n", encoding="utf-8")
    print(f"[{a.name}] wrote {out} ({out.stat().st_size / 1e6:.2f} MB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
