"""`decode_step.c`: every layer of a llama-style decoder for a decode step's token rows in one
native call (norms, the block linears, rope, the KV write, attention over the paged cache, the
gated MLP, the residual adds; LFM2's gated short convolutions on their recurrent state slots in
place of attention, Granite-4.0-H's Mamba-2 mixers (`recurrent_rows.h`) and its residual scale,
Qwen3-Next's Gated DeltaNet mixers, gated queries and gated shared expert;
routed experts in place of the MLP (Qwen3-MoE's, gpt-oss's, GLM's, LFM2-MoE's and Granite's:
sigmoid scores, choice biases, shared experts), `decode_moe.h`; gpt-oss's attention sinks and
output bias; Gemma 2's capped attention scores; OLMo 2's q / k norms over all heads; LoRA
adapters, `decode_lora.h`), compiled at first use like `block_linear.py`'s kernels.

`DecodeStep` holds the model laid out in the C structs (`LayerSpec`s: the linears' prepared
`NativeLinear`s, the norm weights, one KV cache's layer tensors) and runs a step; `load()` answers
the library or None (no compiler: the torch layers run). `decode_step_ref.py` holds the same
step in torch, the oracle of the tests.
"""

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from localllm.kernels.cpu.block_linear import FLAG_SETS, SOURCES, _bind
from localllm.kernels.cpu.cbuild import built_libraries, compiler

SOURCE = Path(__file__).with_name("decode_step.c")
# included by SOURCE: part of the build key
HEADERS = tuple(Path(__file__).with_name(h)
                for h in ("decode_moe.h", "decode_lora.h", "recurrent_rows.h"))  # fmt: skip
ACTS = {"silu": 0, "gelu": 1}
EXP_ACTS = {"silu": 0, "swiglu_oai": 1}  # routed experts' activations (decode_moe.h's exp_act)
SCORINGS = {"softmax": 0, "sigmoid": 1}  # routers' scores (decode_moe.h's scoring)
MAX_GROUPS = 3  # MAX_GROUPS in the C: runs of one ggml type in q|k|v or gate|up
MAX_GROUP_HEADS = 16  # MAX_GROUP in the C: query heads attended together over one KV head
MAX_T = 64  # token rows a step with MoE layers takes (their expert ids are copied out)
_I, _P, _D = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double


class _Lin(ctypes.Structure):
    _fields_ = [("type", _I), ("nparts", _I), ("parts", _P), ("rows", _P), ("n", _I)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _Lin * MAX_GROUPS),
        ("n_qkv", _I),
        ("o", _Lin),
        ("gu", _Lin * MAX_GROUPS),
        ("n_gu", _I),
        ("down", _Lin),
        ("attn_norm", _P),
        ("ffn_norm", _P),
        ("k_cache", _P),
        ("v_cache", _P),
        ("q_norm", _P),
        ("k_norm", _P),
        ("post_attn_norm", _P),
        ("post_ffn_norm", _P),
        ("window", _I),
        ("rope_set", _I),
        ("qkv_bias", _P),
        ("conv_w", _P),
        ("conv_state", _P),
        ("conv_taps", _I),
        ("router", _P),
        ("exp_gate", _P),
        ("exp_up", _P),
        ("exp_down", _P),
        ("exp_types", _I * 3),
        ("n_expert", _I),
        ("n_used", _I),
        ("exp_ff", _I),
        ("norm_topk", _I),
        ("ids_out", _P),
        ("o_bias", _P),
        ("sinks", _P),
        ("router_bias", _P),
        ("exp_bias_g", _P),
        ("exp_bias_u", _P),
        ("exp_bias_d", _P),
        ("exp_act", _I),
        ("hidden", _I),
        ("scoring", _I),
        ("probs_bias", _P),
        ("w_scale", _D),
        ("sh_gu", _Lin * MAX_GROUPS),
        ("n_sh_gu", _I),
        ("sh_down", _Lin),
        ("sh_ff", _I),
        *((n, _P) for n in ("conv_b", "ssm_dt_b", "ssm_a", "ssm_d", "ssm_norm", "ssm_state")),
        *((n, _I) for n in ("ssm_h", "ssm_p", "ssm_n", "ssm_g")),
        ("qk_full", _I),
        ("q_gate", _I),
        ("sh_gate", _P),
        *((n, _I) for n in ("dn_hk", "dn_hv", "dn_dk", "dn_dv")),  # (last, as in the C's layer_t)
    ]


_MODEL_INTS = ("n_layers", "dim", "n_q", "n_kv", "hd", "hidden", "rope_dims", "neox", "kv_f16",
               "block_size", "act")  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        *((n, _I) for n in _MODEL_INTS),
        ("eps", _D),
        ("scale", _D),
        ("layers", _P),
        ("res_scale", _D),
        ("softcap", _D),
    ]


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


def load(cache_dir: Path | None = None) -> ctypes.CDLL | None:
    """The compiled library (block_linear's kernels inside), or None where none builds."""
    cc = compiler()
    if cc is None:
        return None
    sources = (SOURCE, *HEADERS, *SOURCES)
    for lib, _, _ in built_libraries(sources, FLAG_SETS, "localllm-decode-step", _bind_step,
                                     cache_dir, cc):  # fmt: skip
        return lib
    return None


def _bind_step(lib: ctypes.CDLL) -> None:
    _bind(lib)
    lib.decode_step.argtypes = [_P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _I, _P, _P, _P, _P, _P,
                                _P, _P, _P, _P, _I, ctypes.c_int, _P, _P]  # fmt: skip
    lib.decode_step.restype = None
    lib.paged_decode.argtypes = [_I, _P, _P, _P, _I, _I, _I, _I, _I, _D, _I, _P, _P, _I, _P, _P,
                                 _I, ctypes.c_int]  # fmt: skip
    lib.paged_decode.restype = None


def _lin(lin) -> _Lin:
    return _Lin(int(lin.qtype), len(lin.parts), ctypes.addressof(lin.parts.ptrs),
                ctypes.addressof(lin.parts.rows), lin.shape[0])  # fmt: skip


class DecodeStep:
    """A model's layers over one KV cache's tensors (float32 or float16, [blocks, block_size,
    n_kv, head_dim] per layer); `__call__` runs a step."""

    def __init__(self, lib: ctypes.CDLL, shape: Shape, layers: list[LayerSpec], block_size: int):
        s = shape
        if len(layers) == 0 or s.n_q % s.n_kv or s.rope_dims > s.head_dim or s.act not in ACTS:
            raise ValueError(f"no native decode step for {s} with {len(layers)} layers")
        attn = [lay for lay in layers if lay.conv_w is None]
        dtypes = {lay.k_cache.dtype for lay in attn} | {lay.v_cache.dtype for lay in attn}
        if dtypes - {torch.float32, torch.float16} or len(dtypes) > 1:
            raise ValueError(f"KV cache of {dtypes}: float32 or float16 only")
        for lay in layers:
            if lay.delta_dims:
                _check_delta(lay, s.dim)
            elif lay.ssm_state is not None:
                _check_mamba(lay, s.dim)
            elif lay.conv_w is not None:
                _check_conv(lay, s.dim)
            if lay.router is not None:
                _check_moe(lay, s)
        if any(len(lay.qkv) > MAX_GROUPS or len(lay.gate_up) > MAX_GROUPS for lay in layers):
            raise ValueError(f"more than {MAX_GROUPS} runs of one type in a fused projection")
        if any(not 0 <= lay.hidden <= s.hidden for lay in layers):
            raise ValueError(f"a layer's MLP wider than the step's hidden {s.hidden}")
        nqkv = (s.n_q + 2 * s.n_kv) * s.head_dim
        for lay in layers:
            for name, n in (("qkv_bias", nqkv), ("o_bias", s.dim), ("sinks", s.n_q)):
                _check_vector(getattr(lay, name), n, name)
            if lay.q_gate and (lay.qkv_bias is not None or lay.conv_w is not None or sum(
                    k.shape[0] for k in lay.qkv) != nqkv + s.n_q * s.head_dim):  # fmt: skip
                raise ValueError("gated queries: q (with its gates) | k | v, no biases")
            heads = (s.n_q, s.n_kv) if lay.qk_norm_full else (1, 1)
            for name, n in zip(("q_norm", "k_norm"), heads, strict=True):
                _check_vector(getattr(lay, name), n * s.head_dim, name)
        self.lib, self.shape, self.specs = lib, s, layers  # (kept: the structs point in)
        self.moe_ids: list[torch.Tensor] = []  # each MoE layer's last step's expert ids [MAX_T, k]
        self.layers = (_Layer * len(layers))()
        for c, lay in zip(self.layers, layers, strict=True):
            for i, g in enumerate(lay.qkv):
                c.qkv[i] = _lin(g)
            for i, g in enumerate(lay.gate_up):
                c.gu[i] = _lin(g)
            c.n_qkv, c.n_gu, c.o, c.down = (
                len(lay.qkv),
                len(lay.gate_up),
                _lin(lay.o),
                _Lin() if lay.down is None else _lin(lay.down),  # (a MoE layer has none)
            )
            c.attn_norm, c.ffn_norm = (None if w is None else w.data_ptr()
                                       for w in (lay.attn_norm, lay.ffn_norm))  # fmt: skip
            c.qk_full, c.q_gate = int(lay.qk_norm_full), int(lay.q_gate)
            if lay.conv_w is None:
                c.k_cache, c.v_cache = lay.k_cache.data_ptr(), lay.v_cache.data_ptr()
            for name in ("q_norm", "k_norm", "post_attn_norm", "post_ffn_norm", "qkv_bias",
                         "o_bias", "sinks", "router_bias", "probs_bias"):  # fmt: skip
                w = getattr(lay, name)
                setattr(c, name, None if w is None else w.data_ptr())
            c.window, c.rope_set = lay.window, lay.rope_set
            if lay.conv_w is not None:
                c.conv_w, c.conv_state = lay.conv_w.data_ptr(), lay.conv_state.data_ptr()
                c.conv_taps = lay.conv_w.shape[1]
            if lay.ssm_state is not None:
                ssm = (("conv_b", lay.conv_b), ("ssm_dt_b", lay.ssm_dt_bias), ("ssm_a", lay.ssm_a),
                       ("ssm_d", lay.ssm_d), ("ssm_norm", lay.ssm_norm),
                       ("ssm_state", lay.ssm_state))  # fmt: skip
                for name, w in ssm:
                    setattr(c, name, None if w is None else w.data_ptr())
                if lay.delta_dims:
                    c.dn_hk, c.dn_hv, c.dn_dk, c.dn_dv = lay.delta_dims
                else:
                    c.ssm_h, c.ssm_p, c.ssm_n, c.ssm_g = lay.ssm_dims
            if lay.router is not None:
                c.router = lay.router.data_ptr()
                c.exp_gate, c.exp_up, c.exp_down = (e.data_ptr() for e in lay.experts)
                c.exp_types[:] = [int(q) for q in lay.exp_types]
                c.n_expert, c.n_used = lay.router.shape[0], lay.n_used
                c.exp_ff, c.norm_topk = lay.experts[0].shape[1], int(lay.norm_topk)
                c.exp_act = EXP_ACTS[lay.exp_act]
                c.scoring, c.w_scale = SCORINGS[lay.scoring], lay.w_scale
                for i, g in enumerate(lay.shared_gu):
                    c.sh_gu[i] = _lin(g)
                c.n_sh_gu = len(lay.shared_gu)
                _check_vector(lay.shared_gate, s.dim, "shared_gate")
                if lay.shared_gate is not None and not lay.shared_gu:
                    raise ValueError("a shared expert's gate without a shared expert")
                c.sh_gate = None if lay.shared_gate is None else lay.shared_gate.data_ptr()
                if lay.shared_gu:
                    c.sh_down, c.sh_ff = _lin(lay.shared_down), lay.shared_down.shape[1]
                if lay.exp_bias is not None:
                    c.exp_bias_g, c.exp_bias_u, c.exp_bias_d = (b.data_ptr() for b in lay.exp_bias)
                ids = torch.zeros(MAX_T, lay.n_used, dtype=torch.int32)
                self.moe_ids.append(ids)
                c.ids_out = ids.data_ptr()
            c.hidden = lay.hidden
        self.convs = len(layers) - len(attn)
        f16 = torch.float16 in dtypes
        ints = (len(layers), s.dim, s.n_q, s.n_kv, s.head_dim, s.hidden, s.rope_dims, int(s.neox),
                int(f16), block_size, ACTS[s.act])  # fmt: skip
        scale = s.head_dim**-0.5 if s.scale is None else s.scale
        self.model = _Model(*ints, s.eps, scale, ctypes.addressof(self.layers), s.residual_scale,
                            s.softcap)  # fmt: skip
        # a Mamba-2 layer's inner width, conv channels and in-projection outputs (0: none)
        din, cc, zxd = max(((h * p, h * p + 2 * g * n, 2 * h * p + 2 * g * n + h)
                            for h, p, n, g in (lay.ssm_dims for lay in layers if lay.ssm_dims)),
                           default=(0, 0, 0))  # fmt: skip
        # a Gated DeltaNet layer's value width, conv channels and in-projection outputs
        vd, dcc, dlin = max(((hv * dv, 2 * hk * dk + hv * dv, 2 * hk * dk + 2 * hv * dv + 2 * hv)
                             for hk, hv, dk, dv in (lay.delta_dims for lay in layers
                                                    if lay.delta_dims)),
                            default=(0, 0, 0))  # fmt: skip
        gated = any(lay.q_gate for lay in layers)
        self.kmax = max(s.dim, s.hidden, s.n_q * s.head_dim, din, vd)
        # the q|k|v and attention-output scratch also hold a conv layer's B | C | x and C y, a
        # Mamba-2 or DeltaNet layer's in-projection and mixer outputs, Qwen3-Next's query gates;
        # the gate|up scratch their conv's
        self.wide = max((s.n_q * (2 if gated else 1) + 2 * s.n_kv) * s.head_dim,
                        3 * s.dim if self.convs else 0, zxd, dlin)  # fmt: skip
        self.att = max(s.n_q * s.head_dim, s.dim if self.convs else 0, din, vd)
        self.gu = max(2 * s.hidden, cc, dcc)
        # a MoE layer's router logits, top-k weights and ids, every pair's down output, the
        # pairs' order by expert and their runs (decode_moe.h)
        self.moe = max((lay.router.shape[0] + lay.n_used * (4 + s.dim) for lay in layers
                        if lay.router is not None), default=0)  # fmt: skip
        self.moe_e = max((lay.router.shape[0] for lay in layers if lay.router is not None),
                         default=0)  # fmt: skip
        self._scratch: dict[tuple[int, int], tuple] = {}

    def experts_used(self, t: int) -> list[int]:
        """The distinct experts each MoE layer (in order) used in the last step of t rows: what
        the torch layers count as lookups of resident experts."""
        if not self.moe_ids:
            return []
        ids = torch.stack([i[:t].reshape(-1) for i in self.moe_ids]).sort(1).values
        return (1 + (ids[:, 1:] != ids[:, :-1]).sum(1)).tolist()

    def _sc_stride(self, ctx: int) -> int:
        # scores of up to MAX_GROUP query heads (one KV head's) over ctx, and one K or V row
        s = self.shape
        return min(s.n_q // s.n_kv, MAX_GROUP_HEADS) * ctx + 2 * s.head_dim

    def _buffers(self, t: int, ctx: int, threads: int) -> tuple:
        key = (t, threads)
        have = self._scratch.get(key)
        s = self.shape
        if have is None or have[0] < ctx:
            ctx = max(ctx, 2 * (have[0] if have else 256))
            kq = t * self.kmax
            # zeroed, not empty: allocated once per shape, and no padding byte should depend on
            # what the memory held before
            bufs = (torch.zeros(t * s.dim), torch.zeros(t * self.wide), torch.zeros(t * self.att),
                    torch.zeros(t * self.gu),
                    torch.zeros(t * s.dim), torch.zeros(kq, dtype=torch.int8),
                    torch.zeros(kq // 32 + 8), torch.zeros(kq // 16 + 16, dtype=torch.int16),
                    torch.zeros(threads * self._sc_stride(ctx)),
                    torch.zeros(t * self.moe + self.moe_e + 2))  # fmt: skip
            have = self._scratch[key] = (ctx, bufs)
        return have

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 slots: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor,
                 threads: int | None = None, cos1: torch.Tensor | None = None,
                 sin1: torch.Tensor | None = None,
                 state_slots: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """x [t, dim] float32 (the embeddings; updated in place to the stream after the last
        layer), cos / sin [t, rope_dims / 2] (cos1 / sin1: the table of layers with rope_set 1),
        slots / seq_lens [t] and tables [t, W] int64 (all contiguous); state_slots [t] int64:
        each row's recurrent state slot (needed with short-conv or Mamba-2 layers; never a fresh
        one)."""
        cos1, sin1 = (cos, sin) if cos1 is None else (cos1, sin1)
        t = x.shape[0]
        if self.moe_ids and t > MAX_T:
            raise ValueError(f"{t} rows: a step with MoE layers takes at most {MAX_T}")
        if self.convs and (state_slots is None or state_slots.dtype != torch.int64
                           or tuple(state_slots.shape) != (t,)):  # fmt: skip
            raise ValueError("a step with recurrent layers needs int64 state_slots [t]")
        threads = threads or torch.get_num_threads()
        ctx, bufs = self._buffers(t, int(seq_lens.max()), threads)
        ptr = torch.Tensor.data_ptr
        *bufs, moe = bufs
        self.lib.decode_step(
            ctypes.addressof(self.model), t, ptr(x), ptr(cos), ptr(sin), ptr(cos1), ptr(sin1),
            ptr(slots),
            ptr(seq_lens), ptr(tables), tables.shape[1], *(ptr(b) for b in bufs),
            self._sc_stride(ctx), threads, None if state_slots is None else ptr(state_slots),
            ptr(moe),
        )  # fmt: skip
        return x


def _check_conv(lay: LayerSpec, dim: int) -> None:
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


def _check_mamba(lay: LayerSpec, dim: int) -> None:
    """A Mamba-2 layer's tensors as recurrent_rows.h's mamba2_rows reads them, or a ValueError."""
    if len(lay.ssm_dims) != 4 or min(lay.ssm_dims) < 1:
        raise ValueError(f"Mamba-2 dims {lay.ssm_dims}: (heads, head size, state, groups)")
    h, p, n, g = lay.ssm_dims
    cc = h * p + 2 * g * n
    taps = lay.conv_w.shape[-1] if lay.conv_w is not None else 0
    want = {"conv_w": (cc, taps), "conv_state": (lay.ssm_state.shape[0], taps - 1, cc),
            "conv_b": (cc,), "ssm_dt_bias": (h,), "ssm_a": (h,), "ssm_d": (h,),
            "ssm_norm": (h * p,), "ssm_state": (lay.ssm_state.shape[0], h, p, n)}  # fmt: skip
    for name, shape in want.items():
        w = getattr(lay, name)
        if w is None and name == "conv_b":
            continue
        if w is None or w.dtype != torch.float32 or not w.is_contiguous() or \
                tuple(w.shape) != shape:  # fmt: skip
            got = None if w is None else (w.dtype, tuple(w.shape))
            raise ValueError(f"Mamba-2 {name} of {got}: float32 {shape}")
    if h % g or taps < 2:
        raise ValueError(f"Mamba-2: {g} groups of {h} heads, {taps} conv taps")
    if len(lay.qkv) != 1 or lay.qkv[0].shape[0] != 2 * h * p + 2 * g * n + h or \
            tuple(lay.o.shape) != (dim, h * p):  # fmt: skip
        raise ValueError("a Mamba-2 layer's in-projection must be one run of z | x B C | dt")


def _check_delta(lay: LayerSpec, dim: int) -> None:
    """A Gated DeltaNet layer's tensors as recurrent_rows.h's delta_rows reads them, or a
    ValueError."""
    if len(lay.delta_dims) != 4 or min(lay.delta_dims) < 1:
        raise ValueError(f"DeltaNet dims {lay.delta_dims}: (key heads, value heads, Dk, Dv)")
    hk, hv, dk, dv = lay.delta_dims
    cc, slots = 2 * hk * dk + hv * dv, lay.ssm_state.shape[0] if lay.ssm_state is not None else 0
    taps = lay.conv_w.shape[-1] if lay.conv_w is not None else 0
    want = {"conv_w": (cc, taps), "conv_state": (slots, taps - 1, cc), "ssm_dt_bias": (hv,),
            "ssm_a": (hv,), "ssm_norm": (dv,), "ssm_state": (slots, hv, dk, dv)}  # fmt: skip
    for name, shape in want.items():
        w = getattr(lay, name)
        if w is None or w.dtype != torch.float32 or not w.is_contiguous() or \
                tuple(w.shape) != shape:  # fmt: skip
            got = None if w is None else (w.dtype, tuple(w.shape))
            raise ValueError(f"DeltaNet {name} of {got}: float32 {shape}")
    if hv % hk or taps < 2:
        raise ValueError(f"DeltaNet: {hk} key heads for {hv} value heads, {taps} conv taps")
    if sum(k.shape[0] for k in lay.qkv) != cc + hv * dv + 2 * hv or \
            tuple(lay.o.shape) != (dim, hv * dv):  # fmt: skip
        raise ValueError("a DeltaNet layer's in-projections must give q k v | z | b a")


_LABELS = {"qkv_bias": "q|k|v bias", "q_norm": "q norm", "k_norm": "k norm",
           "o_bias": "output bias", "sinks": "attention sinks", "router_bias": "router bias",
           "probs_bias": "choice bias", "shared_gate": "shared expert's gate"}  # fmt: skip


def _check_vector(v: torch.Tensor | None, n: int, name: str) -> None:
    """A per-layer float32 vector of n values as the C reads it (or None), else a ValueError."""
    if v is not None and (v.dtype != torch.float32 or not v.is_contiguous() or v.shape != (n,)):
        raise ValueError(f"{_LABELS[name]} of {v.dtype} {tuple(v.shape)}: float32 ({n},)")


def _check_moe(lay: LayerSpec, s: Shape) -> None:
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
    _check_vector(lay.router_bias, n, "router_bias")
    _check_vector(lay.probs_bias, n, "probs_bias")
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
