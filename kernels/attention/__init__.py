"""Attention over a paged KV cache: plain-torch reference ops (triton variants plug in on GPU)."""
