"""The CPU decode step of llama, SmolLM3, Qwen2, Qwen3, Qwen3-MoE, Gemma 2, Gemma 3, Phi-3, OLMo 2,
LFM2, gpt-oss, GLM-4.5, LFM2-MoE, Granite-4.0-H and Qwen3-Next decoders as one native call
(`kernels/cpu/decode_step`): `NativeDecode.for_model` looks once whether a loaded model qualifies
(those families' blocks, dense gated MLPs or resident routed experts with a softmax or sigmoid
router, no biases but q|k|v's, the output's and gpt-oss's experts' and router's, every linear on the
native block kernels) and `__call__` runs a step when it does (each sequence's one new token, a
float32 or float16 paged cache; LoRA adapters on q|k|v, o, gate|up and down through
`kernels.cpu.decode_lora`, dense models only), else answers None and the torch layers run. It never
takes prompt rows (`BatchMeta.prompt`: a one-row prompt tail after a prefix-cache hit is one), nor
steps under a measurement's drawn routing. Steps of the same model give the same tokens either way
(tests/kernels/test_cpu_decode_step.py, tests/kernels/test_cpu_decode_families.py,
tests/lora/test_lora_native.py); the per-layer work is the same, the ~20 dispatched torch ops per
layer are gone.
"""

import dataclasses

import torch
from torch import nn

from localllm.engine.core.batch import BatchMeta
from localllm.engine.layers.shared import GatedMLP
from localllm.engine.runtime.recurrent_state import states_of
from localllm.kernels.cpu import decode_lora, decode_step
from localllm.kernels.quant.linear_native import INT8_TYPES, NATIVE_TYPES, NativeLinear
from localllm.offload.expert_source import ResidentExperts

MAX_ROWS = 16  # token rows per native step (batched decode); more: the torch layers
# their Block: SmolLM3's NoPE layers take rope table 1 as cos 1, sin 0 (`_Unrotated`); Qwen3's
# q/k norms are Gemma 3's (per head, before rope)
# q|k|v biases (Qwen2's) go in the step; a bias on any other linear keeps the torch layers
# LFM2's short-conv layers run in the step on their recurrent state slots (its attention layers
# are Qwen3's kind: q/k norms, NEOX rope); Qwen3-MoE's and Mixtral-style llama MoE's routed
# experts run in the step where they are resident raw blocks with the plain softmax router
# (`_moe_parts`); gpt-oss's too (biased, the clamped SwiGLU), with its attention sinks, output
# bias and windows on every other layer; GLM-4.5's and LFM2-MoE's (sigmoid scores, a choice bias,
# a weight scale; GLM's shared expert), beside their leading dense layers; Granite-4.0-H's
# Mamba-2 layers on their conv and SSM state slots, its rope-less attention, residual scale and
# softmax-routed experts with a shared one; Gemma 2's capped attention scores; Phi-3's q|k|v and
# gate|up tensors on the block; OLMo 2's q / k norms over all heads and missing input norms;
# Qwen3-Next's Gated DeltaNet layers on their conv and delta state slots (the split projections
# of current conversions, or an older file's one `ssm_in`, reordered), its gated queries and
# its block's shared expert with a sigmoid gate
FAMILIES = tuple(f"localllm.engine.models.{m}" for m in
                 ("llama", "smollm3", "qwen2", "qwen3", "qwen3moe", "gemma3", "lfm2",
                  "gpt_oss", "glm4moe", "lfm2moe", "granitehybrid", "gemma2", "phi3",
                  "olmo2", "qwen3next"))  # fmt: skip
# blocks whose FFN norm has another name: gpt-oss's is `post_attention_norm` (not an output norm)
FFN_NORM = {"localllm.engine.models.gpt_oss": "post_attention_norm"}


def _kernels(m: nn.Module | None) -> list | None:
    """The native kernels of a linear or fused linear, or None where any is not native."""
    if m is None:
        return None
    ks = m.kernels()
    return ks if ks and all(isinstance(k, NativeLinear) for k in ks) else None


def _runs(linears: list) -> list | None:
    """The native kernels of linears read side by side (q, k, v; gate, up), or None."""
    ks = [_kernels(m) for m in linears]
    return None if None in ks else [k for kk in ks for k in kk]


def _fused_qkv(blk) -> nn.Module | None:
    """The block's fused q|k|v linear, or None (llama's `qkv`; Qwen's `qkv_fused`, whose `qkv`
    is a method)."""
    fused = getattr(blk, "qkv_fused", getattr(blk, "qkv", None))
    return fused if isinstance(fused, nn.Module) else None


def _qkv_bias(blk, fused: nn.Module | None) -> torch.Tensor | None:
    """The q|k|v biases side by side as the step adds them (zeros for a part without one), or
    None where no part has one."""
    if fused is not None:
        b = getattr(fused, "bias", None)
        return None if b is None else b.float().contiguous()
    parts = (blk.attn_q, blk.attn_k, blk.attn_v)
    if all(getattr(m, "bias", None) is None for m in parts):
        return None
    bs = [m.bias if m.bias is not None else torch.zeros(m.out_features) for m in parts]
    return torch.cat([b.float() for b in bs]).contiguous()


def _moe_parts(mlp) -> dict | None:
    """A routed-expert FFN's `LayerSpec` fields for the step (`kernels/cpu/decode_moe.h`), or
    None where it runs otherwise: resident raw experts of native block types (gate's and up's
    alike), SiLU or gpt-oss's clamped SwiGLU (biases or none), a float32 router (a bias or none)
    with softmax or sigmoid scores (a choice bias, a weight scale; no expert groups), a shared
    SiLU expert on native kernels or none, nothing mapped, split, offloaded or read ahead."""
    f, router = getattr(mlp, "format", None), getattr(mlp, "ffn_gate_inp", None)
    if f is None or router is None or not isinstance(mlp.source, ResidentExperts):
        return None
    w = router.dense_weight()
    elsewhere = (mlp.compute_on, mlp.split, mlp.mapped, mlp.packed, mlp.guess_next,
                 mlp.read_ahead_next)  # fmt: skip
    if w is None or any(v is not None for v in elsewhere) or f.gate != f.up:
        return None
    if f.act not in decode_step.EXP_ACTS:
        return None
    r = mlp.routing
    if r is not None and (r.n_group != 1 or r.scoring not in decode_step.SCORINGS):
        return None
    shared = {} if mlp.shexp is None else _shared_parts(mlp.shexp)
    if shared is None:
        return None
    raw = tuple(t.data for t in mlp.expert_weights())
    if f.gate not in NATIVE_TYPES or f.down not in NATIVE_TYPES:
        return None
    # (views of the file's blocks: a copy here would hold every expert twice)
    if any(t.dtype != torch.uint8 or t.device.type != "cpu" or t.dim() != 3
           or not t.is_contiguous() for t in raw):  # fmt: skip
        return None
    exps = (mlp.ffn_gate_exps, mlp.ffn_up_exps, mlp.ffn_down_exps)
    bias = None if exps[0].bias is None else tuple(_f32(t.bias) for t in exps)
    routing = {} if r is None else {
        "scoring": r.scoring, "w_scale": float(r.scale),
        "probs_bias": _f32(mlp.exp_probs_b.value) if r.probs_bias else None}  # fmt: skip
    return {"router": w.contiguous(), "experts": raw,
            "exp_types": (f.gate, f.up, f.down), "n_used": mlp.n_used,
            "norm_topk": bool(mlp.norm_topk_prob), "router_bias": _f32(router.bias),
            "exp_bias": bias, "exp_act": f.act, **routing, **shared}  # fmt: skip


def _shared_parts(shexp) -> dict | None:
    """A shared expert's `LayerSpec` fields (a SiLU gated MLP on native kernels, no biases), or
    None."""
    fused = shexp.gate_up
    gu = _kernels(fused) if fused is not None else _runs([shexp.ffn_gate, shexp.ffn_up])
    down = _kernels(shexp.ffn_down)
    parts = (shexp.ffn_gate, shexp.ffn_up, shexp.ffn_down, shexp.gate_up)
    if gu is None or down is None or shexp.act != "silu":
        return None
    if any(getattr(m, "bias", None) is not None for m in parts):
        return None
    return {"shared_gu": tuple(gu), "shared_down": down[0]}


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float().contiguous()


def _layer(blk, args) -> dict | None:
    """One block's `LayerSpec` fields (the caches aside), or None where it does not qualify."""
    if type(blk).__module__ not in FAMILIES:
        return None
    if not hasattr(blk, "mlp"):  # Phi-3: q|k|v and gate|up each one tensor on the block
        return _phi3_layer(blk)
    mlp, fused = blk.mlp, _fused_qkv(blk)
    moe = None if isinstance(mlp, GatedMLP) else _moe_parts(mlp)
    if moe is None and not isinstance(mlp, GatedMLP):
        return None
    gate = getattr(blk, "ffn_gate_inp_shexp", None)
    if gate is not None:  # Qwen3-Next: the block's shared expert, scaled by a sigmoid gate
        shared = _shared_parts(blk.shexp) if moe is not None and "shared_gu" not in moe else None
        if shared is None:
            return None
        moe = {**moe, **shared, "shared_gate": _f32(gate.value.reshape(-1))}
    if getattr(blk, "ssm_ba", None) is not None:
        return _delta_layer(blk, moe)
    conv = getattr(blk, "shortconv", None)
    if conv is not None:
        return _conv_layer(blk, conv, moe)
    if getattr(blk, "mamba", None) is not None:
        return _mamba_layer(blk, blk.mamba, moe)
    qkv = _kernels(fused) if fused is not None else _runs([blk.attn_q, blk.attn_k, blk.attn_v])
    o = _kernels(blk.attn_output)
    if moe is not None:
        gu, down, linears = [], [None], ()
    else:
        gu = _kernels(mlp.gate_up) if mlp.gate_up is not None else _runs([mlp.ffn_gate, mlp.ffn_up])
        down = _kernels(mlp.ffn_down)
        linears = (mlp.ffn_gate, mlp.ffn_up, mlp.ffn_down, mlp.gate_up)
    if qkv is None or gu is None or o is None or down is None:
        return None
    if any(getattr(m, "bias", None) is not None for m in linears):
        return None
    spec = {"qkv": qkv, "o": o[0], "gate_up": gu, "down": down[0], **(moe or {})}
    if moe is None:
        spec["hidden"] = down[0].shape[1]  # (narrower than the step's beside wider MoE layers)
    spec["qkv_bias"] = _qkv_bias(blk, fused)
    spec["o_bias"] = _f32(getattr(blk.attn_output, "bias", None))
    sinks = getattr(blk, "attn_sinks", None)  # gpt-oss's
    spec["sinks"] = None if sinks is None else _f32(sinks.value)
    ffn = FFN_NORM.get(type(blk).__module__, "ffn_norm")
    post_attn = None if ffn == "post_attention_norm" else "post_attention_norm"
    for name, norm in (("attn_norm", "attn_norm"), ("ffn_norm", ffn),
                       ("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm"),
                       ("post_attn_norm", post_attn),
                       ("post_ffn_norm", "post_ffw_norm")):  # fmt: skip
        m = getattr(blk, norm, None) if norm else None
        if m is not None and not getattr(m, "loaded", True):  # (GLM-4.5-Air has no q/k norms)
            m = None
        spec[name] = None if m is None else m.weight.float().contiguous()
    if type(blk).__module__.endswith(".olmo2"):  # q / k norms over all heads, no input norms
        spec["qk_norm_full"] = True
    if getattr(blk, "local", False):  # Gemma 3's sliding-window layers, their own rope table
        spec["window"], spec["rope_set"] = args.sliding_window, 1
    if isinstance(getattr(blk, "window", None), int):  # gpt-oss's: the same rope table
        spec["window"] = blk.window
    if getattr(blk, "rope", True) is False:  # SmolLM3's NoPE layers: table 1 leaves q, k as is
        spec["rope_set"] = 1
    if type(blk).__module__.endswith(".qwen3next"):  # each head's query and gate side by side
        spec["q_gate"] = True
    return spec


def _phi3_layer(blk) -> dict | None:
    """A Phi-3 block's `LayerSpec` fields (`attn_qkv`, `ffn_up` as gate | up rows), or None."""
    parts = [_kernels(blk.attn_qkv), _kernels(blk.attn_output), _kernels(blk.ffn_up),
             _kernels(blk.ffn_down)]  # fmt: skip
    linears = (blk.attn_qkv, blk.attn_output, blk.ffn_up, blk.ffn_down)
    if None in parts or any(getattr(m, "bias", None) is not None for m in linears):
        return None
    qkv, o, gu, down = parts
    return {"qkv": qkv, "o": o[0], "gate_up": gu, "down": down[0], "hidden": down[0].shape[1],
            "attn_norm": blk.attn_norm.weight.float().contiguous(),
            "ffn_norm": blk.ffn_norm.weight.float().contiguous()}  # fmt: skip


def _mixer_layer(blk, ins_proj, out_proj, moe: dict | None) -> dict | None:
    """A recurrent block's `LayerSpec` fields shared by its kinds (its mixer's aside): the
    in- and out-projections (no biases; the in-projection one run), the norms, its FFN dense or
    routed (`moe`), or None."""
    mlp = blk.mlp
    ins, out = _kernels(ins_proj), _kernels(out_proj)
    if moe is None:
        gu = _kernels(mlp.gate_up) if mlp.gate_up is not None else _runs([mlp.ffn_gate, mlp.ffn_up])
        down = _kernels(mlp.ffn_down)
        linears = (mlp.ffn_gate, mlp.ffn_up, mlp.ffn_down, mlp.gate_up)
        ffn = None if gu is None or down is None else {
            "gate_up": gu, "down": down[0], "hidden": down[0].shape[1]}  # fmt: skip
    else:
        linears, ffn = (), {"gate_up": [], "down": None, **moe}
    if ins is None or len(ins) != 1 or out is None or ffn is None:
        return None
    if any(getattr(m, "bias", None) is not None for m in (ins_proj, out_proj, *linears)):
        return None
    return {"qkv": ins, "o": out[0], **ffn,
            "attn_norm": blk.attn_norm.weight.float().contiguous(),
            "ffn_norm": blk.ffn_norm.weight.float().contiguous()}  # fmt: skip


def _conv_layer(blk, conv, moe: dict | None) -> dict | None:
    """An LFM2 short-conv block's `LayerSpec` fields (its state and the caches aside), its FFN
    dense or routed (`moe`: LFM2-MoE's), or None."""
    spec = _mixer_layer(blk, conv.in_proj, conv.out_proj, moe)
    if spec is None or conv.conv.value is None:
        return None
    return {**spec, "conv_w": conv.conv.value.float().contiguous()}


def _mamba_layer(blk, mamba, moe: dict | None) -> dict | None:
    """A Granite-4.0-H Mamba-2 block's `LayerSpec` fields (its states aside), or None."""
    spec = _mixer_layer(blk, mamba.ssm_in, mamba.ssm_out, moe)
    conv, a = mamba.ssm_conv1d, mamba.args
    if spec is None or conv.weight is None or blk.ssm_a is None or blk.ssm_d is None:
        return None
    return {**spec, "conv_w": _f32(conv.weight), "conv_b": _f32(conv.bias),
            "ssm_dt_bias": _f32(mamba.ssm_dt.value), "ssm_a": _f32(blk.ssm_a),
            "ssm_d": _f32(blk.ssm_d), "ssm_norm": _f32(mamba.ssm_norm.value.reshape(-1)),
            "ssm_dims": (a.n_ssm_heads, a.head_size, a.d_state, a.n_groups)}  # fmt: skip


def _delta_layer(blk, moe: dict | None) -> dict | None:
    """A Qwen3-Next Gated DeltaNet block's `LayerSpec` fields (its states aside), or None (a
    linear off the native kernels). An older file's one `ssm_in` (q k v z grouped per key head)
    is reordered by the step."""
    if moe is None or blk.ssm_a_value is None:
        return None
    grouped = blk.ssm_in.loaded
    projections = (blk.ssm_in,) if grouped else (blk.attn_qkv, blk.attn_gate)
    ins = [_kernels(m) for m in (*projections, blk.ssm_ba)]
    out = _kernels(blk.ssm_out)
    linears = (*projections, blk.ssm_ba, blk.ssm_out)
    if None in ins or out is None or any(getattr(m, "bias", None) is not None for m in linears):
        return None
    a = blk.args
    return {"qkv": [k for ks in ins for k in ks], "o": out[0], "gate_up": [], "down": None, **moe,
            "attn_norm": _f32(blk.attn_norm.weight), "ffn_norm": _f32(blk.ffn_norm.weight),
            "conv_w": _f32(blk.ssm_conv1d.value), "ssm_dt_bias": _f32(blk.ssm_dt.value),
            "ssm_a": _f32(blk.ssm_a_value), "ssm_norm": _f32(blk.ssm_norm.weight),
            "delta_dims": (a.n_k_heads, a.n_v_heads, a.head_k_dim, a.head_v_dim),
            "delta_grouped": grouped}  # fmt: skip


class _Unrotated:
    """Rope table 1 of a model with NoPE layers: its rotary's config, cos 1 and sin 0."""

    def __init__(self, rotary):
        self.rotary, self.cfg = rotary, rotary.cfg

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary.cos_sin(positions)
        return torch.ones_like(cos), torch.zeros_like(sin)


class _NoRope:
    """The rope tables of a model whose attention has no rope (Granite-4.0-H): no dims."""

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.zeros(positions.shape[0], 0)
        return z, z


class NativeDecode:
    def __init__(self, model: nn.Module, lib, shape: decode_step.Shape, layers: list[dict],
                 rotaries: list):  # fmt: skip
        self.model, self.lib, self.shape, self.layers = model, lib, shape, layers
        self.rotaries = rotaries  # rope tables 0 and 1 (LayerSpec.rope_set)
        self.embed_scale = getattr(model, "embed_scale", None)  # (Gemma's, Granite's)
        self._step: tuple[object, decode_step.DecodeStep] | None = None  # (kv, its step)
        self._lora: tuple[torch.Tensor, decode_lora.LoraTable] | None = None  # (W, its table)
        mlps = [getattr(b, "mlp", None) for b in model.blk]  # (Phi-3's blocks hold theirs)
        self.moe = [m for m in mlps if m is not None and not isinstance(m, GatedMLP)]  # routed

    @classmethod
    def for_model(cls, model: nn.Module) -> "NativeDecode | None":
        """The native step of `model`, or None where it does not qualify (or nothing builds)."""
        blocks = getattr(model, "blk", None)
        args = getattr(model, "args", None)
        if not blocks or args is None:
            return None
        layers = [_layer(blk, args) for blk in blocks]
        if None in layers:
            return None
        rotaries = [getattr(model, n, None) for n in ("rotary_global", "rotary_local")]
        if None in rotaries:
            nope = any(lay.get("rope_set") for lay in layers)
            rotaries = [model.rotary, _Unrotated(model.rotary) if nope else model.rotary]
        if rotaries[0] is None:  # no rope at all: only where the family says so
            if getattr(args, "rope", True):
                return None
            rotaries, dims, neox = [_NoRope()] * 2, 0, False
        else:
            same = dataclasses.replace(rotaries[1].cfg, base=rotaries[0].cfg.base)
            if rotaries[0].cfg != same:  # (tables differ in base alone)
                return None
            dims, neox = rotaries[0].cfg.dims, rotaries[0].cfg.neox
        lib = decode_step.load()
        if lib is None:
            return None
        for lay in layers:  # decode goes through the step: the linears' own calls are prompts
            for k in (*lay["qkv"], lay["o"], *lay["gate_up"], lay["down"]):
                if k is not None and k.qtype not in INT8_TYPES:
                    k.int8_max_t = 0  # exact float32 (kernels/quant/linear_native.py)
        # (a MoE layer's pairs, k experts a row, take the gate|up scratch: k x their hidden; a
        # shared expert and a dense layer their own; dense layers know their width)
        widths = [lay["n_used"] * lay["experts"][0].shape[1] if "router" in lay
                  else lay["hidden"] for lay in layers]  # fmt: skip
        shared = [lay.get("shared_down") for lay in layers]
        widths += [d.shape[1] for d in shared if d is not None]
        hidden = max(widths)
        # (the dense MLPs' activation; routed experts name theirs per layer)
        act = next((b.mlp.act for b in blocks if isinstance(getattr(b, "mlp", None), GatedMLP)),
                   "silu")  # fmt: skip
        shape = decode_step.Shape(args.dim, args.n_heads, args.n_kv_heads, args.head_dim,
                                  hidden, dims, neox, args.norm_eps, act,
                                  getattr(args, "attn_scale", None),
                                  getattr(args, "residual_scale", 1.0),
                                  getattr(args, "attn_softcap", 0.0) or 0.0)  # fmt: skip
        return cls(model, lib, shape, layers, rotaries)

    def _for_cache(self, kv) -> decode_step.DecodeStep | None:
        if self._step is not None and self._step[0] is kv:
            return self._step[1]
        if kv.k_scales is not None or kv.k[0].dtype not in (torch.float32, torch.float16):
            return None
        specs = []
        for i, (blk, lay) in enumerate(zip(self.model.blk, self.layers, strict=True)):
            if "conv_w" in lay:  # the layer's state slots instead of KV
                states = states_of(kv)
                recurrent = "ssm_dims" in lay or "delta_dims" in lay
                ssm = states.tensor(i, "ssm") if recurrent else None
                conv = states.tensor(i, "conv")
                specs.append(decode_step.LayerSpec(k_cache=None, v_cache=None, ssm_state=ssm,
                                                   conv_state=conv, **lay))  # fmt: skip
                continue
            j = getattr(blk, "kv_layer", None)  # LFM2: its attention layers are numbered apart
            j = i if j is None else j
            specs.append(decode_step.LayerSpec(k_cache=kv.k[j], v_cache=kv.v[j], **lay))
        try:
            step = decode_step.DecodeStep(self.lib, self.shape, specs, kv.block_size)
        except ValueError:
            return None
        self._step = (kv, step)
        return step

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, batch: BatchMeta, kv):
        """The stream after the last layer [T, dim] (before the final norm), or None where the
        step does not qualify (then the caller runs the torch layers)."""
        t = ids.shape[0]
        if ids.is_cuda or not 0 < t <= MAX_ROWS or batch.context is not None:
            return None
        if batch.embeds is not None or batch.query_start != tuple(range(t + 1)):
            return None
        if any(batch.prompt) or min(batch.seq_lens) < 2:  # prompt rows: the prompt path
            return None
        if any(mlp.routing_override is not None for mlp in self.moe):
            return None  # a measurement's drawn routing (bench --routing): the torch layers
        lora = getattr(self.model, "lora", None)  # engine.lora: this step's rows on adapters
        table = None
        if lora is not None and lora.active:
            table = self._lora_table(lora)
            if table is None:
                return None
        step = self._for_cache(kv)
        if step is None:
            return None
        x = self.model.token_embd(ids).float()
        x = (x * self.embed_scale if self.embed_scale is not None else x).contiguous()
        cos, sin = (c.contiguous() for c in self.rotaries[0].cos_sin(positions))
        cos1, sin1 = cos, sin
        if self.rotaries[1] is not self.rotaries[0]:
            cos1, sin1 = (c.contiguous() for c in self.rotaries[1].cos_sin(positions))
        width = max(len(tb) for tb in batch.block_tables)
        tables = torch.tensor([(*tb, *(0,) * (width - len(tb))) for tb in batch.block_tables])
        seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int64)
        slots = batch.slot_mapping.to(torch.int64).contiguous()
        state_slots = states_of(kv).slots(batch).contiguous() if step.convs else None
        decode_lora.set_table(self.lib, table)
        try:
            x = step(x, cos, sin, slots, seq_lens, tables.reshape(t, width), None, cos1, sin1,
                     state_slots)  # fmt: skip
        finally:
            decode_lora.set_table(self.lib, None)
        for mlp, used in zip(self.moe, step.experts_used(t), strict=True):  # as `_decode_rows`
            mlp.source.stats.lookups += used
            mlp.source.stats.hits += used
        return x

    def _lora_table(self, ctx) -> "decode_lora.LoraTable | None":
        """The adapters of every block linear for the native step (made once per row buffer of
        `ctx`), or None where one sits where the step cannot add it (an unfused q/k/v)."""
        if self._lora is not None and self._lora[0] is ctx.w:
            return self._lora[1]
        linears = []
        for blk in self.model.blk:
            recurrent = any(getattr(blk, n, None) is not None for n in ("shortconv", "mamba"))
            if recurrent or not isinstance(getattr(blk, "mlp", None), GatedMLP):
                return None  # (no adapters in recurrent layers or beside routed experts here)
            mlp = blk.mlp
            fused = (_fused_qkv(blk), blk.attn_output, mlp.gate_up, mlp.ffn_down)
            loose = (blk.attn_q, blk.attn_k, blk.attn_v) if fused[0] is None else ()
            loose += (mlp.ffn_gate, mlp.ffn_up) if fused[2] is None else ()
            if any(m.lora is not None for m in loose):
                return None
            for m in fused:
                d = getattr(m, "lora", None)
                linears.append(None if d is None else decode_lora.LinearLora(*d.native_parts()))
        table = decode_lora.LoraTable(linears, MAX_ROWS)
        self._lora = (ctx.w, table)
        return table


def split_step(batch: BatchMeta, model: nn.Module) -> tuple | None:
    """A step that mixes decode rows with prompt rows, split in two: (decode rows, their
    `BatchMeta`, the other rows, theirs), or None where it does not split (no decode rows or no
    others, more decode rows than the step takes, a device context, recurrent state, adapters,
    an image row among the decode rows). Decode rows then take the native step in a mixed step
    too: a sequence's bits do not depend on whether a prompt shared its step."""
    if batch.context is not None or batch.state_slots:
        return None
    lora = getattr(model, "lora", None)
    if lora is not None and lora.active:  # adapters are set per row of the whole step
        return None
    qs, lens = batch.query_start, batch.seq_lens
    prompt = batch.prompt or (False,) * len(lens)
    dec = [b for b in range(len(lens))
           if qs[b + 1] - qs[b] == 1 and lens[b] >= 2 and not prompt[b]]  # fmt: skip
    rest = [b for b in range(len(lens)) if qs[b + 1] > qs[b] and b not in dec]
    if not dec or not rest or len(dec) > MAX_ROWS:
        return None
    drows = [qs[b] for b in dec]
    rrows = [r for b in rest for r in range(qs[b], qs[b + 1])]
    embeds = None
    if batch.embeds is not None:
        rows, values = batch.embeds
        where = {r: i for i, r in enumerate(rrows)}
        listed = rows.tolist()
        if any(r not in where for r in listed):
            return None
        embeds = (torch.tensor([where[r] for r in listed], dtype=torch.long), values)

    def sub(seqs: list[int], flat: list[int], embeds=None) -> BatchMeta:
        starts = [0]
        for b in seqs:
            starts.append(starts[-1] + qs[b + 1] - qs[b])
        return BatchMeta(tuple(starts), tuple(lens[b] for b in seqs),
                         tuple(batch.block_tables[b] for b in seqs),
                         batch.slot_mapping[flat], batch.block_size, embeds=embeds,
                         prompt=tuple(prompt[b] for b in seqs))  # fmt: skip

    return drows, sub(dec, drows), rrows, sub(rest, rrows, embeds)
