"""Layers that model files compose: keep-quant linears, embeddings, norms, attention and MLP,
rotary embeddings and pooling."""
