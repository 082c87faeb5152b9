"""MoE math: expert routing and grouped expert matmul (torch reference + fast paths)."""
