"""GGUF container reading: metadata and tensors over an mmap, split files, clear errors."""
