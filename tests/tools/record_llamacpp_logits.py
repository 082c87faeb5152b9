"""Record llama.cpp's CPU logits on the tiny family fixtures (tests/data/families) as goldens.

Compiles record_llamacpp_logits.c against a CPU build of llama.cpp (libllama, see
/work/llama-cpu/BUILD.txt for how that one was built) and runs it on each fixture's GGUF with the
ids the engine tests use: the prompt's ids then transformers' greedy tokens (the fixture JSON's
`prompt.ids + greedy_ids`). Never imports localllm; needs numpy and gguf-py (the project venv has
both)::

    python tests/tools/record_llamacpp_logits.py --llama-cpp-src /work/llama-cpu-src \
        --llama-cpp-build /work/llama-cpu/build --commit 3f545beccee69d9975f466ec7e45fd9aacd8ba90

Two runs per family, each in fresh contexts with one thread:

* ``f32``: the fixture widened to F32 by llama.cpp's own ``llama_model_quantize`` (ALL_F32, pure;
  the F16 weights are exactly representable, so the values are unchanged), F32 KV cache, flash
  attention off: llama.cpp's fp32 reference. Logits of every position from one decode
  (``whole``), from the same ids fed in chunks of CHUNKS then one token at a time (``chunked``,
  the KV cache and recurrent state carried between them), and llama.cpp's own greedy tokens
  after the prompt with the logits each step chose from.
* ``default``: the F16 file as shipped with llama.cpp's default F16 KV cache and flash attention
  ``auto``: what a user of llama.cpp gets (ggml rounds activations to F16 for F16 weights).

Writes tests/data/goldens/families/<name>.json.gz (~40 KB: the f32 logits as little-endian
float32, the chunked ones as their exact difference from those, the default run's as float16, the
greedy steps as their top-8 (id, logit)) and prints each family's max |llama.cpp - transformers|.
A family llama.cpp cannot load or decode is recorded in
tests/data/goldens/families/unsupported.json with its error line instead.
"""

from __future__ import annotations

import argparse
import base64
import datetime as _dt
import gzip
import hashlib
import json
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

REPO = Path(__file__).resolve().parents[2]
FAMILIES = REPO / "tests" / "data" / "families"
OUT = REPO / "tests" / "data" / "goldens" / "families"
SOURCE = Path(__file__).with_suffix(".c")
CHUNKS = [3, 7, 13]  # prefill chunks, then one token per decode to the end
THREADS = 1
TOP = 8  # (id, logit) pairs kept per greedy step
MODELS = {
    "f32": "the fixture widened to F32 (llama_model_quantize ALL_F32, pure)",
    "default": "the fixture as shipped (F16 weights)",
}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compile_recorder(src: Path, build: Path, workdir: Path) -> Path:
    exe = workdir / "record_llamacpp_logits"
    lib = build / "bin"
    cmd = [
        "cc",
        "-O2",
        "-std=c11",
        "-Wall",
        "-o",
        str(exe),
        str(SOURCE),
        f"-I{src / 'include'}",
        f"-I{src / 'ggml' / 'include'}",
        f"-L{lib}",
        "-lllama",
        "-lggml",
        "-lggml-base",
        f"-Wl,-rpath,{lib}",
    ]
    subprocess.run(cmd, check=True)
    return exe


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def encode(a: np.ndarray, dtype: str) -> dict:
    """An array as {shape, dtype, base64} (little-endian)."""
    a = np.asarray(a).astype(dtype)
    return {
        "shape": list(a.shape),
        "dtype": dtype,
        "base64": base64.b64encode(a.tobytes()).decode(),
    }


def top(rows: list[list[float]]) -> list[list[list[float]]]:
    """Each row's TOP highest (id, logit), best first: enough for the near-tie rule."""
    out = []
    for r in np.asarray(rows, dtype=np.float32):
        best = np.argsort(-r, kind="stable")[:TOP]
        out.append([[int(i), float(r[i])] for i in best])
    return out


def widen_to_f32(exe: Path, src: Path, dst: Path) -> None:
    res = run([str(exe), "to-f32", str(src), str(dst)])
    if res.returncode != 0:
        raise RuntimeError(res.stderr.strip().splitlines()[-1])
    left = [t.name for t in gguf.GGUFReader(dst).tensors if t.tensor_type.name != "F32"]
    if left:
        raise RuntimeError(f"llama_model_quantize left non-F32 tensors: {left}")


def record_run(
    exe: Path,
    model: Path,
    ids: list[int],
    n_prompt: int,
    n_greedy: int,
    kv: str,
    fa: str,
    chunks: list[int] | None,
) -> tuple[dict, list[str]]:
    """One `logits` invocation of the C recorder; returns its parsed output and the argv."""
    cmd = [
        str(exe),
        "logits",
        str(model),
        "--ids",
        ",".join(map(str, ids)),
        "--prompt",
        str(n_prompt),
        "--greedy",
        str(n_greedy),
        "--kv",
        kv,
        "--fa",
        fa,
        "--threads",
        str(THREADS),
    ]
    if chunks:
        cmd += ["--chunks", ",".join(map(str, chunks))]
    res = run(cmd)
    if res.returncode != 0:
        lines = res.stderr.strip().splitlines() or [f"exit status {res.returncode}"]
        raise RuntimeError(lines[-1])
    return json.loads(res.stdout), cmd


def transformers_logits(fixture: dict) -> np.ndarray:
    lg = fixture["logits"]
    return np.frombuffer(base64.b64decode(lg["base64"]), dtype=np.float32).reshape(lg["shape"])


def record_family(exe: Path, name: str, tmp: Path, meta: dict) -> dict:
    gguf_path = FAMILIES / f"{name}.gguf"
    fixture = json.loads((FAMILIES / f"{name}.json").read_text(encoding="utf-8"))
    prompt = fixture["prompt"]["ids"]
    ids = prompt + fixture["greedy_ids"]
    n_greedy = len(fixture["greedy_ids"])
    plan = CHUNKS + [1] * (len(ids) - sum(CHUNKS))
    f32_path = tmp / f"{name}.f32.gguf"
    widen_to_f32(exe, gguf_path, f32_path)
    runs, commands = {}, {}
    for key, model, kv, fa, chunks in (
        ("f32", f32_path, "f32", "off", plan),
        ("default", gguf_path, "f16", "auto", None),
    ):
        out, cmd = record_run(exe, model, ids, len(prompt), n_greedy, kv, fa, chunks)
        argv = [Path(c).name if c == str(model) else c for c in cmd[1:]]
        commands[key] = shlex.join(["record_llamacpp_logits", *argv])
        whole = np.asarray(out["whole"], dtype=np.float32)
        runs[key] = {
            "model": MODELS[key],
            "kv_cache": kv,
            "flash_attn": fa,
            "threads": THREADS,
            # fp32 exact for the fp32 reference; F16 (error < 4e-3 on these logits) for the
            # default run, which is compared at a looser tolerance
            "whole": encode(whole, "<f4" if key == "f32" else "<f2"),
            "greedy_ids": out["greedy_ids"],
            "greedy_top": top(out["greedy_logits"]),
        }
        if chunks:
            # exact float32 differences: the prefill chunks' rows are mostly 0 and compress
            chunked = np.asarray(out["chunked"], dtype=np.float32)
            runs[key]["chunks"] = out["chunks"]
            runs[key]["chunked_minus_whole"] = encode(chunked - whole, "<f4")
        meta["system_info"] = out["system_info"]
        want = transformers_logits(fixture)
        same = "==" if out["greedy_ids"] == fixture["greedy_ids"] else "!="
        print(
            f"{name:20s} {key:8s} max|llama.cpp - transformers| = {np.abs(whole - want).max():.3g}"
            f"  llama.cpp greedy {same} transformers'"
        )
    return {
        "schema_version": 1,
        "family": name,
        "fixture": {
            "gguf": gguf_path.name,
            "gguf_sha256": sha256(gguf_path),
            "json": f"{name}.json",
            "n_prompt": len(prompt),
        },
        "ids": ids,
        "llama_cpp": {k: meta[k] for k in ("commit", "build", "system_info")},
        "recorder": {
            "script": "tests/tools/record_llamacpp_logits.py",
            "commands": commands,
            "date": meta["date"],
            "python": platform.python_version(),
            "numpy": np.__version__,
        },
        "runs": runs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp-src", type=Path, default=Path("/work/llama-cpu-src"))
    ap.add_argument("--llama-cpp-build", type=Path, default=Path("/work/llama-cpu/build"))
    ap.add_argument("--commit", required=True, help="the llama.cpp commit the build is of")
    ap.add_argument(
        "--build-note",
        default="CPU build, see /work/llama-cpu/BUILD.txt",
        help="how the library was built (recorded in each golden)",
    )
    ap.add_argument("names", nargs="*", help="families (default: every tests/data/families GGUF)")
    args = ap.parse_args()
    names = args.names or sorted(p.stem for p in FAMILIES.glob("*.gguf"))
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {
        "commit": args.commit,
        "build": args.build_note,
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d"),
    }
    unsupported_path = OUT / "unsupported.json"
    unsupported = json.loads(unsupported_path.read_text()) if unsupported_path.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        exe = compile_recorder(args.llama_cpp_src, args.llama_cpp_build, Path(tmp))
        for name in names:
            try:
                golden = record_family(exe, name, Path(tmp), meta)
            except RuntimeError as e:
                print(f"{name}: llama.cpp cannot run it: {e}", file=sys.stderr)
                unsupported[name] = {"error": str(e), "commit": args.commit}
                continue
            unsupported.pop(name, None)
            data = json.dumps(golden, separators=(",", ":")).encode()
            # mtime=0: the same recording gives the same bytes
            (OUT / f"{name}.json.gz").write_bytes(gzip.compress(data, 9, mtime=0))
    unsupported_path.write_text(json.dumps(unsupported, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
