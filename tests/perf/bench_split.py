"""Host experts split between the GPU and the CPU (`--host-compute split`): decode tokens/s and
where each layer's host step goes, for a few CPU shares (not a test; needs a CUDA device).

    python tests/perf/bench_split.py MODEL.gguf [--shares 0.375,0.4375] [--tokens 64] [--slots N]
        [--both]

Per share: tokens/s of a greedy decode through the decode graphs, then per layer step (means over
the timed tokens): the host's wait for the token rows (the GPU's attention part), the CPU's share,
and (graph breaks, `--both`) how often the GPU's share was still running when the CPU's was done
or (one graph, the default) how often the GPU waited for the CPU's share: near 100 % busy or 0 %
waited, the bus is the bottleneck and a larger share may pay; the other way round, the CPU is.
"""

import argparse
import time

import torch

from localllm.engine.llm import LLM
from localllm.engine.moe import sources as moe_sources
from localllm.engine.moe import split as moe_split
from localllm.engine.moe.block import moe_blocks
from localllm.engine.runtime import cuda_graphs
from localllm.engine.sampling.params import SamplingParams
from localllm.offload.residency import resolve


def run(path: str, share: float, tokens: int, slots: int = 0, breaks: bool = False) -> str:
    cuda_graphs.SPLIT_LINK = not breaks
    moe_split.SPLIT_CPU_SHARE = share
    moe_sources.SPLIT_CPU_SHARE_SLOTS = share  # (the share over slots, read where it is used)
    layer = {"cpu_moe": True, "host_compute": "split"}
    if slots:  # device slots over the mapped experts: the CPU takes the pairs they miss
        layer["streaming"] = {"slots": slots}
    cfg = resolve([("bench", layer)])
    llm = LLM(path, max_model_len=512, device="cuda", residency=cfg)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompt = [[1, 5, 9, 33, 7, 11, 200, 3]]
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # capture
    blocks = [b for b in moe_blocks(llm.engine.model) if b.split is not None]
    for b in blocks:
        b.split.timing = moe_split.SplitTiming()
    links = [g.link for g in llm.engine.runner.graphs.graphs.values() if g.link is not None]
    with torch.inference_mode():  # (made while capturing, in inference mode)
        for link in links:
            link.waits.zero_()
    t0 = time.perf_counter()
    llm.generate(prompt, params)
    dt = time.perf_counter() - t0
    steps = sum(b.split.timing.steps for b in blocks)
    wait = sum(b.split.timing.wait_seconds for b in blocks) / max(steps, 1) * 1e6
    cpu = sum(b.split.timing.cpu_seconds for b in blocks) / max(steps, 1) * 1e6
    busy = sum(b.split.timing.gpu_busy for b in blocks) / max(steps, 1)
    waited = sum(link.gpu_waits() for link in links) / max(steps, 1)
    how = "breaks" if breaks else f"one graph ({len(links)} linked)"
    per = {c: sum(b.split.cpu == c for b in blocks) for c in sorted({b.split.cpu for b in blocks})}
    del llm
    return (
        f"| {share} | {how} | {per} | {tokens / dt:.2f} | {dt / tokens * 1e3:.2f} | {wait:.0f} | "
        f"{cpu:.0f} | {busy:.0%} | {waited:.0%} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--shares", default="0.3125,0.375,0.4375")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--slots", type=int, default=0, help="device slots over the mapped experts")
    ap.add_argument("--both", action="store_true", help="each share with graph breaks too")
    a = ap.parse_args()
    print("| share | capture | layers by CPU experts | t/s | ms/token | wait us | CPU us | "
          "GPU busy | GPU waited |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for s in a.shares.split(","):
        for breaks in (False, True) if a.both else (False,):
            print(run(a.model, float(s), a.tokens, a.slots, breaks), flush=True)


if __name__ == "__main__":
    main()
