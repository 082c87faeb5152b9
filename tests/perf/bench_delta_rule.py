"""CPU speed of the gated delta rule's prompt forms at Qwen3-Next-80B-A3B's shape (32 value heads,
Dk = Dv = 128): the chunked form (`delta_rule_chunked`, blocks of 64) against the token-by-token
scan, the two-phase form the GPU path takes (`delta_rule_blocks`, its scan in torch here), and the
decode step, alternating A/B rounds in one process (this box is shared: compare
within a run).

    OMP_NUM_THREADS=1 PYTHONSAFEPATH=1 python tests/perf/bench_delta_rule.py [--tokens 512]
"""

import argparse
import time

import torch

from localllm.kernels.recurrent.delta_rule import (
    delta_rule_blocks,
    delta_rule_chunked,
    delta_rule_scan,
    delta_rule_step_ref,
    l2_normalize,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    t, h, d = a.tokens, 32, 128
    gen = torch.Generator().manual_seed(0)
    q = l2_normalize(torch.randn(t, h, d, generator=gen)) * d**-0.5
    k = l2_normalize(torch.randn(t, h, d, generator=gen))
    v, g, beta = torch.randn(t, h, d, generator=gen), -torch.rand(t, h), torch.rand(t, h)
    s0 = torch.zeros(h, d, d)
    forms = {
        "chunked": lambda: delta_rule_chunked(q, k, v, g, beta, s0.clone()),
        "blocks": lambda: delta_rule_blocks(q, k, v, g, beta, s0.clone()),
        "scan": lambda: delta_rule_scan(q, k, v, g, beta, s0.clone()),
        "step x1": lambda: delta_rule_step_ref(
            q[:1], k[:1], v[:1], g[:1], beta[:1], s0[None].clone()
        ),
    }
    best = {n: float("inf") for n in forms}
    for _ in range(a.rounds):
        for name, fn in forms.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    print(f"threads {torch.get_num_threads()}, {t} tokens, {h} heads of {d}x{d}")
    for name, s in best.items():
        per = s / (1 if name.startswith("step") else t)
        print(f"{name:8s} {s * 1e3:9.2f} ms  ({per * 1e6:8.1f} us/token)")


if __name__ == "__main__":
    main()
