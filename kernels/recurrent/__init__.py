"""Recurrent layers' kernels, each a plain-torch reference with its decode step and prefill forms:
the gated delta rule (`delta_rule`; Qwen3-Next), the causal short conv (`causal_conv`), the
Mamba-2 scan (`ssd`); decode steps on the state slots (`decode`) and their triton kernels on CUDA
(`triton_recurrent`, `triton_step`)."""
