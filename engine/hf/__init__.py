"""Hugging Face model folders (`save_pretrained`: config.json + safetensors shards) read as the
engine reads a GGUF: `open_hf(folder)` gives GGUF metadata and GGUF-named tensors, mapped by
each family's `engine/models/<family>_hf.py` (see `families.HF_FAMILIES`)."""

from localllm.engine.hf.checkpoint import HFCheckpoint, HFError, is_hf_folder, open_hf

__all__ = ["HFCheckpoint", "HFError", "is_hf_folder", "open_hf"]
