"""Record tests/data/hf/: tiny Hugging Face folders and llama.cpp's GGUF conversions of them.

For each family in FAMILIES (llama, qwen3, glm4moe): `tests/engine/hf_fixtures.save_tiny`
(transformers, fixed seed, bf16) writes `tests/data/hf/<family>/`, and llama.cpp's own
`convert_hf_to_gguf.py` (run as a subprocess, `--outtype bf16`) turns that folder into
`tests/data/hf/<family>.gguf`. The tests then
check that the engine reads both into the same tensors, `ModelArgs` and greedy tokens
(tests/engine/test_hf_gguf_agree.py), without llama.cpp in CI. `recorder.json` says what made them.

Run from the repository root, with a checkout of llama.cpp (`convert_hf_to_gguf.py`,
`conversion/`, `gguf-py/`):

    python tests/tools/record_hf_fixtures.py --llama-cpp /path/to/llama.cpp [--only glm4moe]

glm4moe's folder carries a NextN layer after its last one, as GLM checkpoints do
(`hf_fixtures.add_nextn_layer`; transformers neither builds nor saves it); the converter keeps it.

One shim, as in record_rerank_fixture.py: the converter names a byte-level BPE's pre-tokenizer
from a hash of its output on a fixed text, and our tokenizer trained on five lines matches no
released model; the shim answers "qwen2" (the same regex family as the tokenizer here). The GGUF
tokenizer is not under test (the model tests feed token ids).
"""

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

# tests/engine/hf_fixtures.py by its path: the repository root on sys.path would shadow the
# PyPI `kernels` package transformers imports with our kernels/ folder
_FIXTURES = Path(__file__).resolve().parents[1] / "engine" / "hf_fixtures.py"
_spec = importlib.util.spec_from_file_location("hf_fixtures", _FIXTURES)
hf_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_fixtures)

FAMILIES = ("llama", "qwen3", "glm4moe")
OUT = Path("tests/data/hf")

BOOTSTRAP = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root + "/gguf-py", root]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = [root + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert(llama_cpp: Path, folder: Path, out: Path) -> None:
    cmd = [sys.executable, "-c", BOOTSTRAP, str(llama_cpp), str(folder),
           "--outfile", str(out), "--outtype", "bf16"]  # fmt: skip
    subprocess.run(cmd, check=True)


def git_head(path: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True)
    except OSError:
        return None
    return out.stdout.decode().strip() or None


def main() -> None:
    import tokenizers
    import torch
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp checkout")
    ap.add_argument("--llama-cpp-commit", help="its commit, when the checkout is no git tree")
    ap.add_argument("--only", nargs="+", choices=FAMILIES, help="re-record these alone")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    for family in args.only or FAMILIES:
        folder = OUT / family
        shutil.rmtree(folder, ignore_errors=True)
        hf_fixtures.save_tiny(family, folder)
        convert(args.llama_cpp, folder, OUT / f"{family}.gguf")
    record = {
        "families": list(FAMILIES),
        "seed": hf_fixtures.SEED,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "tokenizers": tokenizers.__version__,
        "llama_cpp_commit": args.llama_cpp_commit or git_head(args.llama_cpp),
        "converter": "convert_hf_to_gguf.py --outtype bf16 (pre-tokenizer shim: qwen2)",
    }
    (OUT / "recorder.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
