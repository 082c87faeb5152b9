"""LoRA adapters applied unmerged beside the quantized base (PEFT folders, llama.cpp GGUFs)."""

from localllm.engine.lora.adapter import LoraAdapter, LoraError, LoraSpec, load_adapter
from localllm.engine.lora.attach import LoraSet, attach_adapters

__all__ = ["LoraAdapter", "LoraError", "LoraSet", "LoraSpec", "attach_adapters", "load_adapter"]
