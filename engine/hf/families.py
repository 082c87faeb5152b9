"""Which family module maps a Hugging Face architecture (`config.json` `architectures[0]`).

Each entry names a sibling of the family's model file, `engine/models/<family>_hf.py`, that
holds what llama.cpp's converter knows about it: `metadata(cfg)` (config.json -> the GGUF keys
its `ModelArgs.from_gguf` reads) and `adapt(plan, cfg, n_vocab)` (tensor changes). A new family
adds its line here and its module there; shared code never branches on the architecture.
"""

import importlib
from types import ModuleType

HF_FAMILIES = {
    "LlamaForCausalLM": "llama_hf",
    "MistralForCausalLM": "llama_hf",
    "Qwen2ForCausalLM": "qwen2_hf",
    "Qwen3ForCausalLM": "qwen3_hf",
    "Qwen3MoeForCausalLM": "qwen3moe_hf",
    "Gemma3ForCausalLM": "gemma3_hf",
    "Gemma3ForConditionalGeneration": "gemma3_hf",  # its text model; images need an mmproj
    "Phi3ForCausalLM": "phi3_hf",
    "Gemma2ForCausalLM": "gemma2_hf",
    "Olmo2ForCausalLM": "olmo2_hf",
    "SmolLM3ForCausalLM": "smollm3_hf",
    "Glm4MoeForCausalLM": "glm4moe_hf",
}


class UnsupportedHFArchitectureError(ValueError):
    """config.json names an architecture no family maps."""


def family_module(architecture: str) -> ModuleType:
    name = HF_FAMILIES.get(architecture)
    if name is None:
        known = ", ".join(sorted(HF_FAMILIES))
        raise UnsupportedHFArchitectureError(
            f"unsupported architecture {architecture!r} in config.json (supported: {known})"
        )
    return importlib.import_module(f"localllm.engine.models.{name}")
