"""The paged KV cache: per-layer block tensors in a storage dtype, written by slot, read by table.

Each layer holds K and V as [num_blocks, block_size, kv_heads, head_dim] (plus scales for the 8-bit
formats, see `localllm.kernels.attention.kv_quant`). Which blocks belong to which sequence is the
caller's business (`BatchMeta.block_tables`); this class only stores and attends. The runner sizes
`num_blocks` from a memory budget with `bytes_per_block`.
"""

from typing import TYPE_CHECKING

import torch

from localllm.engine.core.batch import BatchMeta
from localllm.kernels.attention import (
    KV_DTYPES,
    DecodePlan,
    context_attention,
    encode_kv,
    paged_attention,
    plan_decode,
    quantized_output,
    scale_shape,
    serves_every_row,
    vector_nbytes,
    write_paged,
)

if TYPE_CHECKING:
    from localllm.kernels.quant.triton_packed import QuantizedX


class PagedKVCache:
    """K/V blocks of every layer; dtype is one of "f32", "f16", "bf16", "q8_0", "fp8"."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str = "f16",
        device: torch.device | str = "cpu",
        v_head_dim: int | None = None,
    ):
        vd = v_head_dim or head_dim
        self.device = torch.device(device)
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        store = KV_DTYPES.get(dtype)
        if store is None:
            raise ValueError(f"unknown KV dtype {dtype!r}: expected one of {sorted(KV_DTYPES)}")
        lead = (num_blocks, block_size, num_kv_heads)

        def alloc(d: int) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
            # empty, not zeros: attention reads only written slots, and untouched pages of a big
            # pool then cost no memory until used.
            vals = [torch.empty(*lead, d, dtype=store, device=device) for _ in range(num_layers)]
            sc = scale_shape(dtype, d)
            if sc is None:
                return vals, None
            shape, sdt = sc
            return vals, [torch.empty(*lead, *shape, dtype=sdt, device=device) for _ in vals]

        self.k, self.k_scales = alloc(head_dim)
        self.v, self.v_scales = alloc(vd)
        # hybrid models' per-sequence conv/SSM state (`engine.runtime.recurrent_state`), or None
        self.states = None

    @staticmethod
    def bytes_per_block(
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str,
        v_head_dim: int | None = None,
    ) -> int:
        """Bytes one block takes over all layers (K and V, scales included)."""
        per_token = vector_nbytes(dtype, head_dim) + vector_nbytes(dtype, v_head_dim or head_dim)
        return num_layers * block_size * num_kv_heads * per_token

    @property
    def nbytes(self) -> int:
        tensors = [*self.k, *self.v, *(self.k_scales or ()), *(self.v_scales or ())]
        return sum(t.numel() * t.element_size() for t in tensors)

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store k/v [T, KV, D] of the new tokens at their slots (block * block_size + offset)."""
        kq, ks = encode_kv(k, self.dtype)
        vq, vs = encode_kv(v, self.dtype)
        write_paged(self.k[layer], kq, slot_mapping)
        write_paged(self.v[layer], vq, slot_mapping)
        if ks is not None:
            write_paged(self.k_scales[layer], ks, slot_mapping)
            write_paged(self.v_scales[layer], vs, slot_mapping)

    def plain_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k, v) block tensors of `layer` when they store plain floats (no scales), for kernels
        that write the cache themselves; None for the 8-bit formats."""
        return None if self.k_scales is not None else (self.k[layer], self.v[layer])

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        batch: BatchMeta,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        spans=None,
    ) -> torch.Tensor:
        """Causal GQA attention of q [T, H, D] (the last tokens of each sequence) -> [T, H, Dv];
        `sinks` [H]: per-head attention-sink logits (gpt-oss); `spans`: per sequence, position
        ranges seen both ways (`paged_attention`)."""
        return self.attend_q(layer, q, batch, scale, window, softcap, sinks, False, spans)[0]

    def attend_q(
        self,
        layer: int,
        q: torch.Tensor,
        batch: BatchMeta,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        quant: bool = True,
        spans=None,
        shrink=None,
    ) -> tuple[torch.Tensor, "QuantizedX | None"]:
        """(`attend`, its rows quantized for the dp4a GEMV that reads them next or None): the
        flash-decoding kernel writes them where it serves every row (`quantized_output`), and
        `shrink` (the output projection's LoRA shrink, `lora_delta.LoraShrink`) there too; where
        it does not, the shrink's torch form runs on the output."""
        if batch.block_size != self.block_size:
            raise ValueError(f"batch block size {batch.block_size} != cache {self.block_size}")
        k, v = self.k[layer], self.v[layer]
        ks = self.k_scales[layer] if self.k_scales else None
        vs = self.v_scales[layer] if self.v_scales else None
        if batch.context is not None:  # the table and lengths on the device (a prompt graph)
            if spans:
                raise ValueError("a prompt graph step cannot carry bidirectional spans")
            table, ctx = batch.context
            o = context_attention(q, k, v, table, ctx, scale, window, softcap, ks, vs, sinks)
            if shrink is not None:
                shrink.reference(o.reshape(o.shape[0], -1))
            return o, None
        plan = self._decode_plan(batch, window)
        xq = quantized_output(q, k, v, plan, ks, sinks) if quant and plan is not None else None
        inner = shrink if shrink is not None and serves_every_row(q, k, plan, ks, sinks) else None
        o = paged_attention(
            q,
            k,
            v,
            batch.query_start,
            batch.seq_lens,
            batch.block_tables,
            scale,
            window,
            softcap,
            ks,
            vs,
            decode=plan,
            sinks=sinks,
            quant=xq,
            spans=spans,
            prompt=batch.prompt or None,
            shrink=inner,
        )
        if shrink is not None and inner is None:
            shrink.reference(o.reshape(o.shape[0], -1))
        return o, xq

    def _decode_plan(self, batch: BatchMeta, window: int | None):
        key = ("decode", window)
        if key not in batch.plans:
            plan = plan_decode(
                batch.query_start, batch.seq_lens, batch.block_tables, batch.block_size, window
            )
            if plan is not None and self.device.type != "cpu":
                # built once per step on the host, moved once: every layer reuses it
                plan = DecodePlan(
                    plan.rows.to(self.device),
                    plan.slots.to(self.device),
                    None if plan.pad is None else plan.pad.to(self.device),
                )
            batch.plans[key] = plan
        return batch.plans[key]
