"""GGUF container reading: metadata and tensors over an mmap, split files, clear errors."""

from localllm.engine.gguf.errors import GGUFError
from localllm.engine.gguf.model import GGUFModel, TensorInfo, open_gguf

__all__ = ["GGUFError", "GGUFModel", "TensorInfo", "open_gguf"]
