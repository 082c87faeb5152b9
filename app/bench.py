"""`localllm bench`: llama-bench's tests and output for our engine, on CPU or CUDA.

pp<P>: P prompt tokens in one pass (chunks of 512) after D tokens of context, logits for the last
one; tg<N>: N single-token decode steps after D tokens of context, each fed a random token as
llama-bench does (`--decode-feed argmax` feeds back the argmax instead; either stays on the device:
no host sync inside the timed loop). `--routing uniform|zipf:S|trace:FILE` draws the experts each
MoE token uses instead of the router (`engine.moe.routing_override`): offload figures under the
balanced routing of a trained model rather than a random-weight model's skewed one. Random prompt
tokens as llama-bench uses, one warm-up run, then -r timed repetitions reported as mean ± sample
std of tokens/s.
The model forward runs directly on a paged KV cache (no scheduler, no sampler), which is what
llama-bench measures of llama.cpp. On CUDA, tg replays a captured decode graph per step and each
prompt chunk a captured prompt graph (as the engine does; `--cuda-graphs 0` runs both
eagerly). The residency flags (`--experts disk`,
`--cpu-moe`, `--expert-slots N`, ...) load MoE models under a plan, as `run` does; each result
then carries the expert cache's counters over its timed runs (`--show-plan` prints the plan).
`-m` takes what `run -m` takes (a path, a library name, `org/repo:QUANT`); none: the default model.
"""

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

from localllm.app.bench_report import (
    BenchResult,
    ExpertCounters,
    any_experts,
    csv_header,
    csv_row,
    md_header,
    md_row,
    model_info,
)
from localllm.app.engine_flags import QUANTIZE_CHOICES
from localllm.app.model_path import resolve_model
from localllm.app.residency_flags import add_residency_flags, residency_config
from localllm.app.threads import add_threads_flag, apply_threads

PREFILL_CHUNK = 512


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="prompt (pp) and generation (tg) tokens/s, like llama-bench")
    _add_args(p)


def main(argv: list[str] | None = None) -> int:
    """`python -m localllm.app.bench ...`: the same command without the other subcommands."""
    p = argparse.ArgumentParser(prog="localllm bench", description=__doc__.splitlines()[0])
    _add_args(p)
    args = p.parse_args(argv)
    return args.handler(args)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-m",
        "--model",
        action="append",
        help="GGUF file, library name or org/repo:QUANT, as for `run` (repeatable; default: "
        "the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("-p", "--n-prompt", type=_ints, default=[512], help="prompt sizes (512)")
    p.add_argument("-n", "--n-gen", type=_ints, default=[128], help="generation sizes (128)")
    p.add_argument("-d", "--n-depth", type=_ints, default=[0], help="context depths (0)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="timed runs per test (5)")
    p.add_argument("-o", "--output", choices=("md", "csv", "json"), default="md")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--cuda-graphs", type=int, choices=(0, 1), default=1,
                   help="replay decode CUDA graphs on CUDA (1)")  # fmt: skip
    add_threads_flag(p)
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=None,
                   help="a Hugging Face folder's weights made this type at load")  # fmt: skip
    p.add_argument("--decode-feed", choices=("random", "argmax"), default="random",
                   help="token fed to each decode step: random as llama-bench (default) or the "
                   "argmax of the step before")  # fmt: skip
    p.add_argument("--routing", default="model", metavar="model|uniform|zipf:S|trace:FILE",
                   help="MoE experts per token: the model's router (default) or drawn; "
                   "comma-separated: each test under each, one load")  # fmt: skip
    p.add_argument("--lora", action="append", default=[], metavar="PATH[:SCALE]",
                   help="LoRA adapters applied unmerged to every token (repeatable)")  # fmt: skip
    add_residency_flags(p)
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:

    apply_threads(args)
    if args.repetitions < 1:
        raise ValueError("-r must be >= 1")
    from localllm.engine.moe.routing_override import parse_routing

    for r in args.routing.split(","):  # a bad form fails before any model loads
        parse_routing(r)
    paths = [str(resolve_model(m)) for m in args.model or [None]]  # all found before any runs
    if args.show_plan:
        for path in paths:
            print(_plan(path, args).describe())
        return 0
    results: list[BenchResult] = []
    if args.output == "md":
        print(md_header())
    for path in paths:
        for r in run_model(path, args):
            results.append(r)
            if args.output == "md":
                print(md_row(r), flush=True)
    if args.output == "csv":
        print(csv_header(results))
        for r in results:
            print(csv_row(r, any_experts(results)))
    elif args.output == "json":
        print(json.dumps([asdict(r) for r in results], indent=2))
    if args.output == "md":
        if any(r.experts is not None or r.routing != "model" for r in results):
            print(f"routing: {args.routing}; decode steps fed: {args.decode_feed} tokens")
        for r in results:
            if r.experts is not None:
                print(f"expert cache {r.test}: {r.experts.line()}")
            if r.split is not None and r.split.steps:
                print(f"split {r.test}: {r.split.line()}")
    return 0


def _longest(args: argparse.Namespace) -> int:
    return max(args.n_depth) + max(max(args.n_prompt), max(args.n_gen)) + 1


def _plan(path: str, args: argparse.Namespace, gguf=None):
    """The residency plan for `path` (None without residency flags)."""
    from localllm.engine.loader import open_weights
    from localllm.engine.moe.residency import plan_model
    from localllm.offload.memory import probe_memory
    from localllm.offload.residency import ResidencyConfig

    config = residency_config(args)
    if config == ResidencyConfig() and not args.show_plan:
        return None
    g = gguf or open_weights(path, args.quantize)  # a GGUF or a Hugging Face folder
    try:
        # (one sequence: a hybrid's one state slot, as `run_model` attaches)
        return plan_model(g, config, _longest(args), probe_memory(args.device), state_seqs=1)
    finally:
        if gguf is None:
            g.close()


def run_model(path: str, args: argparse.Namespace) -> list[BenchResult]:
    import torch

    from localllm.engine.loader import build_model, open_weights
    from localllm.engine.moe.block import account_mapped, moe_blocks
    from localllm.engine.moe.residency import load_model
    from localllm.engine.moe.routing_override import override_routing, parse_routing
    from localllm.engine.moe.split_link import split_balance
    from localllm.engine.runtime.kv_cache import PagedKVCache
    from localllm.engine.runtime.recurrent_state import attach_states
    from localllm.offload.expert_stats import expert_stats

    device = torch.device(args.device)
    gguf = open_weights(path, args.quantize)  # a GGUF or a Hugging Face folder
    if device.type == "cuda":  # the device memory the model and its runs take, from here on
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    try:
        plan = _plan(path, args, gguf)
        if plan is None:
            model = build_model(gguf, device=device)
        else:
            model = load_model(gguf, plan, device=device)
        if getattr(
            args, "lora", None
        ):  # every row on every adapter at its scale: the decode overhead
            from localllm.engine.lora import LoraSpec, attach_adapters

            specs = [LoraSpec.parse(s) for s in args.lora]
            loras = attach_adapters(model, specs, gguf, device)
            loras.context.apply_all(loras.resolve(None))
        sources = getattr(model, "expert_sources", None)
        layers, kvh, hd = model.kv_shape()
        longest = _longest(args)
        vd = model.kv_value_dim()
        blocks = -(-longest // 16)
        kv = PagedKVCache(layers, blocks + 1, 16, kvh, hd, "f16", device, vd)  # +1: spare slots
        attach_states(kv, model, 1)  # hybrid models: the one sequence's recurrent state
        if device.type == "cuda":  # what the loaded model and its KV hold between runs
            loaded = (torch.cuda.memory_allocated(device) - base) / (1 << 30)
        vocab = model.args.vocab_size
        info = model_info(gguf, "CUDA" if device.type == "cuda" else "CPU")
        out = []
        for routing in getattr(args, "routing", "model").split(","):
            # captured graphs hold the routing they were captured with: new ones per routing
            override_routing(model, parse_routing(routing), device)
            graphs, prompts = _graphs(model, kv, blocks, device, args)
            for depth in args.n_depth:
                tests = [(p, 0) for p in args.n_prompt if p] + [(0, n) for n in args.n_gen if n]
                for p, n in tests:
                    run = _Runner(model, kv, vocab, device, graphs, prompts,
                                  getattr(args, "decode_feed", "random"))  # fmt: skip
                    run.once(depth, p, n)  # warm-up: kernel compilation, allocator
                    account_mapped(model)  # (device-side counters come in every few steps)
                    before = expert_stats(sources) if sources else None
                    links = [g.link for g in graphs.graphs.values() if g.link] if graphs else []
                    moe = moe_blocks(model)
                    balance = split_balance(moe, links)
                    rates = [run.once(depth, p, n) for _ in range(args.repetitions)]
                    std = statistics.stdev(rates) if len(rates) > 1 else 0.0
                    account_mapped(model)
                    experts = (
                        ExpertCounters.between(before, expert_stats(sources)) if sources else None
                    )
                    if balance is not None:
                        balance = split_balance(moe, links).minus(balance)
                    out.append(BenchResult(Path(path).name, *info, p, n, depth,
                                           statistics.fmean(rates), std, rates, experts,
                                           balance, routing))  # fmt: skip
        if graphs is not None and graphs.failed is not None:  # the figures are eager decode's
            print(f"decode graphs not captured: {graphs.failed}", file=sys.stderr)
        if prompts is not None and prompts.failed is not None:
            print(f"prompt graphs not captured: {prompts.failed}", file=sys.stderr)
        if device.type == "cuda":
            peak = (torch.cuda.max_memory_allocated(device) - base) / (1 << 30)
            # (held by torch's caching allocator: the CUDA context and modules are not in it)
            held = torch.cuda.max_memory_reserved(device) / (1 << 30)
            gib = plan.budget / (1 << 30) if plan else 0
            budget = f" (plan budget {gib:.2f} GiB, {plan.budget_source})" if plan else ""
            print(f"device memory: {loaded:.2f} GiB after loading, peak {peak:.2f} GiB "
                  f"allocated, {held:.2f} GiB reserved{budget}", file=sys.stderr)  # fmt: skip
        return out
    finally:
        gguf.close()


def _graphs(model, kv, blocks: int, device, args: argparse.Namespace):
    """(DecodeGraphs, PrefillGraphs) on CUDA with --cuda-graphs 1, else (None, None). Experts
    on host or disk (or unpacked types) run host code per step: captured in pieces. Hybrid
    models (recurrent state) replay prompt graphs where `prefill_graphs.STATEFUL` is on (the
    default; their one sequence on state slot 0)."""
    if device.type != "cuda" or not getattr(args, "cuda_graphs", 1):
        return None, None
    import torch

    from localllm.engine.runtime.cuda_graphs import DecodeGraphs
    from localllm.engine.runtime.prefill_graphs import PrefillGraphs

    graphs = DecodeGraphs(model, kv, batch_sizes=(1,))
    prompts = PrefillGraphs(model, kv, spare_slot=blocks * 16, max_blocks=blocks)
    graphs.pool = prompts.pool = torch.cuda.graph_pool_handle()
    return graphs, prompts


class _Runner:
    """Times one pp or tg run over a contiguous block table (block i holds tokens 16i..)."""

    def __init__(self, model, kv, vocab: int, device, graphs=None, prompts=None, feed="random"):
        import torch

        self.feed = feed  # "random": each step's token drawn (llama-bench); "argmax": fed back
        self.torch, self.model, self.kv, self.vocab, self.device = torch, model, kv, vocab, device
        self.graphs = graphs  # DecodeGraphs for tg on CUDA, or None (eager)
        self.prompts = prompts  # PrefillGraphs for prompt chunks on CUDA, or None
        self.gen = torch.Generator().manual_seed(0)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def _forward(self, ids, start: int, prompt: bool = False):
        from localllm.engine.core.batch import BatchMeta
        from localllm.kernels.quant.linear_native import prompt_rows

        torch = self.torch
        n = ids.shape[0]
        batch = BatchMeta.contiguous(n, start + n, self.kv.block_size)
        batch = BatchMeta(
            batch.query_start,
            batch.seq_lens,
            batch.block_tables,
            batch.slot_mapping.to(self.device),
            batch.block_size,
            prompt=(True,) if prompt else (),  # prompt chunks on the prompt path (CPU)
        )
        hidden = None
        if self.prompts is not None:
            hidden = self.prompts.run(ids, batch.slot_mapping, start, batch.block_tables[0])
        if hidden is None:
            pos = torch.arange(start, start + n, device=self.device)
            with prompt_rows(prompt):
                hidden = self.model(ids, pos, batch, self.kv)
        return self.model.logits(hidden[-1:])

    def _prefill(self, ids, start: int):
        logits = None
        for c in range(0, ids.shape[0], PREFILL_CHUNK):
            logits = self._forward(ids[c : c + PREFILL_CHUNK], start + c, prompt=True)
        return logits

    def once(self, depth: int, p: int, n: int) -> float:
        torch = self.torch
        with torch.inference_mode():
            toks = torch.randint(0, self.vocab, (depth + max(p, 1),), generator=self.gen)
            toks = toks.to(self.device)
            if depth:
                self._prefill(toks[:depth], 0)
            self._sync()
            t0 = time.perf_counter()
            if p:
                self._prefill(toks[depth : depth + p], depth)
                self._sync()
                return p / (time.perf_counter() - t0)
            tok = toks[depth : depth + 1]
            fed = torch.randint(0, self.vocab, (n + 1,), generator=self.gen).to(self.device)
            argmax = self.feed == "argmax"
            steps = self._graph_steps(depth, n)
            for i in range(n):
                if steps is None:
                    logits = self._forward(tok, depth + i)
                    tok = logits.argmax(-1) if argmax else fed[i + 1 : i + 2]
                    continue
                # the step's row [id, pos, slot, seq_len, table] is ready on the device; only the
                # id (the previous argmax) is written in, so no host sync or copy per step
                row = steps[i : i + 1]
                row[:, 0] = tok
                logits = self.graphs.run(row)
                if logits is None:  # not capturable (MoE routing reads ids on the host): eager
                    steps = None
                    logits = self._forward(tok, depth + i)
                tok = logits.argmax(-1) if argmax else fed[i + 1 : i + 2]
            self._sync()
            return n / (time.perf_counter() - t0)

    def _graph_steps(self, depth: int, n: int):
        """Device rows of the n decode steps for `DecodeGraphs.run` (None: eager decode)."""
        if self.graphs is None or self.graphs.key(1, 1) is None:
            return None
        torch, bs = self.torch, self.kv.block_size
        pos = torch.arange(depth, depth + n)
        width = -(-(depth + n) // bs)
        table = torch.arange(width).expand(n, width)
        # contiguous table: slot = position; the one sequence's state slot 0
        cols = [torch.zeros_like(pos), pos, pos, pos + 1, torch.zeros_like(pos)]
        return torch.cat([torch.stack(cols, 1), table], 1).to(self.device)


if __name__ == "__main__":
    from localllm.app.process import apply_settings

    apply_settings()  # as the `localllm` command does
    sys.exit(main())
