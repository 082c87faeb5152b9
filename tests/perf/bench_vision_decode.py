"""Decode speed after an image prompt against after a text prompt of the same length: the tiny
Qwen2.5-VL fixture of tests/data/vision (random weights, so the step is launch-bound and any
eager decode step shows), greedy with `ignore_eos`, the two alternating for R rounds. Prints a
Markdown table for tests/perf/results/vision.md: the image prompt's time to first token and the
decode tokens per second (tokens after the first / time after the first) of each.

    PYTHONPATH=. python tests/perf/bench_vision_decode.py --device cuda -n 256 -r 3
"""

import argparse
import time

import torch

from localllm.engine import EngineArgs, LLMEngine, SamplingParams
from tests.media.test_vision_qwen25vl import TEXT, _prompt, open_pipeline


def timed(engine, rid, ids, mm, n) -> tuple[float, float]:
    """(seconds to the first token, decode tokens per second after it)."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request(rid, ids, params, mm_inputs=mm)
    first = None
    got = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert not out.error, out.error
            got = len(out.outputs[0].token_ids)
            if first is None and got:
                first = time.perf_counter()
    end = time.perf_counter()
    assert got == n, got
    return first - t0, (n - 1) / (end - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("-n", type=int, default=256, help="tokens generated per request")
    ap.add_argument("-r", "--rounds", type=int, default=3)
    a = ap.parse_args()
    engine = LLMEngine(str(TEXT), EngineArgs(device=a.device, enable_prefix_caching=False))
    vision = open_pipeline(engine)
    _, ids, mm = _prompt(vision, engine, "two_images")
    words = engine.tokenize("user assistant Numbers one two three four five six seven " * 20)
    text = words[: len(ids)]
    timed(engine, "warm-i", ids, mm, 16)
    timed(engine, "warm-t", text, (), 16)
    rows = {"image": [], "text": []}
    for r in range(a.rounds):
        rows["image"].append(timed(engine, f"i{r}", ids, mm, a.n))
        rows["text"].append(timed(engine, f"t{r}", text, (), a.n))
    name = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    print(f"\n{name}, prompt {len(ids)} tokens (two images: {sum(len(m.positions) for m in mm)}),"
          f" {a.n} tokens generated, {a.rounds} alternating rounds\n")  # fmt: skip
    print("| prompt | TTFT ms (best) | decode tok/s (best) | decode tok/s (median) |")
    print("|---|---|---|---|")
    for kind, got in rows.items():
        ttft = min(t for t, _ in got) * 1e3
        rates = sorted(d for _, d in got)
        print(f"| {kind} | {ttft:.1f} | {rates[-1]:.0f} | {rates[len(rates) // 2]:.0f} |")
    vision.close()
    engine.close()


if __name__ == "__main__":
    main()
