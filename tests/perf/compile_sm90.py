"""Compile the fused and attention triton kernels for sm_90 on a machine without a GPU (not a test).

    python tests/perf/compile_sm90.py [--pdl]
    python tests/perf/compile_sm90.py --batch    # only the batched-decode GEMMs' tile choices

`--pdl` compiles the programmatic-dependent-launch variants (`kernels/pdl.py`) and checks that
their PTX holds the griddepcontrol instructions (and, for the GEMVs, the L2 prefetches).

triton's frontend, its LLVM/PTX passes and its bundled ptxas run without a device, so type errors
(one name bound to two pointer types across an `if`) and register spills show up here before a
device call is spent on them. Prints ptxas's registers and spill bytes per kernel variant, at the
decode shapes of Llama-3-8B (4096 wide, 32 q / 8 kv heads of 128) and Qwen3-30B-A3B (2048, 32 / 4).
"""

import itertools
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from localllm.kernels import host_flags
from localllm.kernels.attention import triton_decode
from localllm.kernels.fused import triton_ops, triton_rope
from localllm.kernels.moe import triton_combine, triton_grouped
from localllm.kernels.quant import triton_batch_gemm, triton_dp4a, triton_unpack
from localllm.kernels.recurrent import triton_gated_norm, triton_recurrent, triton_step

F32, I32, I64 = "*fp32", "*i32", "*i64"
# the packed GEMVs' LoRA epilogue arguments (`kernels/quant/triton_lora_tail.py`)
GEMV_LORA = {"lt_ptr": F32, "lb_ptr": "*fp16", "lc_ptr": I32}
GEMV_LORA |= dict.fromkeys(
    ("l_r", "l_e1", "l_e2", "l_lo0", "l_lo1", "l_lo2", "l_rk0", "l_rk1", "l_rk2", "l_tiles"), "i32"
)
# the "inline" scheme's shrink arguments (x, A, W)
GEMV_LORA |= {"ls_ptr": F32, "l_sx": "i32", "la_ptr": "*fp16", "lw_ptr": F32, "l_sw": "i32"}
GEMV_LORA |= {"l_ns": "i32", "l_np": "i32"}
# PTXAS: another ptxas where the bundled one predates the PTX triton writes (triton 3.9 wheels
# bundle a 12.9 `ptxas` and a 13.x `ptxas-blackwell`, which also takes sm_90a)
PTXAS = os.environ.get("PTXAS") or os.path.join(
    os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"
)


def compile_one(fn, sig: dict[str, str], const: dict, warps: int = 4) -> str:
    """ptxas's resource line for `fn` with these argument types and constexprs (plus, with PDL,
    how many griddepcontrol and prefetch instructions the PTX holds)."""
    given = {**sig, **dict.fromkeys(const, "constexpr")}
    full = {n: given[n] for n in fn.arg_names}  # (in the kernel's order: constexprs by index)
    names = list(full)
    constexprs = {(names.index(k),): v for k, v in const.items()}
    src = ASTSource(fn=fn, signature=full, constexprs=constexprs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(k.asm["ptx"])
        cmd = [PTXAS, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.path.join(d, "k.cubin")]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    line = f"{regs.group(1) if regs else '?'} registers, "
    line += f"{spill.group(1) if spill else '?'} B spilled"
    if const.get("PDL"):
        ptx_text = k.asm["ptx"]
        waits = ptx_text.count("griddepcontrol.wait")
        starts = ptx_text.count("griddepcontrol.launch_dependents")
        if not (waits and starts):
            raise RuntimeError(f"{fn.__name__}: PDL variant without griddepcontrol ({line})")
        pre = ptx_text.count("prefetch.global.L2")
        line += f", griddepcontrol {starts}+{waits}, L2 prefetches {pre}"
    return line


def batch_gemms() -> None:
    """`triton_batch_gemm`'s kernels at their row blocks and the tile widths and warps a sweep
    would try (`batch_gemm.BatchGemmConfig`)."""
    tail = {"out_ptr": F32} | dict.fromkeys(("M", "N", "K", "NB", "SB"), "i32")
    sigs = {
        triton_batch_gemm._bgemm_q4k: {"x_ptr": "*bf16", "qs_ptr": I32, "hdr_ptr": I32} | tail,
        triton_batch_gemm._bgemm_q6k: {"x_ptr": "*bf16", "ql_ptr": I32, "qh_ptr": I32}
        | {"sc_ptr": I32, "d_ptr": "*fp16"}
        | tail,
        triton_batch_gemm._bgemm_q8_0: {"x_ptr": "*bf16", "qs_ptr": I32, "d_ptr": "*fp16"} | tail,
    }
    for fn, sig in sigs.items():
        for bm, bn, warps in itertools.product((16, 32, 64), (32, 64, 128), (4, 8)):
            const = {"BM": bm, "BN": bn, "HALF": True}
            line = compile_one(fn, sig, const, warps)
            print(f"{fn.__name__} BM {bm} BN {bn} x {warps} warps: {line}")


def main(pdl: bool = False) -> None:
    norm = dict.fromkeys(("x_ptr", "r_ptr", "rw_ptr", "e_ptr", "s_ptr", "w_ptr", "y_ptr"), F32)
    norm |= {"q_ptr": I32, "d_ptr": F32, "s16_ptr": I32, "xs_ptr": F32}
    # the LoRA shrink's arguments (`triton_ops._lora`): A, W, the scratch, W's stride, R
    lora = {"a_ptr": "*fp16", "lw_ptr": F32, "t_ptr": F32}
    norm |= lora | {"D": "i32", "eps": "fp32", "rs": "fp32", "slw": "i32", "R": "i32", "PS": "i32"}
    silu = {"gu_ptr": F32, "y_ptr": F32, "q_ptr": I32, "d_ptr": F32, "s16_ptr": I32, "xs_ptr": F32}
    silu |= lora | {"H": "i32", "slw": "i32", "R": "i32", "RSTEP": "i32", "PS": "i32"}
    rope = dict.fromkeys(("q_ptr", "k_ptr", "v_ptr"), F32) | dict.fromkeys(
        ("sq", "sk", "sv"), "i32"
    )
    rope |= dict.fromkeys(("cos_ptr", "sin_ptr", "qn_ptr", "kn_ptr"), F32) | {"eps": "fp32"}
    rope |= {"out_ptr": F32, "kc_ptr": "*fp16", "vc_ptr": "*fp16", "slot_ptr": I64, "s_slot": "i32"}
    split = {"q_ptr": F32, "rows_ptr": I64, "k_ptr": "*fp16", "v_ptr": "*fp16", "slots_ptr": I64}
    split |= {"pad_ptr": "*i1", "m_ptr": F32, "l_ptr": F32, "acc_ptr": F32, "M": "i32", "NS": "i32"}
    split |= {"scale": "fp32", "softcap": "fp32"}
    comb = {
        "m_ptr": F32,
        "l_ptr": F32,
        "acc_ptr": F32,
        "rows_ptr": I64,
        "out_ptr": F32,
        "q_ptr": I32,
        "d_ptr": F32,
        "s16_ptr": I32,
        "xs_ptr": F32,
        "NS": "i32",
    }
    comb |= lora | {"slw": "i32", "R": "i32", "RSTEP": "i32", "PS": "i32"}
    quant = {"x_ptr": F32, "q_ptr": I32, "d_ptr": F32, "s16_ptr": I32, "xsum_ptr": F32, "K": "i32"}
    cases = [
        (triton_dp4a._quant_x8, quant, {"G": 16, "RN": True}, 4),
    ]
    for lo in (False, True):  # with the next linear's LoRA shrink (`triton_ops.LoraShrink`)
        for part in (False, True) if lo else (False,):  # its shares stored (`PARTIAL_SHRINK`)
            silu_flags = {"BH": 1024, "QUANT": True, "RN": True, "LORA": lo, "BRS": 8}
            silu_flags |= {"APF": triton_ops.SILU_LORA_PREFETCH}
            cases.append((triton_ops._silu_mul, silu, silu_flags | {"PART": part}, 4))
        # 8: a MoE layer's output summed in (extra: with its shared experts', SHARED_IN_NORM)
        for d, ksel, extra in ((2048, 0, False), (4096, 0, False), (2048, 8, False),
                               (4096, 8, True)):  # fmt: skip
            flags = {"BD": d, "ADD": True, "KSEL": ksel, "QUANT": True, "RN": True}
            flags |= {"LORA": lo, "BRL": triton_ops.NORM_LORA_ROWS, "EXTRA": extra}
            cases.append((triton_ops._rms_norm, norm, flags, triton_ops.norm_warps(d)))
    for kv, g in ((8, 4), (4, 8)):  # Llama-3-8B, Qwen3-30B-A3B
        heads = {"NQ": kv * g, "NKV": kv, "HD": 128, "ROT": 128, "NEOX": kv == 4, "NORM": kv == 4}
        cases.append((triton_rope._rope_qkv, rope, {**heads, "BP": 64, "BD": 128}, 1))
        bj = 32 if g == 4 else 16
        geo = {"CHUNK": bj, "KV": kv, "G": g, "GP": g, "D": 128, "DV": 128, "BJ": bj}
        cases.append(
            (triton_decode._split_kernel, split, {**geo, "HAS_PAD": True, "CAP": False}, 4)
        )
        for bj, exact in itertools.product((16, 32, 64), (True, False)):  # tensor-core split
            dot = {**geo, "CHUNK": bj, "BJ": bj, "GH": 16, "HAS_PAD": True, "CAP": False}
            cases.append((triton_decode._split_dot_kernel, split, {**dot, "EXACT": exact}, 4))
        for quant, lo, part in ((False, False, False), (True, False, False), (True, True, False),
                                (True, True, True)):  # fmt: skip
            # the o-proj's quantized rows (`COMBINE_QUANT`), its LoRA shrink (shares: PART)
            geo = {"KV": kv, "G": g, "GP": g, "DV": 128, "CB": 64, "NSP": 64, "QUANT": quant}
            geo |= {"RN": True, "LORA": lo, "BRS": 8, "PART": part}
            geo |= {"APF": triton_decode.COMBINE_LORA_PREFETCH}
            cases.append((triton_decode._combine_kernel, comb, geo, 4))
    gemv = {"x8_ptr": I32, "xd_ptr": F32, "out_ptr": F32, "part_ptr": F32, "cnt_ptr": I32}
    gemv |= {"ids_ptr": I64} | dict.fromkeys(("M", "N", "K", "nb", "XDIV", "P"), "i32")
    gemv |= GEMV_LORA  # the LoRA epilogue's arguments (LR=0 here: compiled out)
    q4k = {"x8_ptr": I32, "xd_ptr": F32, "xsum_ptr": F32, "qs_ptr": I32, "hdr_ptr": I32} | gemv
    q6k = {"x8_ptr": I32, "xd_ptr": F32, "s16_ptr": I32, "ql_ptr": I32, "qh_ptr": I32} | gemv
    q6k |= {"sc_ptr": I32, "d_ptr": "*fp16"}
    q8 = {"x8_ptr": I32, "xd_ptr": F32, "qs_ptr": I32, "d_ptr": "*fp16", "qh_ptr": I32} | gemv
    for fn, sig, q5 in ((triton_dp4a._gemv_q4k_packed, q4k, None),
                        (triton_dp4a._gemv_q6k_packed, q6k, None),
                        (triton_dp4a._gemv_q8_0_packed, q8, False),
                        (triton_dp4a._gemv_q8_0_packed, q8, True)):  # fmt: skip
        order = [n for n in fn.arg_names if n in sig]
        for moe, warps in ((False, 1), (False, 2), (True, 2)):  # `packed_config`'s choices
            geo = {
                "spb": 4,
                "SPLIT": 4,
                "MP": 1,
                "BN": 64,
                "ASM": True,
                "MOE": moe,
                "PF": True,
                "LATE": True,
                "LR": 0,
                "LS": False,
                "NPC": 0,
                "LPS": 0,
                "LE": False,
                "STAGES": 1,
            }
            if q5 is not None:  # Q8_0's kernel over Q5_0 planes (`widen.NATIVE_Q5_0`)
                geo["Q5"] = q5
            cases.append((fn, {n: sig[n] for n in order}, geo, warps))
    comb_sig = {"y_ptr": F32, "w_ptr": F32, "out_ptr": F32, "D": "i32"}
    cases.append((triton_combine._combine, comb_sig, {"KSEL": 8, "BD": 1024}, 4))
    hand = dict.fromkeys(("x_ptr", "w_ptr", "rows_ptr", "cw_ptr"), F32)
    hand |= {"ids_ptr": I32, "cids_ptr": I64, "flags_ptr": I32, "i": "i32", "seq_ptr": I32}
    hand |= dict.fromkeys(("T", "D", "K", "G", "sx", "sw", "si"), "i32")
    take = {"yg_ptr": F32, "y_ptr": F32, "out_ptr": F32, "flags_ptr": I32, "i": "i32"}
    take |= {"seq_ptr": I32, "waits_ptr": I32, "errors_ptr": I32, "N": "i32"}
    # Q8_0's grouped GEMM and bf16 dequant, over Q8_0 and Q5_0 planes (`widen.NATIVE_Q5_0`)
    grp = {"x8_ptr": "*i8", "xd_ptr": F32, "sid_ptr": I32, "bexp_ptr": I32, "qs_ptr": I32}
    grp |= {"d_ptr": "*fp16", "qh_ptr": I32, "out_ptr": F32, "N": "i32", "K": "i32"}
    grp |= {"ADIV": "i32"}
    deq = {"qs_ptr": I32, "d_ptr": "*fp16", "qh_ptr": I32, "out_ptr": "*bf16", "N": "i32"}
    deq |= {"NB": "i32", "E0": "i32"}
    for q5 in (False, True):
        geo = {"NB": 44, "BM": 32, "BN": 128, "Q5": q5}
        cases.append((triton_grouped._grouped_q8_0, grp, geo, 4))
        cases.append((triton_unpack._deq_q8_0_packed, deq, {"BN": 64, "BB": 4, "Q5": q5}, 2))
    # Mamba-2's decode (`granitehybrid.FUSED_MIXER`): the conv step with dt's softplus, the gated
    # norm writing ssm_out's int8 rows; Granite-4.0-H-Tiny: 3,328 conv channels, 48 heads, 3,072
    conv = dict.fromkeys(("x_ptr", "w_ptr", "b_ptr", "state_ptr", "y_ptr", "dt_ptr"), F32)
    conv |= {"dtb_ptr": F32, "dto_ptr": F32, "slot_ptr": I64, "fresh_ptr": "*i8"}
    conv |= {"q_ptr": I32, "qd_ptr": F32, "s16_ptr": I32, "xs_ptr": F32}
    conv |= dict.fromkeys(("C", "SX", "H"), "i32")
    for dt in (False, True):
        geo = {"K": 4, "HAS_BIAS": True, "SILU": True, "SLOTS": True, "GATED": False}
        geo |= {"BLOCK_C": 256, "DT": dt, "BLOCK_H": 64, "QUANT": False, "RN": True}
        cases.append((triton_step._conv_step_kernel, conv, geo, 4))
    for quant in (False, True):  # LFM2's gated step, out_proj's int8 rows (`lfm2.CONV_QUANT`)
        geo = {"K": 3, "HAS_BIAS": False, "SILU": False, "SLOTS": True, "GATED": True}
        geo |= {"BLOCK_C": 256, "DT": False, "BLOCK_H": 1, "QUANT": quant, "RN": True}
        cases.append((triton_step._conv_step_kernel, conv, geo, 4))
    gate = dict.fromkeys(("y_ptr", "x_ptr", "d_ptr", "z_ptr", "w_ptr", "o_ptr", "qd_ptr"), F32)
    gate |= {"q_ptr": I32, "s16_ptr": I32, "xs_ptr": F32, "eps": "fp32"}
    gate |= dict.fromkeys(("SX", "SZ", "P", "W"), "i32")
    for quant in (False, True):
        geo = {"BW": 4096, "QUANT": quant, "RN": True}
        cases.append((triton_gated_norm._skip_gate_norm, gate, geo, 8))
    # Qwen3-Next (`qwen3next.FUSED_NORMS`): the gated norm writing ssm_out's int8 rows (heads of
    # 128), the block end summing the shared expert gate's logit (2,048 wide)
    ng = dict.fromkeys(("o_ptr", "z_ptr", "w_ptr", "y_ptr", "qd_ptr", "xs_ptr"), F32)
    ng |= {"q_ptr": I32, "s16_ptr": I32, "SZ": "i32", "H": "i32", "D": "i32", "eps": "fp32"}
    ga = dict.fromkeys(("x_ptr", "y_ptr", "s_ptr", "g_ptr", "o_ptr", "h_ptr"), F32) | {"D": "i32"}
    for on in (False, True):
        cases.append((triton_recurrent._norm_gate, ng, {"BD": 128, "QUANT": on, "RN": True}, 4))
        cases.append((triton_ops._gated_add, ga, {"BD": 1024, "DOT": on}, 4))
    cases.append((host_flags._hand_out, hand, {"BLOCK": 1024}, 4))
    cases.append((host_flags._take_back, take, {"LIMIT": 1 << 20, "BLOCK": 2048}, 4))
    for fn, sig, const, warps in cases:
        if "PDL" not in fn.arg_names:  # (no PDL variants)
            keys = ("Q5", "DT", "QUANT", "GATED", "DOT")
            shown = {k: v for k, v in const.items() if k in keys}
            print(f"{fn.__name__} {shown} x {warps} warps: {compile_one(fn, sig, const, warps)}")
            continue
        const = {**const, "PDL": pdl}
        keys = ("BD", "NQ", "NKV", "G", "BJ", "QUANT", "EXACT", "MOE", "LORA", "Q5", "KSEL")
        keys += ("EXTRA",)
        shown = {k: v for k, v in const.items() if k in keys}
        print(f"{fn.__name__} {shown} x {warps} warps: {compile_one(fn, sig, const, warps)}")


if __name__ == "__main__":
    if "--batch" in sys.argv:
        batch_gemms()
    else:
        main(pdl="--pdl" in sys.argv)
