"""One markdown table from several `bench_serve.py --json` files, and each server against a
baseline: aggregate output tokens/s as a ratio, p99 inter-token latency side by side. A level
where either server failed a request (measured or warm-up) gets no ratio, only its error counts:
a server that drops requests would count only the survivors' tokens. With
`--smi DIR`, also the GPU's busy share and memory while each level was measured, from
`DIR/smi_LABEL.csv` (`nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used
--format=csv,noheader,nounits -lms 250`, as gpu_serve.sh records it): a server whose GPU idles at
64 streams is bound by its host.

    python tests/perf/serve_report.py OUT/serve_ours.json OUT/serve_llama.json \
        [--baseline llama-server] [--smi OUT]   # (baseline default: the last file's label)
"""

import argparse
import importlib.util
import json
import sys
from datetime import datetime
from pathlib import Path


def _bench_serve():
    path = Path(__file__).with_name("bench_serve.py")
    spec = importlib.util.spec_from_file_location("_bench_serve", path)
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (its dataclasses)
    spec.loader.exec_module(mod)
    return mod


def failed(level: dict) -> int:
    """Requests of a level that failed, its warm-ups included."""
    return level["errors"] + level.get("warmup", {}).get("errors", 0)


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
            if b is None:
                continue
            if failed(lv) or failed(b):
                lines.append(f"| {r['label']} | {lv['concurrency']} | no ratio: {failed(lv)} "
                             f"errors here, {failed(b)} in {baseline} | {lv['itl_p99_ms']} | "
                             f"{b['itl_p99_ms']} |")  # fmt: skip
                continue
            if not b["output_tok_s"] or lv["output_tok_s"] is None:
                continue
            ratio = lv["output_tok_s"] / b["output_tok_s"]
            lines.append(f"| {r['label']} | {lv['concurrency']} | {ratio:.2f}x | "
                         f"{lv['itl_p99_ms']} | {b['itl_p99_ms']} |")  # fmt: skip
    return "\n".join(lines)


def smi_samples(path: Path) -> list[tuple[float, float, float]]:
    """(unix time, GPU busy %, memory MiB) per nvidia-smi line (its local-time stamps, read on
    the machine that wrote them, like bench_serve's unix times)."""
    out = []
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            t = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((t, float(parts[1]), float(parts[2])))
        except (ValueError, IndexError):
            continue  # a header or a cut line
    return out


def device_table(runs: list[dict], smi_dir: Path) -> str:
    lines = ["| server | streams | GPU busy % (mean while measured) | GPU memory MiB (peak) |",
             "|---|---|---|---|"]  # fmt: skip
    for r in runs:
        path = smi_dir / f"smi_{r['label']}.csv"
        if not path.is_file():
            continue
        samples = smi_samples(path)
        for lv in r["levels"]:
            t0, t1 = lv.get("unix_start"), lv.get("unix_end")
            inside = [s for s in samples if t0 is not None and t0 <= s[0] <= t1]
            if inside:
                busy = sum(s[1] for s in inside) / len(inside)
                mem = max(s[2] for s in inside)
                lines.append(f"| {r['label']} | {lv['concurrency']} | {busy:.0f} | {mem:.0f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--baseline", help="label to compare against (the last file's)")
    ap.add_argument("--smi", type=Path, help="folder of smi_LABEL.csv (nvidia-smi samples)")
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
    device = device_table(runs, a.smi) if a.smi else ""
    if device:
        print("\nThe device while each level was measured:\n\n" + device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
