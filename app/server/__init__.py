"""The OpenAI-compatible HTTP server (`localllm serve`): app factory, endpoints, protocol models."""
