"""Image encode time and image-prompt time to first token: localllm next to llama.cpp's
`llama-mtmd-cli` (or its libmtmd through tests/perf/mtmd_ttft.c) on the same GGUF pair and image.
Not a test.

With `--llama-driver PATH` (mtmd_ttft built against the llama.cpp in use) llama.cpp runs in one
long-lived process instead of one llama-mtmd-cli per round: the driver loads the pair once
(mtmd's warm-up encode included), then each round, started by a line on its stdin, does what
llama-mtmd-cli does for one image prompt and reports its encode time (mtmd_batch_encode: tower +
projector), the image embeddings' prefill and its time to first token from reading the image
file to the greedy first token. Its prompt is the GGUF's chat template rendered (jinja2) with one
user turn of mtmd's marker + PROMPT, as llama-mtmd-cli renders it. The driver's first round is a
warm-up and dropped, as ours is. This is the mode for the GPU (one CUDA build of libmtmd carried,
no llama-mtmd-cli needed).

Rounds alternate in one process tree (so both see the same machine load):
1. ours, encode: `VisionPipeline.prepare` (PNG decode + the family's preprocessing) and
   `VisionPipeline.encode` (tower + projector), each timed;
2. one `llama-mtmd-cli` run (`-n 1 --temp 0 -t T`, `-ngl 99` on CUDA), its stderr parsed: the
   sum of "image slice encoded in X ms" / "mtmd batch encoding done in X ms" (its encode:
   tower + projector, preprocessing not logged), the sum of "image decoded (batch i/n) in Y ms"
   (the image embeddings through the text model) and llama_perf's "prompt eval time", which
   spans the whole prompt from its first decode to its last, the encodes between them included
   (checked against the log's timestamps): its time to first token, less tokenizing and
   preprocessing before it;
3. ours, time to first token: prepare + chat prompt + `LLMEngine.add_request` until the first
   token comes (the tower runs at prefill), with a fresh content hash each round so neither the
   encoder cache nor the prefix cache serves it.
Prints the best (and median) of each column as Markdown rows for tests/perf/results/vision.md,
plus CPU seconds (user + system, all threads) of our encode and of each whole llama-mtmd-cli
process, which a busy machine disturbs less than wall time.

    python tests/perf/make_synthetic_vlm.py -o /tmp/vlm
    python tests/perf/bench_vision_vs_mtmd.py --text /tmp/vlm/smolvlm-500m-text.gguf \
        --mmproj /tmp/vlm/smolvlm-500m-mmproj.gguf --llama-bin /work/llama-cpu/build/bin \
        --threads 2 --rounds 3 [--image X.png | --side 512] [--device cuda]
"""

import argparse
import contextlib
import dataclasses
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

PROMPT = "Describe this image."
_ENCODE = re.compile(r"(?:slice encoded in|mtmd batch encoding done in) (\d+) ms")
_DECODE = re.compile(r"image decoded \(batch \d+/\d+\) in (\d+) ms")
_PROMPT_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")


def make_image(side: int, path: Path) -> Path:
    """A deterministic photo-like PNG: colour gradients plus noise."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:side, 0:side]
    img = np.stack([(x / 2) % 256, (y / 2) % 256, ((x + y) / 4) % 256], -1)
    img = img + rng.integers(0, 32, (side, side, 3))
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(path)
    return path


def parse_mtmd(stderr: str) -> dict:
    """llama-mtmd-cli's own timings (ms) from its log."""
    pe = _PROMPT_EVAL.findall(stderr)
    if not pe:
        raise RuntimeError("no 'prompt eval time' in llama-mtmd-cli's log:\n" + stderr[-2000:])
    enc = [int(x) for x in _ENCODE.findall(stderr)]
    return {
        "encode_ms": float(sum(enc)),
        "slices": len(enc),
        "image_decode_ms": float(sum(int(x) for x in _DECODE.findall(stderr))),
        "prompt_eval_ms": float(pe[-1][0]),
        "prompt_tokens": int(pe[-1][1]),
    }


def run_mtmd(a, image: Path) -> dict:
    cmd = [str(Path(a.llama_bin) / "llama-mtmd-cli"), "-m", a.text, "--mmproj", a.mmproj,
           "--image", str(image), "-p", a.prompt, "-n", "1", "--temp", "0", "-t", str(a.threads),
           "-c", str(a.ctx), "-v"]  # fmt: skip
    # (-v: without it the log holds neither llama_perf's lines nor the image decode times)
    cmd += ["-ngl", "99"] if a.device == "cuda" else ["-ngl", "0"]
    libs = f"{a.llama_bin}:{os.environ.get('LD_LIBRARY_PATH', '')}"
    env = {**os.environ, "LD_LIBRARY_PATH": libs}
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode:
        raise RuntimeError(f"llama-mtmd-cli failed ({p.returncode}):\n{p.stderr[-3000:]}")
    out = parse_mtmd(p.stderr)
    out["ttft_ms"] = out["prompt_eval_ms"]
    out["process_s"] = wall
    out["process_cpu_s"] = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return out


class Ours:
    def __init__(self, a):
        from localllm.engine import EngineArgs, LLMEngine
        from localllm.media.vision.pipeline import VisionPipeline

        torch.set_num_threads(a.threads)
        args = EngineArgs(max_num_seqs=1, max_model_len=a.ctx, device=a.device,
                          enable_prefix_caching=False)  # fmt: skip
        self.engine = LLMEngine(a.text, args)
        self.pipe = VisionPipeline(a.mmproj, self.engine)
        tower = getattr(self.pipe.model, "v", None)
        if a.half_tower:  # siglip.Tower.use_half (Gemma 3, SmolVLM)
            if not hasattr(tower, "use_half"):
                raise SystemExit("--half-tower: this projector's tower has no half path")
            tower.use_half(None if a.half_tower == "float32" else getattr(torch, a.half_tower))
        blk = getattr(tower, "blk", [None])[0]
        half = getattr(blk, "half_weights", None)
        self.tower_mode = "float32" if half is None else str(half["ffn_up"][0].dtype)[6:]
        self.prompt = a.prompt
        self.cuda = a.device == "cuda"

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def encode(self, data: bytes) -> dict:
        c0, t0 = time.process_time(), time.perf_counter()
        im = self.pipe.prepare(data)
        t1 = time.perf_counter()
        emb = self.pipe.encode(im)
        self._sync()
        t2 = time.perf_counter()
        return {"preprocess_ms": 1e3 * (t1 - t0), "tower_ms": 1e3 * (t2 - t1),
                "encode_ms": 1e3 * (t2 - t0), "encode_cpu_s": time.process_time() - c0,
                "tiles": int(im.pixels.shape[0]), "tokens": int(emb.shape[0])}  # fmt: skip

    def ttft(self, data: bytes, tag: str) -> dict:
        from localllm.engine import SamplingParams

        t0 = time.perf_counter()
        im = self.pipe.prepare(data)
        parts = [{"type": "image"}, {"type": "text", "text": self.prompt}]
        turn = [{"role": "user", "content": parts}]
        ids, mm = self.pipe.chat(self.engine, turn, [im])
        mm = [dataclasses.replace(x, content_hash=f"{x.content_hash}#{tag}") for x in mm]
        self.engine.add_request(tag, ids, SamplingParams(temperature=0, max_tokens=1), mm_inputs=mm)
        first = None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if first is None and any(c.token_ids for c in out.outputs):
                    self._sync()
                    first = time.perf_counter()
                if out.finished and out.error:
                    raise RuntimeError(out.error)
        return {"ttft_ms": 1e3 * (first - t0), "prompt_tokens": len(ids)}


def driver_prompt(text_gguf: str, prompt: str) -> str:
    """The chat-formatted prompt llama-mtmd-cli would build: the file's template, one user turn
    holding mtmd's media marker then the prompt, the generation prompt."""
    import gguf
    import jinja2

    r = gguf.GGUFReader(text_gguf)
    f = r.fields
    tokens = f["tokenizer.ggml.tokens"].contents()
    bos = f.get("tokenizer.ggml.bos_token_id")
    eos = f.get("tokenizer.ggml.eos_token_id")
    template = jinja2.Environment().from_string(f["tokenizer.chat_template"].contents())
    turn = [{"role": "user", "content": "<__media__>" + prompt}]
    return template.render(messages=turn, add_generation_prompt=True,
                           bos_token=tokens[bos.contents()] if bos else "",
                           eos_token=tokens[eos.contents()] if eos else "")  # fmt: skip


class Driver:
    """tests/perf/mtmd_ttft.c in one process, a round per line written to its stdin."""

    def __init__(self, a, image: Path, tmp: Path):
        prompt = tmp / "prompt.txt"
        prompt.write_text(driver_prompt(a.text, a.prompt))
        cmd = [a.llama_driver, a.text, a.mmproj, str(prompt), str(image), "--stdin",
               "--threads", str(a.threads), "--ctx", str(a.ctx),
               "--ngl", "999" if a.device == "cuda" else "0"]  # fmt: skip
        libs = f"{a.llama_bin}:{os.environ.get('LD_LIBRARY_PATH', '')}"
        env = {**os.environ, "LD_LIBRARY_PATH": libs}
        self.cmd, self.env, self.ready, self.failed = cmd, env, {}, False

    def start(self) -> None:
        self.p = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, env=self.env)  # fmt: skip
        self.ready = self._line()

    def _line(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"mtmd_ttft exited ({self.p.wait()}): see its stderr above")
        return json.loads(line)

    def round(self) -> dict:
        self.p.stdin.write("go\n")
        self.p.stdin.flush()
        return self._line()

    def close(self) -> None:
        if not hasattr(self, "p"):
            return
        with contextlib.suppress(OSError):  # it exited already
            self.p.stdin.close()
        self.p.wait()


def _col(rows: list[dict], key: str) -> str:
    xs = [r[key] for r in rows]
    f = ".1f" if min(xs) < 100 else ".0f"
    return f"{min(xs):{f}} (median {statistics.median(xs):{f}})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", required=True, help="text model GGUF")
    ap.add_argument("--mmproj", required=True)
    ap.add_argument("--image", type=Path, default=None, help="PNG (default: a generated one)")
    ap.add_argument("--side", type=int, default=512, help="the generated image's side, px")
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN", "/work/llama-cpu/build/bin"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--llama-driver", default=None, help="mtmd_ttft binary (see above)")
    ap.add_argument("--skip-llama", action="store_true", help="ours only")
    ap.add_argument("--json", type=Path, default=None, help="write every round's figures here")
    ap.add_argument(
        "--half-tower",
        choices=("float16", "bfloat16", "float32"),
        default=None,
        help="ours: run a SigLIP tower's blocks in this dtype (default: as shipped, half blocks "
        "on CUDA while media.vision.mmproj.HALF_TOWER is on)",
    )
    a = ap.parse_args(argv)
    tmp = tempfile.TemporaryDirectory()
    image = a.image or make_image(a.side, Path(tmp.name) / f"img{a.side}.png")
    data = image.read_bytes()
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    ours = Ours(a)
    half = f", tower blocks in {ours.tower_mode}"
    print(f"ours loaded in {time.perf_counter() - t0:.1f} s{half}; load average {load:.1f}",
          flush=True)  # fmt: skip
    ours.encode(data)  # warm-up (allocations, first-call kernel choices)
    ours.ttft(data, "warm-up")
    drv = None
    if a.llama_driver and not a.skip_llama:
        t0 = time.perf_counter()
        drv = Driver(a, image, Path(tmp.name))
        try:
            drv.start()
            r = drv.ready
            fa = f"text {r.get('text_flash_attn')}, encoder {r.get('encoder_flash_attn')}"
            print(f"mtmd_ttft loaded in {time.perf_counter() - t0:.1f} s; flash attention: {fa}")
            print("mtmd_ttft warm-up", json.dumps(drv.round()), flush=True)
        except (RuntimeError, OSError, ValueError) as e:  # ours' rounds still count
            drv.failed = True
            print(f"mtmd_ttft failed: {e}", flush=True)
    rows_enc, rows_ttft, rows_ll = [], [], []
    for r in range(a.rounds):
        rows_enc.append(ours.encode(data))
        print("ours encode", json.dumps(rows_enc[-1]), flush=True)
        if drv is not None:
            try:
                if drv.failed:
                    raise RuntimeError("not running")
                rows_ll.append(drv.round())
                print("mtmd_ttft", json.dumps(rows_ll[-1]), flush=True)
            except (RuntimeError, OSError, ValueError) as e:
                if not drv.failed:
                    print(f"mtmd_ttft failed: {e}", flush=True)
                drv.failed = True
        elif not a.skip_llama:
            rows_ll.append(run_mtmd(a, image))
            print("llama-mtmd-cli", json.dumps(rows_ll[-1]), flush=True)
        rows_ttft.append(ours.ttft(data, f"round{r}"))
        print("ours ttft", json.dumps(rows_ttft[-1]), flush=True)
    e = rows_enc[0]
    print(f"\n{image.name}: {e['tiles']} tiles (Qwen: patches), {e['tokens']} image tokens, "
          f"prompt {rows_ttft[0]['prompt_tokens']} tokens; load average at start {load:.1f}, "
          f"at end {os.getloadavg()[0]:.1f}; best (median) of {a.rounds} ms")  # fmt: skip
    print("| | preprocess | tower + projector | encode total | prompt eval | TTFT | encode CPU s |")
    print("|---|---|---|---|---|---|---|")
    print(f"| localllm | {_col(rows_enc, 'preprocess_ms')} | {_col(rows_enc, 'tower_ms')} | "
          f"{_col(rows_enc, 'encode_ms')} | - | {_col(rows_ttft, 'ttft_ms')} | "
          f"{min(r['encode_cpu_s'] for r in rows_enc):.1f} |")  # fmt: skip
    if drv is not None:
        drv.close()
    if drv is not None and rows_ll:
        ll = rows_ll[0]
        print(f"| llama.cpp (libmtmd) | {_col(rows_ll, 'read_tokenize_ms')} (read + tokenize) | "
              f"{_col(rows_ll, 'encode_ms')} | - | image part {_col(rows_ll, 'image_decode_ms')}, "
              f"text {_col(rows_ll, 'text_ms')} ({ll['prompt_tokens']} tok, "
              f"{ll['image_tokens']} image) | {_col(rows_ll, 'ttft_ms')} | - |")  # fmt: skip
        enc = min(r["tower_ms"] for r in rows_enc) / min(r["encode_ms"] for r in rows_ll)
        ttft = min(r["ttft_ms"] for r in rows_ttft) / min(r["ttft_ms"] for r in rows_ll)
        print(f"ours / llama.cpp, best against best: encode {enc:.2f}, TTFT {ttft:.2f} "
              "(below 1: ours faster)")  # fmt: skip
    elif rows_ll:
        ll = rows_ll[0]
        print(f"| llama-mtmd-cli | (not logged) | {_col(rows_ll, 'encode_ms')} | - | "
              f"{_col(rows_ll, 'prompt_eval_ms')} ({ll['prompt_tokens']} tok; image part "
              f"{_col(rows_ll, 'image_decode_ms')}) | {_col(rows_ll, 'ttft_ms')} | "
              f"whole process {min(r['process_cpu_s'] for r in rows_ll):.1f} |")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps({"encode": rows_enc, "ttft": rows_ttft, "llama": rows_ll}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
