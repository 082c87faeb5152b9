"""One markdown table from several `bench_serve.py --json` files, and each server against a
baseline: aggregate output tokens/s as a ratio, p99 inter-token latency side by side.

    python tests/perf/serve_report.py OUT/serve_ours.json OUT/serve_llama.json \
        [--baseline llama-server]   # (default: the last file's label)
"""

import argparse
import importlib.util
import json
import sys
from pathlib import Path


def _bench_serve():
    path = Path(__file__).with_name("bench_serve.py")
    spec = importlib.util.spec_from_file_location("_bench_serve", path)
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (its dataclasses)
    spec.loader.exec_module(mod)
    return mod


def report(runs: list[dict], baseline: str) -> str:
    bs = _bench_serve()
    lines = [bs.table_head()]
    for r in runs:
        lines += [bs.table_row(r["label"], lv) for lv in r["levels"]]
    base = next((r for r in runs if r["label"] == baseline), None)
    if base is None or len(runs) == 1:
        return "\n".join(lines)
    by_c = {lv["concurrency"]: lv for lv in base["levels"]}
    lines += ["", f"Against {baseline}:", "",
              "| server | streams | out tok/s ratio | ITL p99 ms | baseline ITL p99 ms |",
              "|---|---|---|---|---|"]  # fmt: skip
    for r in runs:
        if r is base:
            continue
        for lv in r["levels"]:
            b = by_c.get(lv["concurrency"])
            if b is None or not b["output_tok_s"] or lv["output_tok_s"] is None:
                continue
            ratio = lv["output_tok_s"] / b["output_tok_s"]
            lines.append(f"| {r['label']} | {lv['concurrency']} | {ratio:.2f}x | "
                         f"{lv['itl_p99_ms']} | {b['itl_p99_ms']} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--baseline", help="label to compare against (the last file's)")
    a = ap.parse_args(argv)
    runs = []
    for f in a.files:
        try:
            runs.append(json.loads(Path(f).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            print(f"serve_report: skipping {f}: {e}", file=sys.stderr)
    if not runs:
        return 1
    print(report(runs, a.baseline or runs[-1]["label"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
