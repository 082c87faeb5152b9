"""Mixture-of-experts: the MoE block, the routed-expert tensors, residency (planning and loading
experts on device, host or disk) and the split of host experts between the CPU and the GPU."""
