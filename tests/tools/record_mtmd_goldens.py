"""Record llama.cpp's libmtmd on the tiny vision fixtures (tests/data/vision) as a second reference.

Compiles record_mtmd_goldens.c against a CPU build of llama.cpp with libmtmd (how the one used
was built: /work/llama-cpu/BUILD.txt) and runs it, per family, on the fixture's text GGUF +
mmproj with the images and prompt ids of the transformers comparison (each chat's `input_ids`,
every run of the image token filled with the rows llama.cpp's own preprocessing, tower and
projector give for the next image chunk). Never imports localllm; needs numpy and gguf-py::

    python tests/tools/record_mtmd_goldens.py --llama-cpp-src /work/llama-cpu-src \
        --llama-cpp-build /work/llama-cpu/build --commit 3f545beccee69d9975f466ec7e45fd9aacd8ba90

Two runs per chat, one thread, fresh contexts, flash attention off:

* ``f32``: text GGUF and mmproj widened to F32 by gguf-py (the F16 values unchanged), F32 KV:
  llama.cpp's fp32 path, where only its preprocessing and summation order can differ from ours.
* ``default``: the files as shipped (F16 matrices: ggml rounds activations to F16), F16 KV.

Writes tests/data/vision/<family>.mtmd.json (3-22 KB): mtmd's own prompt split (text chunk
lengths, image chunk token counts) and whether it flattens to the transformers ids; per run the
image rows summarized (every row's L2 norm; for chats without resampling also at most 4 evenly
strided rows and the logits after the prompt) and 8 greedy steps (ids, each step's top-4), for
the fixture's one- and two-image chats and, where llama.cpp's resize differs from Pillow's, the
one-image chat again on a crop at the processor's own size (`NATIVE`); or the error line where
llama.cpp's token count differs from transformers'. Prints each run's distance from the
transformers record.
"""

from __future__ import annotations

import argparse
import base64
import datetime as _dt
import hashlib
import json
import shlex
import subprocess
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "vision"
SOURCE = Path(__file__).with_suffix(".c")
GREEDY = 8
TOP = 4
MAX_ROWS = 4
QWEN_MARK = "<|vision_start|><|image_pad|><|vision_end|>"
# family -> (record, text GGUF, mmproj, image placeholder in the chat text, pixels per token)
FAMILIES = {
    "gemma3": ("gemma3.json", "gemma3-text.gguf", "mmproj-gemma3.gguf", "<start_of_image>", 0),
    "idefics3": ("idefics3.json", "idefics3-text.gguf", "mmproj-idefics3.gguf", "<image>", 0),
    "llava": ("llava.json", "llava-text.gguf", "mmproj-llava.gguf", "<image>", 0),
    "llava16": ("llava16.json", "llava-text.gguf", "mmproj-llava16.gguf", "<image>", 0),
    "qwen2vl": ("qwen2vl.json", "qwen2vl-text.gguf", "mmproj-qwen2vl.gguf", QWEN_MARK, 784),
    "qwen25vl": ("qwen25vl.json", "qwen25vl-text.gguf", "mmproj-qwen25vl.gguf", QWEN_MARK, 784),
    "qwen3vl": ("qwen3vl.json", "qwen3vl-text.gguf", "mmproj-qwen3vl.gguf", QWEN_MARK, 1024),
    "qwen3vlmoe": (
        "qwen3vlmoe.json",
        "qwen3vlmoe-text.gguf",
        "mmproj-qwen3vlmoe.gguf",
        QWEN_MARK,
        1024,
    ),
}
CHATS = ("one_image", "two_images")
# Chats whose images neither side resamples (sizes already on the processors' grid): the only
# ones whose rows and logits are stored in full; the others keep counts, norms and greedy steps.
UNRESAMPLED = {("qwen2vl", "one_image"), ("qwen25vl", "one_image")}
# Crops of the fixture images at the size the processors resize to, so that neither side
# resamples (llama.cpp's resize differs from Pillow's); recorded as "<chat>_native".
NATIVE = {
    "gemma3": {"tall.png": "tall32.png"},
    "llava": {"tall.png": "tall32.png"},
    "qwen3vl": {"qtall.png": "qtall32.png"},
    "qwen3vlmoe": {"qtall.png": "qtall32.png"},
    "idefics3": {"tall.png": "sq64.png"},  # tiles cut unresized; the global view is resized
}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def b64(a: np.ndarray, dtype: str = "<f4") -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype=dtype).tobytes()).decode()


def unb64(s: str, shape) -> np.ndarray:
    return np.frombuffer(base64.b64decode(s), dtype="<f4").reshape(shape)


def compile_recorder(src: Path, build: Path, workdir: Path) -> Path:
    exe = workdir / "record_mtmd_goldens"
    lib = build / "bin"
    cmd = ["cc", "-O2", "-std=c11", "-Wall", "-o", str(exe), str(SOURCE)]
    cmd += [f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}", f"-I{src / 'tools' / 'mtmd'}"]
    cmd += [f"-L{lib}", "-lmtmd", "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib}"]
    subprocess.run(cmd, check=True)
    return exe


def widen(src: Path, dst: Path) -> Path:
    """`src` rewritten with every F16 tensor as F32 (exact), metadata unchanged."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(str(dst), arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), kind, sub_type=sub)
    for t in r.tensors:
        data, kind = np.array(t.data), t.tensor_type
        if kind == GGMLQuantizationType.F16:
            data, kind = data.astype(np.float32), GGMLQuantizationType.F32
        w.add_tensor(t.name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def summarize(rows: np.ndarray) -> dict:
    stride = max(1, -(-len(rows) // MAX_ROWS))
    return {
        "n_rows": len(rows),
        "row_norms": b64(np.linalg.norm(rows, axis=1)),
        "stride": stride,
        "rows": b64(rows[::stride]),
    }


def layout(chunks: list[dict], image_token: int) -> tuple[list, list[int]]:
    split, flat = [], []
    for c in chunks:
        if c["type"] == "text":
            split.append(["text", len(c["ids"])])
            flat += c["ids"]
        else:
            split.append(["image", c["n_tokens"], c["n_pos"]])
            flat += [image_token] * c["n_tokens"]
    return split, flat


def run_chat(exe, text, mmproj, fam, rec, chat, kv, tmp) -> tuple[dict, list[str]]:
    _, _, _, mark, unit = FAMILIES[fam]
    prompt = tmp / f"{fam}.txt"
    prompt.write_text(chat["text"].replace(mark, "<__media__>"))
    cmd = [str(exe), str(text), str(mmproj), str(prompt)] + [str(DATA / n) for n in chat["images"]]
    cmd += ["--greedy", str(GREEDY), "--threads", "1", "--kv", kv]
    cmd += [
        "--ids",
        ",".join(map(str, chat["input_ids"])),
        "--image-token",
        str(rec["image_token_id"]),
    ]
    if unit:  # Qwen: the recorder's min/max pixels as mtmd's token bounds
        p = rec["processor"]
        cmd += [
            "--min-tokens",
            str(p["min_pixels"] // unit),
            "--max-tokens",
            str(p["max_pixels"] // unit),
        ]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode == 3:  # llama.cpp's image token count differs: record its own layout
        out = json.loads(p.stdout.split(',"embd":')[0] + "}")
        err = p.stderr.strip().splitlines()[-1]
        return {"error": err, "chunks": out["chunks"]}, cmd
    if p.returncode != 0:
        raise RuntimeError(f"{fam}: recorder failed ({p.returncode}): {p.stderr[-2000:]}")
    return json.loads(p.stdout), cmd


def record_family(exe, fam, tmp, commit, argv) -> dict:
    name, text_name, mm_name, _, _ = FAMILIES[fam]
    rec = json.loads((DATA / name).read_text())
    text, mmproj = DATA / text_name, DATA / mm_name
    files = {
        "f32": (
            widen(text, tmp / f"{fam}-text-f32.gguf"),
            widen(mmproj, tmp / f"{fam}-mm-f32.gguf"),
            "f32",
        ),
        "default": (text, mmproj, "f16"),
    }
    vocab = rec["vocab_size"]
    out = {
        "recorder": {
            "script": "tests/tools/record_mtmd_goldens.py",
            "llama_cpp_commit": commit,
            "command": argv,
            "date": _dt.date.today().isoformat(),
            "threads": 1,
            "flash_attn": "off (encoder and text model)",
        },
        "fixture": {n: sha256(DATA / n) for n in (name, text_name, mm_name)},
        "images": {},
        "runs": {
            "f32": "text GGUF and mmproj widened to F32 by gguf-py, F32 KV cache",
            "default": "the files as shipped (F16 matrices), F16 KV cache",
        },
        "chats": {},
    }
    todo = [(c, c, rec["chats"][c]) for c in CHATS]
    if fam in NATIVE:  # the one-image chat again on a crop neither side resamples
        chat = dict(rec["chats"]["one_image"])
        chat["images"] = [NATIVE[fam].get(n, n) for n in chat["images"]]
        todo.append(("one_image_native", "one_image", chat))
    for cname, source, chat in todo:
        entry = {
            "chat": source,
            "images": chat["images"],
            "input_ids_sha256": hashlib.sha256(json.dumps(chat["input_ids"]).encode()).hexdigest(),
        }
        out["images"].update({n: sha256(DATA / n) for n in chat["images"]})
        for run, (t, m, kv) in files.items():
            got, cmd = run_chat(exe, t, m, fam, rec, chat, kv, tmp)
            split, flat = layout(got["chunks"], rec["image_token_id"])
            entry["mtmd_split"] = split
            entry["mtmd_split_equals_transformers_ids"] = flat == chat["input_ids"]
            out["recorder"]["system_info"] = got.get(
                "system_info", out["recorder"].get("system_info")
            )
            shown = [Path(c).name if "/" in c else c for c in cmd]
            shown[shown.index("--ids") + 1] = "<the chat's input_ids>"
            out["recorder"].setdefault("commands", {})[f"{cname}.{run}"] = shlex.join(shown)
            if "error" in got:
                entry[run] = {"error": got["error"]}
                print(f"{fam:10s} {cname:10s} {run:7s} {got['error']}")
                continue
            rows = np.concatenate(
                [
                    np.asarray(e, dtype=np.float32).reshape(-1, got["n_embd_inp"])
                    for e in got["embd"]
                ]
            )
            steps = np.asarray(got["greedy_logits"], dtype=np.float32)
            top = [
                [[int(i), float(s[i])] for i in np.argsort(-s, kind="stable")[:TOP]] for s in steps
            ]
            entry[run] = {
                "embeddings": summarize(rows),
                "prompt_logits": b64(steps[0]),
                "greedy_ids": got["greedy_ids"],
                "greedy_top": top,
            }
            if (fam, cname) not in UNRESAMPLED and not cname.endswith("_native"):
                del entry[run]["embeddings"]["rows"], entry[run]["prompt_logits"]
            ref = unb64(chat["logits"], (-1, vocab))[0]
            feats = [
                unb64(rec[k][n]["image_features"], rec[k][n]["feature_shape"])
                for n in rec["chats"][source]["images"]
                for k in ("images", "visuals")
                if k in rec
            ]
            feats = np.concatenate(feats)
            same = cname == source and feats.shape == rows.shape  # a crop has no HF record
            enc = float(np.abs(rows - feats).max()) if same else None
            print(
                f"{fam:10s} {cname:10s} {run:7s} rows {rows.shape} encoder-vs-hf {enc} "
                f"logits-vs-hf {float(np.abs(steps[0] - ref).max()):.3g} greedy "
                f"{got['greedy_ids']} hf {chat['greedy_ids']}"
            )
        out["chats"][cname] = entry
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp-src", type=Path, required=True)
    ap.add_argument("--llama-cpp-build", type=Path, required=True)
    ap.add_argument("--commit", required=True, help="llama.cpp commit of the build (recorded)")
    ap.add_argument("families", nargs="*", default=list(FAMILIES))
    a = ap.parse_args()
    argv = shlex.join(
        ["python", "tests/tools/record_mtmd_goldens.py", "--commit", a.commit, *a.families]
    )
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        exe = compile_recorder(a.llama_cpp_src, a.llama_cpp_build, tmp)
        for fam in a.families:
            out = record_family(exe, fam, tmp, a.commit, argv)
            (DATA / f"{fam}.mtmd.json").write_text(json.dumps(out, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
