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
from pathlib import Path

import torch

from localllm.kernels.cpu.block_linear import FLAG_SETS, SOURCES, _bind
from localllm.kernels.cpu.cbuild import built_libraries, compiler
from localllm.kernels.cpu.decode_step_spec import (
    ACTS,
    EXP_ACTS,
    MAX_GROUP_HEADS,
    MAX_GROUPS,
    SCORINGS,
    LayerSpec,
    Shape,
    check_conv,
    check_delta,
    check_mamba,
    check_moe,
    check_vector,
)

SOURCE = Path(__file__).with_name("decode_step.c")
# included by SOURCE: part of the build key
HEADERS = tuple(Path(__file__).with_name(h)
                for h in ("decode_moe.h", "decode_lora.h", "recurrent_rows.h",
                          "decode_attention.h"))  # fmt: skip
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
        *((n, _I) for n in ("dn_hk", "dn_hv", "dn_dk", "dn_dv", "dn_grouped")),  # (last, as in C)
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
                check_delta(lay, s.dim)
            elif lay.ssm_state is not None:
                check_mamba(lay, s.dim)
            elif lay.conv_w is not None:
                check_conv(lay, s.dim)
            if lay.router is not None:
                check_moe(lay, s)
        if any(len(lay.qkv) > MAX_GROUPS or len(lay.gate_up) > MAX_GROUPS for lay in layers):
            raise ValueError(f"more than {MAX_GROUPS} runs of one type in a fused projection")
        if any(not 0 <= lay.hidden <= s.hidden for lay in layers):
            raise ValueError(f"a layer's MLP wider than the step's hidden {s.hidden}")
        nqkv = (s.n_q + 2 * s.n_kv) * s.head_dim
        for lay in layers:
            for name, n in (("qkv_bias", nqkv), ("o_bias", s.dim), ("sinks", s.n_q)):
                check_vector(getattr(lay, name), n, name)
            if lay.q_gate and (lay.qkv_bias is not None or lay.conv_w is not None or sum(
                    k.shape[0] for k in lay.qkv) != nqkv + s.n_q * s.head_dim):  # fmt: skip
                raise ValueError("gated queries: q (with its gates) | k | v, no biases")
            heads = (s.n_q, s.n_kv) if lay.qk_norm_full else (1, 1)
            for name, n in zip(("q_norm", "k_norm"), heads, strict=True):
                check_vector(getattr(lay, name), n * s.head_dim, name)
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
                    c.dn_grouped = int(lay.delta_grouped)
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
                check_vector(lay.shared_gate, s.dim, "shared_gate")
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
