"""Models on disk: the Hugging Face cache and user folders, resolving and downloading GGUF repos."""
