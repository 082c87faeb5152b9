"""How a model's layers look to the native decode step (`decode_step.c`): the decoder's sizes
(`Shape`), each layer's tensors (`LayerSpec`: the linears' `NativeLinear`s, norms, caches,
recurrent states, experts) and the checks that they have the layouts the C reads (`check_*`: a
ValueError names the first that does not, and the torch layers run instead)."""

from dataclasses import dataclass

import torch

ACTS = {"silu": 0, "gelu": 1}
EXP_ACTS = {"silu": 0, "swiglu_oai": 1}  # routed experts' activations (decode_moe.h's exp_act)
SCORINGS = {"softmax": 0, "sigmoid": 1}  # routers' scores (decode_moe.h's scoring)
MAX_GROUPS = 3  # MAX_GROUPS in the C: runs of one ggml type in q|k|v or gate|up
MAX_GROUP_HEADS = 16  # MAX_GROUP in the C: query heads attended together over one KV head


@dataclass(frozen=True)
class Shape:
    """The decoder's sizes: heads, head dim, rotated dims (adjacent pairs unless `neox`)."""

    dim: int
    n_q: int
    n_kv: int
    head_dim: int
    hidden: int
    rope_dims: int
    neox: bool
    eps: float
    act: str = "silu"
    scale: float | None = None  # attention's score scale (None: head_dim ** -0.5)
    residual_scale: float = 1.0  # each block output's factor into the stream (Granite's)
    softcap: float = 0.0  # attention scores capped to cap * tanh(s / cap) (Gemma 2's; 0: none)


@dataclass(frozen=True)
class LayerSpec:
    """One layer: its linears' `NativeLinear`s (q|k|v and gate|up as runs of one type, in
    order), its norm weights (float32, contiguous) and its K and V cache tensors. A short-conv
    layer (LFM2's: `conv_w` set) has no caches: `qkv` is its in_proj (B | C | x), `o` its
    out_proj, `conv_w` [dim, taps] and `conv_state` [slots + 1, taps - 1, dim] float32."""

    qkv: list
    o: object
    gate_up: list
    down: object
    attn_norm: torch.Tensor | None
    ffn_norm: torch.Tensor | None
    k_cache: torch.Tensor | None
    v_cache: torch.Tensor | None
    # Gemma 3: per-head q / k norms [head_dim], output norms [dim], a sliding window (0: none),
    # the rope table (0 or 1: `DecodeStep.__call__`'s first or second cos / sin)
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None
    window: int = 0
    rope_set: int = 0
    qkv_bias: torch.Tensor | None = None  # Qwen2: q | k | v biases [(n_q + 2 n_kv) head_dim]
    conv_w: torch.Tensor | None = None
    conv_state: torch.Tensor | None = None
    # Qwen3-MoE (`gate_up` and `down` unused): router [n_expert, dim] float32, the experts' raw
    # blocks gate / up [n_expert, ff, row bytes] and down [n_expert, dim, row bytes] (uint8,
    # contiguous), their ggml types, k experts a token, renormalised top-k weights
    router: torch.Tensor | None = None
    experts: tuple | None = None
    exp_types: tuple = ()
    n_used: int = 0
    norm_topk: bool = True
    # gpt-oss: the attention output's bias [dim], per-head sink logits [n_q], the router's bias
    # [n_expert], the experts' (gate [n_expert, ff], up [n_expert, ff], down [n_expert, dim])
    # biases, all float32 contiguous; the experts' activation (EXP_ACTS)
    o_bias: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    router_bias: torch.Tensor | None = None
    exp_bias: tuple | None = None
    exp_act: str = "silu"
    # a dense layer's MLP width where narrower than Shape.hidden (0: that); DeepSeek-style
    # routing (SCORINGS; `probs_bias` [n_expert] shifts only the choice; the weights times
    # `w_scale`); shared experts: gate|up runs and down of a SiLU MLP added to the routed sum
    hidden: int = 0
    scoring: str = "softmax"
    probs_bias: torch.Tensor | None = None
    w_scale: float = 1.0
    shared_gu: tuple = ()
    shared_down: object = None
    # Granite-4.0-H's Mamba-2 layers (`ssm_state` set): `qkv` is the in-projection (z | x B C |
    # dt), `o` the out-projection, `conv_w` [Cc, taps] / `conv_state` [slots + 1, taps - 1, Cc]
    # the conv's over x B C (Cc = H P + 2 G N) and `conv_b` its bias [Cc] (or None); dt's bias,
    # A and D [H], the gated norm's weight [H P], the SSM state [slots + 1, H, P, N] float32;
    # ssm_dims (H, P, N, G)
    conv_b: torch.Tensor | None = None
    ssm_dt_bias: torch.Tensor | None = None
    ssm_a: torch.Tensor | None = None
    ssm_d: torch.Tensor | None = None
    ssm_norm: torch.Tensor | None = None
    ssm_state: torch.Tensor | None = None
    ssm_dims: tuple = ()
    # OLMo 2: q_norm / k_norm over all of q's / k's heads ([n_q head_dim] / [n_kv head_dim]);
    # attn_norm / ffn_norm may be None there (no input norms: the stream itself)
    qk_norm_full: bool = False
    # Qwen3-Next: each head's query and output gate side by side in the q projection (`q_gate`);
    # the shared expert's output times sigmoid(shared_gate . h) (shared_gate [dim] float32);
    # Gated DeltaNet layers (`delta_dims` (Hk, Hv, Dk, Dv) set): `qkv` is the in-projections
    # (q k v | z | b a), `o` the out-projection, `conv_w` [Cc, taps] / `conv_state` the conv's
    # over q k v (Cc = 2 Hk Dk + Hv Dv), `ssm_dt_bias` and `ssm_a` [Hv], `ssm_norm` [Dv],
    # `ssm_state` [slots + 1, Hv, Dk, Dv] float32
    q_gate: bool = False
    shared_gate: torch.Tensor | None = None
    delta_dims: tuple = ()
    delta_grouped: bool = False  # q k v z grouped per key head (an older file's one `ssm_in`)


def check_conv(lay: LayerSpec, dim: int) -> None:
    """A short-conv layer's tensors as the C reads them, or a ValueError."""
    w, st = lay.conv_w, lay.conv_state
    ok = w.dtype == torch.float32 and w.is_contiguous() and w.dim() == 2 and w.shape[0] == dim
    taps = w.shape[1] if w.dim() == 2 else 0
    if not ok or taps < 2:
        raise ValueError(f"conv taps of {w.dtype} {tuple(w.shape)}: float32 ({dim}, taps >= 2)")
    if st is None or st.dtype != torch.float32 or not st.is_contiguous() or st.dim() != 3 or \
            tuple(st.shape[1:]) != (taps - 1, dim):  # fmt: skip
        raise ValueError(f"conv state of {None if st is None else tuple(st.shape)}: float32 "
                         f"(slots, {taps - 1}, {dim})")  # fmt: skip
    if len(lay.qkv) != 1 or lay.qkv[0].shape[0] != 3 * dim or lay.o.shape[0] != dim:
        raise ValueError("a short-conv layer's in_proj must be one run of 3 x dim outputs")


def check_mamba(lay: LayerSpec, dim: int) -> None:
    """A Mamba-2 layer's tensors as recurrent_rows.h's mamba2_rows reads them, or a ValueError."""
    if len(lay.ssm_dims) != 4 or min(lay.ssm_dims) < 1:
        raise ValueError(f"Mamba-2 dims {lay.ssm_dims}: (heads, head size, state, groups)")
    h, p, n, g = lay.ssm_dims
    cc = h * p + 2 * g * n
    taps = lay.conv_w.shape[-1] if lay.conv_w is not None else 0
    want = {"conv_w": (cc, taps), "conv_state": (lay.ssm_state.shape[0], taps - 1, cc),
            "conv_b": (cc,), "ssm_dt_bias": (h,), "ssm_a": (h,), "ssm_d": (h,),
            "ssm_norm": (h * p,), "ssm_state": (lay.ssm_state.shape[0], h, p, n)}  # fmt: skip
    _check_f32(lay, want, "Mamba-2", optional=("conv_b",))
    if h % g or taps < 2:
        raise ValueError(f"Mamba-2: {g} groups of {h} heads, {taps} conv taps")
    if len(lay.qkv) != 1 or lay.qkv[0].shape[0] != 2 * h * p + 2 * g * n + h or \
            tuple(lay.o.shape) != (dim, h * p):  # fmt: skip
        raise ValueError("a Mamba-2 layer's in-projection must be one run of z | x B C | dt")


def _check_f32(lay: LayerSpec, want: dict, label: str, optional: tuple = ()) -> None:
    """Each tensor `want` names float32, contiguous and of its shape (or None where optional)."""
    for name, shape in want.items():
        w = getattr(lay, name)
        if w is None and name in optional:
            continue
        if w is None or w.dtype != torch.float32 or not w.is_contiguous() or \
                tuple(w.shape) != shape:  # fmt: skip
            got = None if w is None else (w.dtype, tuple(w.shape))
            raise ValueError(f"{label} {name} of {got}: float32 {shape}")


def check_delta(lay: LayerSpec, dim: int) -> None:
    """A Gated DeltaNet layer's tensors as recurrent_rows.h's delta_rows reads them, or a
    ValueError."""
    if len(lay.delta_dims) != 4 or min(lay.delta_dims) < 1:
        raise ValueError(f"DeltaNet dims {lay.delta_dims}: (key heads, value heads, Dk, Dv)")
    hk, hv, dk, dv = lay.delta_dims
    cc, slots = 2 * hk * dk + hv * dv, lay.ssm_state.shape[0] if lay.ssm_state is not None else 0
    taps = lay.conv_w.shape[-1] if lay.conv_w is not None else 0
    want = {"conv_w": (cc, taps), "conv_state": (slots, taps - 1, cc), "ssm_dt_bias": (hv,),
            "ssm_a": (hv,), "ssm_norm": (dv,), "ssm_state": (slots, hv, dk, dv)}  # fmt: skip
    _check_f32(lay, want, "DeltaNet")
    if hv % hk or taps < 2:
        raise ValueError(f"DeltaNet: {hk} key heads for {hv} value heads, {taps} conv taps")
    if sum(k.shape[0] for k in lay.qkv) != cc + hv * dv + 2 * hv or \
            tuple(lay.o.shape) != (dim, hv * dv):  # fmt: skip
        raise ValueError("a DeltaNet layer's in-projections must give q k v | z | b a")


_LABELS = {"qkv_bias": "q|k|v bias", "q_norm": "q norm", "k_norm": "k norm",
           "o_bias": "output bias", "sinks": "attention sinks", "router_bias": "router bias",
           "probs_bias": "choice bias", "shared_gate": "shared expert's gate"}  # fmt: skip


def check_vector(v: torch.Tensor | None, n: int, name: str) -> None:
    """A per-layer float32 vector of n values as the C reads it (or None), else a ValueError."""
    if v is not None and (v.dtype != torch.float32 or not v.is_contiguous() or v.shape != (n,)):
        raise ValueError(f"{_LABELS[name]} of {v.dtype} {tuple(v.shape)}: float32 ({n},)")


def check_moe(lay: LayerSpec, s: Shape) -> None:
    """A MoE layer's tensors as decode_moe.h reads them, or a ValueError."""
    r, ex = lay.router, lay.experts
    n = r.shape[0] if r.dim() == 2 else 0
    if r.dtype != torch.float32 or not r.is_contiguous() or tuple(r.shape) != (n, s.dim):
        raise ValueError(f"router of {r.dtype} {tuple(r.shape)}: float32 (n_expert, {s.dim})")
    types = lay.exp_types
    if ex is None or len(ex) != 3 or len(types) != 3 or types[0] != types[1]:
        raise ValueError("experts: gate, up and down raw blocks, gate's type and up's alike")
    ff = ex[0].shape[1] if ex[0].dim() == 3 else 0
    want = ((n, ff), (n, ff), (n, s.dim))
    if any(e.dtype != torch.uint8 or not e.is_contiguous() or e.dim() != 3
           or tuple(e.shape[:2]) != w for e, w in zip(ex, want, strict=True)):  # fmt: skip
        raise ValueError(f"expert blocks {[tuple(e.shape) for e in ex]}: uint8 {want} x bytes")
    if not 0 < lay.n_used <= n or lay.exp_act not in EXP_ACTS or s.hidden < lay.n_used * ff:
        raise ValueError(f"{lay.n_used} of {n} experts of {ff} ({lay.exp_act}), hidden {s.hidden}")
    check_vector(lay.router_bias, n, "router_bias")
    check_vector(lay.probs_bias, n, "probs_bias")
    if lay.scoring not in SCORINGS:
        raise ValueError(f"router scores {lay.scoring!r}: one of {sorted(SCORINGS)}")
    if lay.shared_gu and (len(lay.shared_gu) > MAX_GROUPS or lay.shared_down is None
                          or not 0 < lay.shared_down.shape[1] <= s.hidden
                          or lay.shared_down.shape[0] != s.dim):  # fmt: skip
        raise ValueError("shared experts: gate|up runs and a down of dim outputs, <= hidden wide")
    b = lay.exp_bias
    if b is not None and (len(b) != 3 or any(
            t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != w
            for t, w in zip(b, want, strict=True))):  # fmt: skip
        raise ValueError(f"expert biases {[tuple(t.shape) for t in b]}: float32 {want}")
