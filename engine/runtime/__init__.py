"""The device side of a step: the model runner, the paged KV tensors, CUDA graphs for decode
and prompts, host breaks inside a graph, and the decode step launched one ahead."""
