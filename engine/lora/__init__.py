"""LoRA adapters applied unmerged beside the quantized base (PEFT folders, llama.cpp GGUFs)."""

from localllm.engine.lora.adapter import LoraAdapter, LoraError, LoraSpec
from localllm.engine.lora.attach import LoraSet, attach_adapters
from localllm.engine.lora.load import load_adapter

__all__ = ["LoraAdapter", "LoraError", "LoraSet", "LoraSpec", "attach_adapters", "load_adapter"]
