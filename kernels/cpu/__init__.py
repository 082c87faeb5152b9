"""CPU kernels compiled from C at first use (`native`); the torch paths stay the fallback."""
