"""Model families, one file per GGUF `general.architecture`, each exporting ModelArgs and Model.

`model_module(arch)` finds the file by name; the alias table maps architectures that share a file.
"""

import importlib
from types import ModuleType

# Architectures served by another family's file (same tensor layout and math).
ALIASES = {"mistral": "llama", "smollm": "llama", "nomic-bert": "bert", "gpt-oss": "gpt_oss"}
SUPPORTED = (
    "llama",
    "gemma3",
    "qwen2",
    "qwen2vl",
    "qwen3",
    "qwen3vl",
    "qwen3vlmoe",
    "qwen3moe",
    "phi3",
    "bert",
    "deepseek2",
    "gpt_oss",
    "smollm3",
    "olmo2",
    "gemma2",
    "glm4moe",
    "qwen3next",
    "lfm2",
    "lfm2moe",
    "granitehybrid",
)


class UnsupportedArchitectureError(ValueError):
    """The GGUF names an architecture no model file implements."""


def model_module(arch: str) -> ModuleType:
    name = ALIASES.get(arch, arch)
    if name not in SUPPORTED:
        known = ", ".join(sorted((*SUPPORTED, *ALIASES)))
        raise UnsupportedArchitectureError(
            f"unsupported model architecture '{arch}' (supported: {known})"
        )
    return importlib.import_module(f"{__name__}.{name}")
