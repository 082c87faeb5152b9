"""Text generation: GGUF reading, tokenizer and chat template, model families, sampling."""
