"""`localllm bench` with the hybrid prompt path's module switches set first, for A/B runs of
switches that have no CLI flag yet (tests/perf/gpu_hybrid_prefill.sh):

- `--prompt-graphs 1`: `engine.runtime.prefill_graphs.STATEFUL` (hybrid prompts replay prompt
  CUDA graphs; granitehybrid and lfm2 only);
- `--chunked-rows N`: `engine.layers.recurrent.CHUNKED_MIN_ROWS` (a Mamba-2 prompt of N rows or
  more scans in chunks; 0 leaves the default, off);
- `--dot-precision P`: the chunked scan's `tl.dot` precision (`triton_ssd_chunked.DOT_PRECISION`:
  ieee, tf32, tf32x3; empty leaves the default).

    python tests/perf/bench_switches.py --prompt-graphs 1 --chunked-rows 64 \\
        --dot-precision tf32x3 -- -m /tmp/g4t.gguf -p 512 -n 0 -r 3 --device cuda
"""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    ours, rest = argv[:cut], argv[cut + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-graphs", type=int, choices=(0, 1), default=0)
    ap.add_argument("--chunked-rows", type=int, default=0)
    ap.add_argument("--dot-precision", default="", choices=("", "ieee", "tf32", "tf32x3"))
    args = ap.parse_args(ours)
    import localllm.engine.layers.recurrent as recurrent
    import localllm.engine.runtime.prefill_graphs as prefill_graphs
    from localllm.app.bench import main as bench

    prefill_graphs.STATEFUL = bool(args.prompt_graphs)
    if args.chunked_rows:
        recurrent.CHUNKED_MIN_ROWS = args.chunked_rows
    if args.dot_precision:
        import localllm.kernels.recurrent.triton_ssd_chunked as ch

        ch.DOT_PRECISION = args.dot_precision
    print(f"switches: prompt graphs {prefill_graphs.STATEFUL}, chunked from "
          f"{recurrent.CHUNKED_MIN_ROWS} rows, dots {args.dot_precision or 'default'}",
          file=sys.stderr)  # fmt: skip
    return bench(rest)


if __name__ == "__main__":
    sys.exit(main())
