"""Which decode tokens a closed loop of streams gets from decode graphs: the real scheduler and
KV manager, no model (issue 38).

Not a test: its figures go into tests/perf/results/server.md. C clients each send bench_serve.py's
prompt mix (shared system prompt and documents, 512-2,048 tokens; the prefix cache sees the shared
blocks) for --gen tokens and send the next request the step after theirs finishes. Every step is
classified as the runner would: a graph step (every request decodes one token, at most the
ladder's largest batch) or an eager one (a prompt chunk in the batch, or too many rows). Reports,
per concurrency, the share of output tokens made in graph steps, the steps per output token, the
mean decode rows per step and the prompt tokens computed (after prefix-cache hits).

    PYTHONSAFEPATH=1 python tests/perf/sim_schedule.py [--ladder 8] [--batched-tokens 512] \
        [--seqs 64] [--concurrency 1,4,16,64] [--rounds 3]
"""

import argparse
import importlib.util
import sys
from pathlib import Path

from localllm.engine.core.kv_manager import KVCacheManager
from localllm.engine.core.request import Request
from localllm.engine.core.scheduler import Scheduler, SchedulerConfig
from localllm.engine.sampling.params import SamplingParams


def _bench_serve():
    path = Path(__file__).with_name("bench_serve.py")
    spec = importlib.util.spec_from_file_location("_bench_serve", path)
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def simulate(a, concurrency: int) -> dict:
    bs = _bench_serve()
    mix = bs.Mix(a.min_prompt, a.max_prompt, a.system, tuple(a.docs), seed=0)
    prompts = bs.Prompts(list(range(100, 100 + mix.corpus_tokens())), mix)
    kv = KVCacheManager(16, a.kv_tokens // 16)
    config = SchedulerConfig(a.seqs, a.batched_tokens, 131072, lookahead_slots=1)
    sched = Scheduler(config, kv)
    params = SamplingParams(temperature=0, max_tokens=a.gen, ignore_eos=True)
    sent, total = 0, concurrency * a.rounds

    def send() -> None:
        nonlocal sent
        ids, _ = prompts.get(f"c{concurrency}-{sent}")
        sched.add_request(Request(f"r{sent}", ids, params, max_tokens=a.gen))
        sent += 1

    for _ in range(concurrency):
        send()
    steps = graph_steps = graph_tokens = out_tokens = rows = prompt_tokens = 0
    while sched.has_unfinished():
        out = sched.schedule()
        if out.empty:
            raise RuntimeError("scheduler made no progress")
        n = out.num_scheduled_tokens
        decoding = [r for r in out.requests if n[r.request_id] == 1
                    and r.num_computed_tokens == r.num_tokens - 1]  # fmt: skip
        graph = len(decoding) == len(out.requests) <= a.ladder
        sampled = {}
        for r in out.requests:
            if r.num_computed_tokens + n[r.request_id] >= r.num_tokens:
                sampled[r.request_id] = [7]
        prompt_tokens += sum(n[r.request_id] for r in out.requests if r not in decoding)
        steps += 1
        rows += len(decoding)
        out_tokens += len(sampled)
        if graph:
            graph_steps += 1
            graph_tokens += len(sampled)
        before = {r.request_id for r in out.requests if not r.finished}
        sched.update_from_output(out, sampled)
        done = sum(1 for r in out.requests if r.request_id in before and r.finished)
        for _ in range(min(done, total - sent)):
            send()
    return {
        "concurrency": concurrency,
        "requests": sent,
        "steps": steps,
        "graph_steps": graph_steps,
        "graph_token_share": graph_tokens / out_tokens,
        "steps_per_token": steps / out_tokens,
        "decode_rows_per_step": rows / steps,
        "prompt_tokens_computed": prompt_tokens,
        "preemptions": sched.num_preemptions,
    }


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ladder", type=int, default=8, help="largest decode graph batch (8)")
    ap.add_argument("--batched-tokens", type=int, default=512, help="tokens per step (512)")
    ap.add_argument("--seqs", type=int, default=64, help="sequences per step (64)")
    ap.add_argument("--kv-tokens", type=int, default=131072, help="KV pool in tokens (131072)")
    ap.add_argument("--concurrency", type=ints, default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=3, help="requests per client (3)")
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--min-prompt", type=int, default=512)
    ap.add_argument("--max-prompt", type=int, default=2048)
    ap.add_argument("--system", type=int, default=256)
    ap.add_argument("--docs", type=ints, default=[256, 512, 1024, 1536])
    a = ap.parse_args(argv)
    print(f"ladder {a.ladder}, {a.batched_tokens} tokens/step, {a.seqs} seqs, KV {a.kv_tokens}")
    print(
        "| streams | steps | graph steps | output tokens in graph steps | steps per token "
        "| decode rows/step | prompt tokens computed | preemptions |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for c in a.concurrency:
        r = simulate(a, c)
        print(f"| {c} | {r['steps']} | {r['graph_steps']} | {100 * r['graph_token_share']:.1f} % "
              f"| {r['steps_per_token']:.3f} | {r['decode_rows_per_step']:.1f} "
              f"| {r['prompt_tokens_computed']} | {r['preemptions']} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
