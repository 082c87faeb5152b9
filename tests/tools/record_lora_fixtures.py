"""Record tests/data/lora/: PEFT LoRA adapters of the tiny tests/data/hf/ bases, and llama.cpp's
GGUF conversions of them.

For the llama and qwen3 folders (tests/tools/record_hf_fixtures.py), PEFT's `get_peft_model` with
`init_lora_weights=False` (A and B both random, fixed seed: a real, non-zero delta) on q/k/v/o
and the MLP writes `<family>-a/` (adapter_config.json + adapter_model.safetensors, float32);
llama gets a second adapter `llama-b/` of another rank on q/v/down only, with use_rslora.
llama.cpp's own `convert_lora_to_gguf.py --base tests/data/hf/<family> --outtype f32` turns
each `-a` folder into `<family>-a.gguf`. The tests compute transformers+peft's outputs
themselves; these files only fix the weights. `recorder.json` says what made them.

    python tests/tools/record_lora_fixtures.py --llama-cpp /path/to/llama.cpp
"""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

OUT = Path("tests/data/lora")
BASES = Path("tests/data/hf")
SEED = 4321
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (base family, rank, alpha, targets, use_rslora)
ADAPTERS = {
    "llama-a": ("llama", 8, 16, ALL, False),
    "llama-b": ("llama", 4, 8, ["q_proj", "v_proj", "down_proj"], True),
    "qwen3-a": ("qwen3", 8, 16, ALL, False),
}
CONVERTED = ("llama-a", "qwen3-a")

BOOTSTRAP = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root + "/gguf-py", root]
sys.argv = [root + "/convert_lora_to_gguf.py", *sys.argv[2:]]
runpy.run_path(root + "/convert_lora_to_gguf.py", run_name="__main__")
"""


def save_adapter(name: str) -> Path:
    import peft
    import torch
    import transformers

    family, r, alpha, targets, rslora = ADAPTERS[name]
    base = transformers.AutoModelForCausalLM.from_pretrained(BASES / family, dtype=torch.float32)
    torch.manual_seed(SEED + sum(map(ord, name)))
    cfg = peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
        init_lora_weights=False, lora_dropout=0.0, task_type="CAUSAL_LM",
    )  # fmt: skip
    model = peft.get_peft_model(base, cfg)
    folder = OUT / name
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder)
    (folder / "README.md").unlink(missing_ok=True)  # PEFT's model-card template
    return folder


def convert(llama_cpp: Path, name: str) -> None:
    family = ADAPTERS[name][0]
    cmd = [sys.executable, "-c", BOOTSTRAP, str(llama_cpp), str(OUT / name),
           "--base", str(BASES / family), "--outtype", "f32",
           "--outfile", str(OUT / f"{name}.gguf")]  # fmt: skip
    subprocess.run(cmd, check=True)


def main() -> None:
    import peft
    import torch
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp checkout")
    ap.add_argument("--llama-cpp-commit", help="its commit")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    for name in ADAPTERS:
        save_adapter(name)
    for name in CONVERTED:
        convert(args.llama_cpp, name)
    record = {
        "adapters": {
            k: dict(zip(("base", "r", "alpha", "targets", "use_rslora"), v, strict=True))
            for k, v in ADAPTERS.items()
        },
        "seed": SEED,
        "peft": peft.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "llama_cpp_commit": args.llama_cpp_commit,
        "converter": "convert_lora_to_gguf.py --base tests/data/hf/<family> --outtype f32",
    }
    (OUT / "recorder.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
