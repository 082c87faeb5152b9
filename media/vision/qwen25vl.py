"""The `qwen2.5vl_merger` mmproj projector: Qwen2.5-VL's vision transformer and patch merger.

Input is the processor's flat patches [N, 3 * 2 * p * p] (two frames per temporal patch, patches
in merge-block order) with their grid (t, h, w). The patch embedding is a 3-D conv that
llama.cpp's converter splits into one 2-D kernel per frame (`v.patch_embd.weight` and
`v.patch_embd.weight.1`), no bias. Each block: RMSNorm (`ln1`) -> attention with 2-D rope (half
the rotary frequencies turned by the patch's row, half by its column, NEOX halves) -> residual;
RMSNorm (`ln2`) -> SiLU-gated MLP with biases -> residual. Attention is windowed (a window is
`window_size` pixels of merged units, default 112, llama.cpp's `clip.vision.window_size`) except
in every `n_wa_pattern`-th block, which sees the whole frame (transformers'
`fullatt_block_indexes`); no attention crosses temporal patches. Each frame or window is one
row of a batched SDPA call (`Groups`), never a masked N x N. The merger normalizes
(`v.post_ln`, RMSNorm), concatenates each merge block of 2x2 patches and projects it by
`mm.0` -> GELU -> `mm.2` to the text width: one embedding per merged unit, in the prompt's order.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from localllm.engine.layers.linear import QuantLinear, dense
from localllm.engine.layers.shared import RMSNorm
from localllm.media.vision.idefics3 import _triple
from localllm.media.vision.siglip import MAX_BLOCKS, MAX_DIM, VisionConfigError, _int, residual
from localllm.offload import QuantWeight

ROPE_BASE = 10000.0  # the tower's 2-D rope (transformers' Qwen2_5_VisionRotaryEmbedding)
MERGE = 2  # spatial merge: 2x2 patches make one embedding (llama.cpp fixes it too)
TEMPORAL = 2  # frames per temporal patch
DEFAULT_WINDOW = 112  # pixels, when the file does not say (every released Qwen2.5-VL)


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    patch_size: int
    norm_eps: float
    out_dim: int  # the text model's embedding width
    wa_pattern: int  # every wa_pattern-th block attends to the whole frame
    window: int  # attention window side, in pixels
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @property
    def merge(self) -> int:
        return MERGE

    @classmethod
    def from_gguf(cls, meta: dict[str, Any]) -> "ModelArgs":
        args = cls(
            dim=_int(meta, "clip.vision.embedding_length", MAX_DIM),
            hidden_dim=_int(meta, "clip.vision.feed_forward_length", 4 * MAX_DIM),
            n_layers=_int(meta, "clip.vision.block_count", MAX_BLOCKS),
            n_heads=_int(meta, "clip.vision.attention.head_count", MAX_DIM),
            patch_size=_int(meta, "clip.vision.patch_size", 1024),
            norm_eps=float(meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
            out_dim=_int(meta, "clip.vision.projection_dim", MAX_DIM),
            wa_pattern=_int(meta, "clip.vision.n_wa_pattern", MAX_BLOCKS),
            window=int(meta.get("clip.vision.window_size", DEFAULT_WINDOW)),
            image_mean=_triple(meta, "clip.vision.image_mean"),
            image_std=_triple(meta, "clip.vision.image_std"),
        )
        if args.dim % args.n_heads or (args.dim // args.n_heads) % 4:
            raise VisionConfigError(
                f"clip.vision.attention.head_count {args.n_heads} does not split embedding_length "
                f"{args.dim} into heads whose size 2-D rope can halve twice"
            )
        if not 0 < args.norm_eps < 1:
            raise VisionConfigError(f"layer_norm_epsilon {args.norm_eps} is out of range")
        if args.window < args.patch_size * MERGE or args.window % (args.patch_size * MERGE):
            raise VisionConfigError(
                f"clip.vision.window_size {args.window} is not a whole number of merged patches"
            )
        return args


class PatchEmbedding(nn.Module):
    """`v.patch_embd`: frame 0's kernel [dim, 3, p, p]; `.weight.1` (a child, so the loader's
    name walk finds it) holds frame 1's."""

    def __init__(self, dim: int, patch: int):
        super().__init__()
        self.shape = (dim, 3, patch, patch)
        self.first: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None  # Qwen3-VL's conv has one
        self.weight = SecondFrame(self.shape)

    def load_tensor(self, suffix: str, w: QuantWeight) -> None:
        if suffix == "bias" and tuple(w.shape) == self.shape[:1]:
            self.bias = dense(w)
            return
        if suffix != "weight" or tuple(w.shape) != self.shape:
            raise ValueError(f"expected patch_embd.weight of {self.shape}, got {tuple(w.shape)}")
        self.first = dense(w)

    @property
    def loaded(self) -> bool:
        return self.first is not None

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[N, 3 * 2 * p * p] -> [N, dim]: the 3-D conv as one matmul over both frames."""
        d, c, p, _ = self.shape
        w = torch.stack((self.first, self.weight.value), 2).reshape(d, c * TEMPORAL * p * p)
        x = patches.to(w.dtype) @ w.T
        return x + self.bias if self.bias is not None else x


class SecondFrame(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.shape = shape
        self.value: torch.Tensor | None = None

    def load_tensor(self, suffix: str, w: QuantWeight) -> None:
        if suffix != "1" or tuple(w.shape) != self.shape:
            raise ValueError(f"expected patch_embd.weight.1 of {self.shape}, got {tuple(w.shape)}")
        self.value = dense(w)

    @property
    def loaded(self) -> bool:
        return self.value is not None


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads = a.n_heads
        self.ln1 = RMSNorm(a.dim, a.norm_eps)
        self.attn_q = QuantLinear(a.dim, a.dim)
        self.attn_k = QuantLinear(a.dim, a.dim)
        self.attn_v = QuantLinear(a.dim, a.dim)
        self.attn_out = QuantLinear(a.dim, a.dim)
        self.ln2 = RMSNorm(a.dim, a.norm_eps)
        self.ffn_gate = QuantLinear(a.dim, a.hidden_dim)
        self.ffn_up = QuantLinear(a.dim, a.hidden_dim)
        self.ffn_down = QuantLinear(a.hidden_dim, a.dim)

    def forward(self, x, cos, sin, groups: "Groups") -> torch.Tensor:
        n, d = x.shape
        h = self.ln1(x)

        def heads(y):
            return y.view(n, self.n_heads, d // self.n_heads).transpose(0, 1)

        q, k, v = heads(self.attn_q(h)), heads(self.attn_k(h)), heads(self.attn_v(h))
        q, k = _rope(q, cos, sin).to(v.dtype), _rope(k, cos, sin).to(v.dtype)
        o = groups.attend(q, k, v)
        x = residual(x, self.attn_out(o.transpose(0, 1).reshape(n, d)))
        h = self.ln2(x)
        return residual(x, self.ffn_down(F.silu(self.ffn_gate(h)) * self.ffn_up(h)))


class Projector(nn.Module):
    """`mm.0` -> GELU -> `mm.2`, over merge blocks of normalized patches."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        wide = a.dim * MERGE * MERGE
        self.add_module("0", QuantLinear(wide, wide))
        self.add_module("2", QuantLinear(wide, a.out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, "2")(F.gelu(getattr(self, "0")(x)))


class Tower(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.patch_embd = PatchEmbedding(a.dim, a.patch_size)
        self.blk = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.post_ln = RMSNorm(a.dim, a.norm_eps)


class Model(nn.Module):
    takes_grid = True  # forward needs the (t, h, w) patch grid beside the pixels

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.v = Tower(args)
        self.mm = Projector(args)
        self.inv_freq = rope_2d_freqs(args.dim, args.n_heads)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """Patches [t*h*w, 3*2*p*p] of one image or video -> embeddings [t*h*w / 4, out_dim]."""
        a = self.args
        t, h, w = grid
        dev = patches.device
        grid_of = _patch_grid(t, h, w, a.window // a.patch_size // MERGE)
        hpos, wpos, frame, window = (g.to(dev) for g in grid_of)
        cos, sin = rope_2d(self.inv_freq, hpos, wpos)
        full, local = Groups.of(frame), Groups.of(window)
        x = self.v.patch_embd(patches)
        for i, blk in enumerate(self.v.blk):
            x = blk(x, cos, sin, full if (i + 1) % a.wa_pattern == 0 else local)
        x = self.v.post_ln(x).reshape(-1, a.dim * MERGE * MERGE)
        return self.mm(x)


@dataclass(frozen=True, slots=True)
class Groups:
    """Patches that attend only among themselves (a frame, a window), gathered into a batch:
    `index` [G, L] patch ids per group, padded with patch 0 where `valid` [G, L] is False
    (None: every group full). One SDPA call over [G, heads, L, hd] instead of a masked N x N."""

    index: torch.Tensor
    valid: torch.Tensor | None

    @staticmethod
    def of(group: torch.Tensor) -> "Groups":
        """Groups of the patches with equal `group` ids [N]."""
        order = torch.argsort(group, stable=True)
        counts = torch.bincount(group)
        counts = counts[counts > 0]
        longest = int(counts.max())
        if int(counts.min()) == longest:
            return Groups(order.view(len(counts), longest), None)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(longest, device=group.device)
        valid = slot[None, :] < counts[:, None]
        index = torch.where(valid, order[(starts[:, None] + slot).clamp(max=len(order) - 1)], 0)
        return Groups(index, valid)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of q, k, v [heads, N, hd] within each group -> [heads, N, hd]."""
        g, length = self.index.shape
        idx = self.index.reshape(-1)

        def gather(t):
            return t[:, idx].view(t.shape[0], g, length, -1).transpose(0, 1)

        mask = None if self.valid is None else self.valid[:, None, None, :]
        o = F.scaled_dot_product_attention(gather(q), gather(k), gather(v), attn_mask=mask)
        o = o.transpose(0, 1).reshape(q.shape[0], g * length, -1)  # [heads, G*L, hd]
        out = torch.empty_like(q)
        if self.valid is None:
            out[:, idx] = o
        else:
            keep = self.valid.reshape(-1)
            out[:, idx[keep]] = o[:, keep]
        return out


def rope_2d_freqs(dim: int, n_heads: int) -> torch.Tensor:
    """The 2-D rope's inverse frequencies: half the head rotates by the patch row, half by its
    column (transformers' VisionRotaryEmbedding over head_dim / 2)."""
    q = dim // n_heads // 2
    return 1.0 / ROPE_BASE ** (torch.arange(0, q, 2, dtype=torch.float32) / q)


def rope_2d(inv: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor):
    """(cos, sin) [N, hd/2] of patches at (rows, cols)."""
    inv = inv.to(rows.device)  # (the loader moves it with the weights)
    angles = torch.cat((rows[:, None].float() * inv, cols[:, None].float() * inv), 1)
    return angles.cos(), angles.sin()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NEOX rotation of x [heads, N, hd] by angles [N, hd/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


def _patch_grid(t: int, h: int, w: int, win: int):
    """Per patch in the processor's order (frame, merged row, merged col, 2x2 in the block):
    its row, column, frame, and attention window id (`win` merged units a side)."""
    f, mh, mw, dh, dw = torch.meshgrid(
        torch.arange(t), torch.arange(h // MERGE), torch.arange(w // MERGE),
        torch.arange(MERGE), torch.arange(MERGE), indexing="ij",
    )  # fmt: skip
    nwh, nww = -(-h // MERGE // win), -(-w // MERGE // win)
    window = (f * nwh + mh // win) * nww + mw // win
    return (
        (mh * MERGE + dh).flatten(),
        (mw * MERGE + dw).flatten(),
        f.flatten(),
        window.flatten(),
    )
