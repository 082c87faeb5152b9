"""Recurrent layers' kernels: the gated delta rule (`delta_rule`) and the causal short conv
(`causal_conv`), each a plain-torch reference with its decode step and prefill forms."""
