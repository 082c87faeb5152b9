"""Choosing tokens: sampling controls and the sampler (host and device), stop strings,
structured output through llguidance, n-gram draft proposals."""
