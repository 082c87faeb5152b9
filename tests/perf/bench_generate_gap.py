"""Where the engine's decode loses to `bench`'s (not a test): one model and residency, decoded
greedily (1) through `LLM.generate`, one step at a time and with greedy steps launched one
ahead (the engine: schedule, a host sync to sample, detokenize, every token; timed from the first
token to the last, the prompt left out; and sampled at T 0.8, top_p 0.95, drawn on the host one
step at a time and on the device one ahead) and (2) as `localllm bench` times it (the decode graph
replayed back to back, the argmax fed in on the device, no host sync per token); then the
engine's run under cProfile, by own time. Same machine, same process, one after the other.

    python tests/perf/bench_generate_gap.py MODEL.gguf [--device cuda] [--tokens 64]
        [--top 15] [residency flags as `bench` takes them, e.g. --cpu-moe --host-compute split]
"""

import argparse
import cProfile
import io
import pstats

import torch

from localllm.app.bench import _Runner
from localllm.app.residency_flags import add_residency_flags, residency_config
from localllm.engine.llm import LLM
from localllm.engine.runtime.cuda_graphs import DecodeGraphs
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.engine.sampling.params import SamplingParams
from localllm.engine.sampling.sampler import Sampler

PROMPT = [[1, 5, 9, 33, 7, 11, 200, 3]]


def engine_rate(llm: LLM, tokens: int, temperature: float = 0.0) -> float:
    """Decode tokens/s from the first token's stamp to the last's: the prompt's step left out,
    as `bench`'s tg leaves it out."""
    params = SamplingParams(
        temperature=temperature, top_p=0.95, seed=0, max_tokens=tokens, ignore_eos=True
    )
    m = llm.generate(PROMPT, params)[0].metrics
    return (m.num_generated - 1) / (m.last_token_time - m.first_token_time)


def bench_rate(llm: LLM, tokens: int, device: torch.device) -> float:
    """`bench`'s decode loop over the engine's model, with its own KV cache and decode graph."""
    model = llm.engine.model
    layers, kvh, hd = model.kv_shape()
    blocks = -(-(tokens + 1) // 16)
    kv = PagedKVCache(layers, blocks + 1, 16, kvh, hd, "f16", device, model.kv_value_dim())
    graphs = DecodeGraphs(model, kv, batch_sizes=(1,)) if device.type == "cuda" else None
    run = _Runner(model, kv, model.args.vocab_size, device, graphs)
    run.once(0, 0, tokens)  # capture, compile
    return run.once(0, 0, tokens)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--profile-temperature", type=float, default=0.0)
    add_residency_flags(ap)
    a = ap.parse_args()
    cfg = residency_config(a)
    llm = LLM(a.model, max_model_len=512, device=a.device, residency=cfg)
    engine_rate(llm, 8)  # capture, compile
    runner = llm.engine.runner
    ahead, sampler = runner.ahead, runner.sampler

    def variant(name: str, temperature: float, one_at_a_time: bool, host_draws: bool) -> float:
        runner.ahead = None if one_at_a_time else ahead
        runner.sampler = Sampler(device_draws=False) if host_draws else sampler
        rate = engine_rate(llm, a.tokens, temperature)
        runner.ahead, runner.sampler = ahead, sampler
        print(f"{name:<44} {rate:8.2f} t/s, {1e3 / rate:.2f} ms/token")
        return rate

    # each step's tokens read before the next is launched; sampled rows drawn on the host
    variant("engine, greedy, one step at a time", 0.0, True, False)
    gen = variant("engine, greedy (LLM.generate)", 0.0, False, False)
    variant("engine, T 0.8, host draws, one at a time", 0.8, True, True)
    variant("engine, T 0.8 top_p 0.95, drawn on the device", 0.8, False, False)
    fast = bench_rate(llm, a.tokens, torch.device(a.device))
    name = "bench's loop (greedy)"
    print(f"{name:<44} {fast:8.2f} t/s, {1e3 / fast:.2f} ms/token")
    print(f"the engine's extra, greedy: {1e3 / gen - 1e3 / fast:.2f} ms/token")
    if ahead is not None:
        print(f"steps launched ahead: {ahead.launched}, used {ahead.used}")
    prof = cProfile.Profile()
    prof.enable()
    engine_rate(llm, a.tokens, a.profile_temperature)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(a.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
