"""Host overhead of one decode step at many sequences: where the engine's Python time goes.

Not a test: its figures go into tests/perf/results/server.md (issue 38). On a CPU with a tiny
model the forward is cheap, so the rest of `LLMEngine.step()` (scheduling, batch metadata,
sampling, detokenizing, outputs) shows what a GPU step pays on the host per token of every
sequence. Runs --seqs requests (prompts of --prompt tokens, greedy, `ignore_eos`) until all
decode, then times --steps decode steps: wall per step, the model's forward + logits inside it,
and the rest; then the step under cProfile (the top functions by own time). Also times
`pack_decode`, the decode graphs' host rows, for --seqs rows of --context tokens of blocks.

    PYTHONSAFEPATH=1 OMP_NUM_THREADS=1 python tests/perf/bench_host_step.py MODEL.gguf \
        [--seqs 64] [--prompt 64] [--steps 20] [--context 2304]
"""

import argparse
import cProfile
import dataclasses
import io
import pstats
import statistics
import sys
import time

import torch

from localllm.engine import EngineArgs, SamplingParams
from localllm.engine.llm_engine import LLMEngine
from localllm.engine.runtime.cuda_graphs import COLS, DecodeGraphs, pack_decode
from localllm.engine.runtime.decode_ahead import DecodeAhead


class Timed:
    """Wraps a callable, summing its wall time."""

    def __init__(self, fn):
        self.fn, self.total = fn, 0.0

    def __call__(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.total += time.perf_counter() - t


# the host parts of a step, timed one by one (object, attribute)
PARTS = (
    ("scheduler", "schedule"),
    ("runner", "_prepare"),
    ("runner", "_sample"),
    ("runner", "_execute_graph"),
    ("scheduler", "update_from_output"),
    ("engine", "_collect"),
)
LADDER = (1, 2, 4, 8, 16, 32, 64)


class EagerReplay(DecodeGraphs):
    """A CPU stand-in for the decode graphs: `run` pads the rows to the ladder's size as a replay
    does and runs the captured function eagerly, so the runner's graph path (and decode-ahead)
    does all its host work (--graph-path)."""

    def run(self, inputs, ids=None, then=None):
        n, w = inputs.shape[0], inputs.shape[1] - COLS
        key = self.key(n, w)
        if key is None:
            return None
        x = torch.zeros(key[0], COLS + key[1], dtype=torch.long)
        x[:n, : COLS + w], x[n:, : COLS + w] = inputs, inputs[:1]
        if ids is not None:
            x[:n, 0], x[n:, 0] = ids, ids[:1]
        logits = self.forward(x)[:n]
        return logits if then is None else then(logits)


def graph_path(engine: LLMEngine) -> None:
    """The runner as on a GPU: decode steps through (stand-in) graphs, launched one ahead, with
    the scheduler's lookahead slot."""
    runner = engine.runner
    runner.graphs = EagerReplay(runner.model, runner.kv, batch_sizes=LADDER)
    runner.ahead = DecodeAhead(runner.graphs.run)
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, lookahead_slots=1)


def decode_steps(engine: LLMEngine, steps: int) -> tuple[list[float], list[float], dict]:
    """Wall time of `steps` engine steps, the model's share (forward + logits) of each, and the
    total seconds of each of PARTS."""
    model = engine.model
    fwd, logits = Timed(model.forward), Timed(model.logits)
    model.forward, model.logits = fwd, logits
    owners = {"scheduler": engine.scheduler, "runner": engine.runner, "engine": engine}
    parts = {}
    for owner, name in PARTS:
        parts[name] = Timed(getattr(owners[owner], name))
        setattr(owners[owner], name, parts[name])
    walls, inner = [], []
    try:
        for _ in range(steps):
            before = fwd.total + logits.total
            t = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t)
            inner.append(fwd.total + logits.total - before)
    finally:
        del model.forward, model.logits
        for owner, name in PARTS:
            delattr(owners[owner], name)
    return walls, inner, {k: v.total for k, v in parts.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--context", type=int, default=2304, help="pack_decode's rows (2048 + 256)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--graph-path", action="store_true", help="the GPU's decode path (EagerReplay)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    engine = LLMEngine(
        a.model,
        EngineArgs(max_num_seqs=a.seqs, max_num_batched_tokens=max(512, a.seqs * a.prompt),
                   max_model_len=a.prompt + 4 * a.steps + 8),
    )  # fmt: skip
    if a.graph_path:
        graph_path(engine)
    p = SamplingParams(temperature=0, max_tokens=4 * a.steps, ignore_eos=True)
    for i in range(a.seqs):
        engine.add_request(f"r{i}", [(7 * i + j) % 1000 + 10 for j in range(a.prompt)], p)
    while any(
        r.num_computed_tokens < r.num_prompt_tokens for r in (s.req for s in engine.states.values())
    ):
        engine.step()
    walls, inner, parts = decode_steps(engine, a.steps)
    host = [w - i for w, i in zip(walls, inner, strict=True)]
    running = len(engine.scheduler.running)
    path = "graph path (EagerReplay), decode-ahead" if a.graph_path else "eager path"
    print(f"{running} sequences decoding, {path}, {a.steps} steps, medians:")
    print(f"  step {1000 * statistics.median(walls):.2f} ms, model forward + logits "
          f"{1000 * statistics.median(inner):.2f} ms, the rest (host) "
          f"{1000 * statistics.median(host):.2f} ms = "
          f"{1e6 * statistics.median(host) / running:.1f} us per sequence")  # fmt: skip
    print("  host parts, mean per step: " + ", ".join(
        f"{k} {1000 * v / a.steps:.2f} ms" for k, v in parts.items()))  # fmt: skip
    prof = cProfile.Profile()
    prof.enable()
    decode_steps(engine, a.steps)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue())
    blocks = -(-a.context // 16)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(a.seqs)]
    ids = list(range(a.seqs))
    t = time.perf_counter()
    for _ in range(20):
        pack_decode(ids, ids, ids, tables)
    dt = (time.perf_counter() - t) / 20
    print(f"pack_decode: {a.seqs} rows of {blocks} blocks: {1000 * dt:.2f} ms per call "
          "(twice per decode step with decode-ahead)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
