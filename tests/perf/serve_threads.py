"""CPU time of `localllm serve`'s threads per streamed token, A/B over switches (not a test).

Starts the server (`tests/perf/with_switches.py` sets each variant's switches), runs
`bench_serve.py` at one concurrency against it, and reads every thread's CPU time from
/proc/PID/task/*/stat before and after (Linux): the event loop's (the process's main thread),
the engine thread's (the busiest other thread) and the rest (torch's workers, uvicorn's). The tokens
streamed in that window come from the server's own /metrics (`vllm:generation_tokens`). Variants
alternate, `--rounds` times each, a fresh server for every run. Prints one markdown table.

    OMP_NUM_THREADS=1 python tests/perf/serve_threads.py -m tiny.gguf --np 64 --conc 64 \
        --variant "base=" \
        --variant "one call per output=localllm.engine.async_engine.BATCH_DELIVERY=False"
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).parent
TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """{tid: (name, CPU seconds)} of a process's threads."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def generated(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    found = re.findall(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return sum(float(v) for v in found)


def wait_healthy(url: str, proc: subprocess.Popen, limit: float) -> None:
    end = time.time() + limit
    while time.time() < end:
        if proc.poll() is not None:
            raise SystemExit(f"serve_threads: the server exited ({proc.returncode})")
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("serve_threads: the server did not come up")


def one_run(a, switches: list[str], port: int) -> dict:
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, str(HERE / "with_switches.py"), *switches, "--", "-m", "localllm.app"]
    cmd += ["serve", "-m", a.model, "-np", str(a.np), "--port", str(port), "-t", str(a.threads)]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        return _measure(a, proc, url)


def _measure(a, proc: subprocess.Popen, url: str) -> dict:
    try:
        wait_healthy(url, proc, 300)
        with tempfile.NamedTemporaryFile(suffix=".json") as js:
            bench = [sys.executable, str(HERE / "bench_serve.py"), "--url", url]
            bench += ["--concurrency", str(a.conc), "--gen", str(a.gen), "--json", js.name]
            bench += ["--min-prompt", str(a.min_prompt), "--max-prompt", str(a.max_prompt)]
            bench += ["--system", "32", "--docs", "64,96", "--rounds", str(a.rounds_per_client)]
            t0, g0, w0 = thread_cpu(proc.pid), generated(url), time.perf_counter()
            subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
            t1, g1, wall = thread_cpu(proc.pid), generated(url), time.perf_counter() - w0
            level = json.loads(Path(js.name).read_text())["levels"][0]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    spent = {tid: s - t0.get(tid, (name, 0.0))[1] for tid, (name, s) in t1.items()}
    loop = spent.pop(proc.pid, 0.0)
    # the engine thread: the busiest other one (Python 3.11 gives threads no OS names)
    engine = max(spent.values(), default=0.0)
    cpu = {"loop": loop, "engine": engine, "other": sum(spent.values()) - engine}
    return {"tokens": g1 - g0, "wall": wall, "tok_s": level["output_tok_s"], **cpu}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--np", type=int, default=64)
    p.add_argument("--conc", type=int, default=64)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=128)
    p.add_argument("--rounds-per-client", type=int, default=1)
    p.add_argument("-t", "--threads", type=int, default=1, help="the server's torch threads")
    p.add_argument("--rounds", type=int, default=2, help="runs of each variant, alternating")
    p.add_argument("--variant", action="append", required=True,
                   help="LABEL=MODULE.NAME=VALUE[,...] (LABEL= alone: as shipped)")  # fmt: skip
    p.add_argument("--port", type=int, default=8190)
    a = p.parse_args()
    variants = []
    for v in a.variant:
        label, _, rest = v.partition("=")
        variants.append((label, [s for s in rest.split(",") if s]))
    print("| variant | round | tokens | wall s | tok/s (bench) | event loop CPU s | us a token "
          "| engine CPU s | us a token | other CPU s |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in range(a.rounds):
        for label, switches in variants:
            x = one_run(a, switches, a.port)
            tok = max(x["tokens"], 1)
            print(f"| {label} | {r + 1} | {x['tokens']:.0f} | {x['wall']:.2f} | {x['tok_s']} | "
                  f"{x['loop']:.2f} | {x['loop'] / tok * 1e6:.0f} | {x['engine']:.2f} | "
                  f"{x['engine'] / tok * 1e6:.0f} | {x['other']:.2f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
