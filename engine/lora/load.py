"""`load_adapter`: a PEFT folder (`peft.py`) or a llama.cpp LoRA GGUF (`gguf_file.py`) into a
`LoraAdapter` for the opened base weights."""

import os
from pathlib import Path

from localllm.engine.lora.adapter import LoraAdapter, LoraError, LoraSpec
from localllm.engine.lora.gguf_file import read_gguf_lora
from localllm.engine.lora.peft import read_peft


def load_adapter(spec: LoraSpec, base) -> LoraAdapter:
    """Read `spec.path` for the opened base weights `base` (a GGUFModel or HFCheckpoint)."""
    path = Path(spec.path)
    name = spec.name or (path.stem if path.suffix == ".gguf" else path.name)
    if not path.exists():
        raise LoraError(f"{spec.path}: no such LoRA adapter file or folder")
    if path.is_dir():
        pairs, scalings = read_peft(path, base)
        return LoraAdapter(name, os.fspath(path), pairs, scalings, base.architecture)
    pairs, scalings = read_gguf_lora(path, base)
    return LoraAdapter(name, os.fspath(path), pairs, scalings, base.architecture)
