"""One routed-expert tensor of a MoE layer as the loader fills it (`ffn_{gate,up,down}_exps`): the
file's raw blocks, where they belong, and whether the disk tier streams them instead."""

import torch
from torch import nn

from localllm.engine.layers.linear import dense
from localllm.offload import ByteRange, QuantWeight

EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


class ExpertTensor(nn.Module):
    """One `ffn_*_exps` tensor: [n_expert, rows, cols] raw ggml blocks, one slice per expert."""

    def __init__(self, n_expert: int, rows: int, cols: int):
        super().__init__()
        self.shape = (n_expert, rows, cols)
        self.weight: QuantWeight | None = None
        self.bias: torch.Tensor | None = None  # [n_expert, rows] float32 (gpt-oss), always held
        self.streamed = False  # disk tier: the blocks are not held, a streamer reads them
        # the GPU the experts belong on: the loader leaves their blocks on the host, and the
        # block's `fuse` packs them there (None: they stay where they were loaded)
        self.home: torch.device | None = None

    def load_tensor(self, suffix: str, w: QuantWeight) -> None:
        if suffix == "bias" and tuple(w.shape) == self.shape[:2]:
            self.bias = dense(w)
            return
        if suffix != "weight" or tuple(w.shape) != self.shape:
            raise ValueError(f"expected expert weight {self.shape}, got {tuple(w.shape)}")
        self.weight = w

    @property
    def loaded(self) -> bool:
        return self.weight is not None or self.streamed

    def layout(self) -> tuple[ByteRange, tuple[int, int]]:
        """Where the whole tensor is in the file and one expert's uint8 shape [rows, rb]."""
        w = self.weight
        if w.source is None or w.source.nbytes != w.nbytes:
            raise ValueError("expert streaming needs weights that come straight from a file")
        return w.source, (w.data.shape[1], w.data.shape[2])

    def release(self) -> None:
        """Stop holding the blocks (the disk tier reads them on demand)."""
        self.weight, self.streamed = None, True
