/* A decode step of a pre-norm decoder (llama's block: RMSNorm -> q/k/v -> rope -> attention over
 * the paged KV cache -> output projection -> residual; RMSNorm -> gate/up -> SiLU or tanh-GELU
 * product -> down -> residual; LFM2's gated short convolution, Granite-4.0-H's Mamba-2 mixer or
 * Qwen3-Next's Gated DeltaNet in place of attention in some layers) for t token rows, each the
 * one new token of its own sequence, all layers in one call and one OpenMP region (worksharing
 * loops and their barriers between the stages): eager torch spent ~20 dispatched ops per layer
 * on what is a few microseconds of work. The linears are block_linear.c's (the file's blocks,
 * int8 activations); the rest is float32. kernels/cpu/decode_step.py lays the model out in
 * these structs and holds the torch reference. */
#include "block_linear.c"

typedef struct {
    int64_t type, nparts;
    const uint8_t *const *parts;
    const int64_t *rows;
    int64_t n; /* output columns (the parts' rows together) */
} lin_t;

enum { MAX_GROUPS = 3 };

typedef struct {
    lin_t qkv[MAX_GROUPS]; /* q | k | v side by side: runs of one type each */
    int64_t n_qkv;
    lin_t o;
    lin_t gu[MAX_GROUPS]; /* gate | up */
    int64_t n_gu;
    lin_t down;
    const float *attn_norm, *ffn_norm;
    void *k_cache, *v_cache; /* [blocks, block_size, n_kv, head_dim], float32 or float16 */
    /* Gemma 3's extras, NULL / 0 where a family has none: per-head q and k norms, norms of the
     * attention's and the MLP's outputs before their residual adds, a sliding window (keys of
     * the last `window` positions), and which rope table the layer rotates with (0 or 1) */
    const float *q_norm, *k_norm, *post_attn_norm, *post_ffn_norm;
    int64_t window, rope_set;
    /* Qwen2's q | k | v biases [(n_q + 2 n_kv) hd], added before the q/k norms and rope; NULL:
     * none (last in the struct: decode_step.py's _Layer mirrors this layout) */
    const float *qkv_bias;
    /* LFM2's short-convolution layers (conv_w non-NULL): qkv[0] is in_proj (B | C | x, 3 x dim
     * outputs), o is out_proj, conv_w [dim, conv_taps] the depthwise taps, conv_state [slots + 1,
     * conv_taps - 1, dim] each sequence's last inputs (engine/runtime/recurrent_state), updated
     * in place at the row's state slot; no KV cache */
    const float *conv_w;
    float *conv_state;
    int64_t conv_taps;
    /* Qwen3-MoE's routed experts in place of the gated MLP where n_expert > 0 (decode_moe.h):
     * router [n_expert, dim] float32; gate / up [n_expert, exp_ff] and down [n_expert, dim] rows
     * of raw blocks, of exp_types (gate, up, down; gate's and up's alike) */
    const float *router;
    const uint8_t *exp_gate, *exp_up, *exp_down;
    int64_t exp_types[3], n_expert, n_used, exp_ff, norm_topk;
    int32_t *ids_out; /* the step's expert ids [t, n_used] copied out (the lookup counters) */
    /* gpt-oss's extras, NULL / 0 where a family has none: the attention output's bias [dim],
     * per-head sink logits [n_q] (each head's softmax denominator gains exp(sink)), the router's
     * bias [n_expert], the experts' biases (gate and up [n_expert, exp_ff], down [n_expert,
     * dim]) and their activation (exp_act 0: SiLU; 1: the clamped SwiGLU, decode_moe.h) */
    const float *o_bias, *sinks, *router_bias, *exp_bias_g, *exp_bias_u, *exp_bias_d;
    int64_t exp_act;
    /* A dense layer's own MLP width where the model's (m->hidden) is wider (GLM's and LFM2-MoE's
     * leading dense layers beside wider MoE ones); 0: the model's. DeepSeek-style routing
     * (GLM-4.5, LFM2-MoE): scoring 1 takes sigmoid scores, probs_bias [n_expert] (or NULL)
     * shifts only the choice, the chosen scores (renormalised with norm_topk) times w_scale
     * weigh the experts; shared experts (GLM's): sh_gu / sh_down of sh_ff columns, SiLU, added to
     * the routed sum (n_sh_gu 0: none) */
    int64_t hidden, scoring;
    const float *probs_bias;
    double w_scale;
    lin_t sh_gu[MAX_GROUPS];
    int64_t n_sh_gu;
    lin_t sh_down;
    int64_t sh_ff;
    /* Granite-4.0-H's Mamba-2 layers where ssm_h > 0 (recurrent_rows.h's mamba2_rows): qkv[0] is
     * the in-projection (z | x B C | dt), o the out-projection, conv_w / conv_state / conv_taps
     * the conv's over x B C, conv_b its bias [Cc] (or NULL); ssm_dt_b, ssm_a, ssm_d [H],
     * ssm_norm [H P] (groups of H P / G), ssm_state [slots + 1, H, P, N]; no KV cache */
    const float *conv_b, *ssm_dt_b, *ssm_a, *ssm_d, *ssm_norm;
    float *ssm_state;
    int64_t ssm_h, ssm_p, ssm_n, ssm_g;
    /* OLMo 2: q_norm / k_norm span all of q's / k's heads (n_q hd / n_kv hd weights), not one
     * head's; its blocks have no input norms (attn_norm / ffn_norm NULL: the stream itself) */
    int64_t qk_full;
    /* Qwen3-Next: q_gate, the q projection gives each head's query and output gate side by side
     * (the attention output times sigmoid(gate)); sh_gate [dim] (or NULL), the shared expert's
     * output times sigmoid(sh_gate . h); Gated DeltaNet layers where dn_hv > 0
     * (recurrent_rows.h's delta_rows): qkv holds q k v | z | b a side by side, o the
     * out-projection, conv_w / conv_state / conv_taps the conv's over q k v, ssm_dt_b and ssm_a
     * [Hv], ssm_norm [Dv], ssm_state [slots + 1, Hv, Dk, Dv]; dn_grouped: q k v z come grouped
     * per key head (an older file's one ssm_in), reordered before the mixer */
    int64_t q_gate;
    const float *sh_gate;
    int64_t dn_hk, dn_hv, dn_dk, dn_dv, dn_grouped;
} layer_t;

typedef struct {
    int64_t n_layers, dim, n_q, n_kv, hd, hidden, rope_dims, neox, kv_f16, block_size, act;
    double eps, scale;
    const layer_t *layers;
    double res_scale; /* the blocks' outputs times this into the stream (Granite's; else 1) */
    double softcap;   /* attention scores capped to cap * tanh(s / cap) (Gemma 2's; 0: none) */
} model_t;

#include "decode_moe.h"
#include "recurrent_rows.h"
#include "decode_attention.h"

/* h = x / rms(x) * w, one row; w NULL: h = x (a block without that norm) */
static void rms_norm_row(const float *x, const float *w, int64_t n, double eps, float *h) {
    if (!w) {
        if (h != x) memcpy(h, x, n * sizeof(float));
        return;
    }
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < n; j++) ss += x[j] * x[j];
    const float inv = 1.f / sqrtf(ss / (float)n + (float)eps);
#pragma omp simd
    for (int64_t j = 0; j < n; j++) h[j] = x[j] * inv * w[j];
}

/* Qwen3-Next's query row [q0 g0 q1 g1 .. | k | v] (each head's query and gate side by side) as
 * [q | k | v | g], in place; tmp: n_q hd floats */
static void split_q_gate(float *row, int64_t nq, int64_t nkv, int64_t hd, float *tmp) {
    for (int64_t h = 0; h < nq; h++) memcpy(tmp + h * hd, row + (2 * h + 1) * hd, hd * sizeof(float));
    for (int64_t h = 1; h < nq; h++) memmove(row + h * hd, row + 2 * h * hd, hd * sizeof(float));
    memmove(row + nq * hd, row + 2 * nq * hd, 2 * nkv * hd * sizeof(float));
    memcpy(row + (nq + 2 * nkv) * hd, tmp, nq * hd * sizeof(float));
}

/* An older Qwen3-Next file's ssm_in row, q k v z grouped per key head (each head's q and k, Dk
 * each, then the vz values of v and of z of the value heads it serves), as [q | k | v | z]
 * across the heads, in place; tmp: Hk (2 Dk + 2 vz) floats */
static void ungroup_qkvz(float *row, int64_t hk, int64_t dk, int64_t vz, float *tmp) {
    const int64_t g = 2 * dk + 2 * vz, at[4] = {0, hk * dk, 2 * hk * dk, 2 * hk * dk + hk * vz};
    memcpy(tmp, row, hk * g * sizeof(float));
    for (int64_t h = 0; h < hk; h++) {
        const float *src = tmp + h * g;
        memcpy(row + at[0] + h * dk, src, dk * sizeof(float));
        memcpy(row + at[1] + h * dk, src + dk, dk * sizeof(float));
        memcpy(row + at[2] + h * vz, src + 2 * dk, vz * sizeof(float));
        memcpy(row + at[3] + h * vz, src + 2 * dk + vz, vz * sizeof(float));
    }
}

/* a linear's groups, each quantizing x for its own type, outputs side by side in y [t, ldy] */
static void linear_groups(const lin_t *g, int64_t ng, const float *x, int64_t ldx, int64_t t,
                          int64_t k, float *y, int64_t ldy, int8_t *q8, float *d8, int16_t *bs) {
    int64_t col = 0;
    for (int64_t i = 0; i < ng; i++) {
        quantize_rows((int)g[i].type, x, ldx, t, k, q8, d8, bs);
        rows_dot((int)g[i].type, g[i].nparts, g[i].parts, g[i].rows, k, t, q8, d8, bs, y + col, ldy);
        col += g[i].n;
    }
}

#include "decode_lora.h"

enum { ACT_PIECE = 1024 }; /* columns of the gate product per work item */


enum { CONV_PIECE = 512 }; /* channels per short-conv work item */

/* LFM2's gated short conv for channels [c0, c1) of one row: bx = B x, y = the causal conv of the
 * carried inputs and bx (in torch's order: tap products summed first to last), the state shifted
 * by one with bx at its end, out = C y. bcx: the row's in_proj outputs [3 dim]. */
static void short_conv_row(const layer_t *L, int64_t dim, const float *bcx, float *st, float *out,
                           int64_t c0, int64_t c1) {
    const int64_t taps = L->conv_taps;
    const float *b = bcx, *cg = bcx + dim, *xv = bcx + 2 * dim;
    for (int64_t c = c0; c < c1; c++) {
        const float bx = b[c] * xv[c];
        const float *w = L->conv_w + c * taps;
        float y = st[c] * w[0];
        for (int64_t k = 1; k < taps - 1; k++) y += st[k * dim + c] * w[k];
        y += bx * w[taps - 1];
        for (int64_t k = 0; k < taps - 2; k++) st[k * dim + c] = st[(k + 1) * dim + c];
        st[(taps - 2) * dim + c] = bx;
        out[c] = cg[c] * y;
    }
}

/* y [t, dim] = down(act(gate(h)) x up(h)) over h [t, dim], ff columns: gate|up's groups gu (into
 * the scratch g [t, 2 ff]), act 0 SiLU / 1 tanh-GELU, LoRA adapters on gate|up and down (or NULL).
 * Inside the parallel region; y may be h (read before it is written). */
static void gated_mlp(const lin_t *gu, int64_t ngu, const lin_t *down, int64_t ff, int64_t act,
                      const float *h, int64_t dim, int64_t t, float *g, float *y, int8_t *q8,
                      float *d8, int16_t *bs, const lora_t *lora_gu, const lora_t *lora_down) {
    linear_groups(gu, ngu, h, dim, t, dim, g, 2 * ff, q8, d8, bs);
    lora_add(lora_gu, h, dim, t, dim, g, 2 * ff);
    /* the product in the gate's place, in pieces of ACT_PIECE columns (one decode row's 8192
     * SiLUs took ~27 us on one thread while the others waited) */
    const int64_t npc = (ff + ACT_PIECE - 1) / ACT_PIECE;
#pragma omp for schedule(static)
    for (int64_t pc = 0; pc < t * npc; pc++) {
        const int64_t i = pc / npc, j0 = pc % npc * ACT_PIECE;
        const int64_t j1 = j0 + ACT_PIECE < ff ? j0 + ACT_PIECE : ff;
        float *gi = g + i * 2 * ff, *u = gi + ff;
        for (int64_t j = j0; j < j1; j++) {
            const float v = gi[j];
            const float a = act == 0 ? v / (1.f + expf(-v))
                                     : 0.5f * v * (1.f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
            gi[j] = a * u[j];
        }
    }
    linear_groups(down, 1, g, 2 * ff, t, ff, y, dim, q8, d8, bs);
    lora_add(lora_down, g, 2 * ff, t, ff, y, dim);
}

/* x [t, dim]: the token rows' embeddings in, the stream after the last layer out (the caller
 * applies the final norm). cos0 / sin0 [t, rope_dims / 2]: the rope table of layers with rope_set
 * 0, cos1 / sin1 of those with 1 (Gemma 3's local layers); slots [t] (cache slot of each row's
 * token); seq_lens [t] (its context after this step); tables [t, table_stride] (its blocks).
 * Scratch (floats unless said): h [t*dim], qkv [t*(n_q+2 n_kv)*hd], att [t*n_q*hd],
 * gu [t*2*hidden], y [t*dim], q8 int8 [t*kmax], d8 [t*kmax/32], bs int16 [t*kmax/16] (kmax =
 * the widest linear input), sc [threads * sc_stride], sc_stride >= min(group, MAX_GROUP) x (max
 * seq_len) + head_dim. With short-conv layers: qkv holds [t*3*dim], att [t*dim], and state_slots
 * [t] names each row's recurrent state slot (NULL where the model has none); with Mamba-2 layers
 * qkv holds [t*(Din+Cc+H)], att [t*Din] and gu [t*Cc] too; with Gated DeltaNet layers qkv
 * [t*(Cc+Hv Dv+2 Hv)], att [t*Hv Dv] and gu [t*Cc]; with gated queries (Qwen3-Next's) qkv
 * [t*(2 n_q+2 n_kv)*hd]. */
void decode_step(const model_t *m, int64_t t, float *x, const float *cos0, const float *sin0,
                 const float *cos1, const float *sin1, const int64_t *slots, const int64_t *seq_lens, const int64_t *tables,
                 int64_t table_stride, float *h, float *qkv, float *att, float *gu, float *y,
                 int8_t *q8, float *d8, int16_t *bs, float *sc, int64_t sc_stride, int threads,
                 const int64_t *state_slots, float *moe) {
    const int64_t dim = m->dim, hd = m->hd, nq = m->n_q, nkv = m->n_kv, hidden = m->hidden;
    const int64_t nqkv = (nq + 2 * nkv) * hd, group = nq / nkv;
    /* a KV head's query heads in pieces of `per` (<= MAX_GROUP), more pieces where one row's KV
     * heads are fewer than the threads (each piece reads the KV rows once) */
    int64_t nsplit = 1;
    while ((group / nsplit > MAX_GROUP || t * nkv * nsplit < threads) && group % (2 * nsplit) == 0)
        nsplit *= 2;
    if (group / nsplit > MAX_GROUP) nsplit = group;
    const int64_t per = group / nsplit;
    const lora_t *const *lora = step_lora; /* (thread-local: read here, shared below) */
    const float rs = (float)m->res_scale;
    uint8_t not_fresh[t > 0 ? t : 1]; /* decode rows: every state slot holds its sequence's */
    memset(not_fresh, 0, sizeof not_fresh);
    float shg[t > 0 ? t : 1]; /* each row's shared-expert gate (Qwen3-Next's) */
#pragma omp parallel num_threads(threads)
    {
        int id = 0;
#ifdef _OPENMP
        id = omp_get_thread_num();
#endif
        float *mysc = sc + id * sc_stride;
        for (int64_t l = 0; l < m->n_layers; l++) {
            const layer_t *L = &m->layers[l];
#pragma omp for schedule(static)
            for (int64_t i = 0; i < t; i++) rms_norm_row(x + i * dim, L->attn_norm, dim, m->eps, h + i * dim);
            if (L->dn_hv) { /* Qwen3-Next: in-projections -> Gated DeltaNet mixer -> out-projection */
                const int64_t vd = L->dn_hv * L->dn_dv, cc = 2 * L->dn_hk * L->dn_dk + vd;
                const int64_t lin = cc + vd + 2 * L->dn_hv;
                linear_groups(L->qkv, L->n_qkv, h, dim, t, dim, qkv, lin, q8, d8, bs);
                if (L->dn_grouped) {
#pragma omp for schedule(static)
                    for (int64_t i = 0; i < t; i++) {
                        float tmp[cc + vd];
                        ungroup_qkvz(qkv + i * lin, L->dn_hk, L->dn_dk, vd / L->dn_hk, tmp);
                    }
                }
                delta_rows(t, qkv, lin, L->conv_w, L->conv_taps, L->conv_state, L->ssm_dt_b, L->ssm_a,
                           L->ssm_norm, (float)m->eps, L->ssm_state, state_slots, not_fresh, L->dn_hk,
                           L->dn_hv, L->dn_dk, L->dn_dv, gu, att);
                linear_groups(&L->o, 1, att, vd, t, vd, y, dim, q8, d8, bs);
            } else if (L->ssm_h) { /* Granite-4.0-H: in-projection -> Mamba-2 mixer -> out-projection */
                const int64_t H = L->ssm_h, din = H * L->ssm_p, cc = din + 2 * L->ssm_g * L->ssm_n;
                linear_groups(L->qkv, L->n_qkv, h, dim, t, dim, qkv, din + cc + H, q8, d8, bs);
                mamba2_rows(t, qkv, L->conv_w, L->conv_b, L->conv_taps, L->conv_state, L->ssm_dt_b,
                            L->ssm_a, L->ssm_d, L->ssm_norm, (float)m->eps, L->ssm_state,
                            state_slots, not_fresh, H, L->ssm_p, L->ssm_n, L->ssm_g, gu, att);
                linear_groups(&L->o, 1, att, din, t, din, y, dim, q8, d8, bs);
            } else if (L->conv_w) { /* LFM2: in_proj -> gated short conv -> out_proj */
                const int64_t npc = (dim + CONV_PIECE - 1) / CONV_PIECE, cs = (L->conv_taps - 1) * dim;
                linear_groups(L->qkv, L->n_qkv, h, dim, t, dim, qkv, 3 * dim, q8, d8, bs);
#pragma omp for schedule(static)
                for (int64_t p = 0; p < t * npc; p++) {
                    const int64_t i = p / npc, c0 = p % npc * CONV_PIECE;
                    short_conv_row(L, dim, qkv + i * 3 * dim, L->conv_state + state_slots[i] * cs,
                                   att + i * dim, c0, c0 + CONV_PIECE < dim ? c0 + CONV_PIECE : dim);
                }
                linear_groups(&L->o, 1, att, dim, t, dim, y, dim, q8, d8, bs);
            } else { /* attention */
                const int64_t ldq = nqkv + (L->q_gate ? nq * hd : 0); /* Qwen3-Next's gates after v */
                linear_groups(L->qkv, L->n_qkv, h, dim, t, dim, qkv, ldq, q8, d8, bs);
                if (lora) lora_add(lora[4 * l], h, dim, t, dim, qkv, ldq);
#pragma omp for schedule(static)
                for (int64_t i = 0; i < t; i++) { /* bias, rope q and k, write k and v at the row's slot */
                    float *row = qkv + i * ldq;
                    if (L->q_gate) {
                        float tmp[nq * hd];
                        split_q_gate(row, nq, nkv, hd, tmp);
                    }
                    if (L->qkv_bias)
                        for (int64_t j = 0; j < nqkv; j++) row[j] += L->qkv_bias[j];
                    const int64_t at = i * (m->rope_dims / 2);
                    const float *c = (L->rope_set ? cos1 : cos0) + at, *s = (L->rope_set ? sin1 : sin0) + at;
                    if (L->qk_full) { /* OLMo 2: each norm over all of q's or k's heads */
                        rms_norm_row(row, L->q_norm, nq * hd, m->eps, row);
                        rms_norm_row(row + nq * hd, L->k_norm, nkv * hd, m->eps, row + nq * hd);
                    }
                    for (int64_t hh = 0; hh < nq + nkv; hh++) {
                        const float *hn = L->qk_full ? NULL : hh < nq ? L->q_norm : L->k_norm;
                        if (hn) rms_norm_row(row + hh * hd, hn, hd, m->eps, row + hh * hd);
                        rope_head(row + hh * hd, c, s, m->rope_dims, m->neox);
                    }
                    const float *kr = row + nq * hd, *vr = kr + nkv * hd;
                    const int64_t cat = slots[i] * nkv * hd;
                    if (m->kv_f16) {
                        uint16_t *kc = (uint16_t *)L->k_cache + cat, *vc = (uint16_t *)L->v_cache + cat;
                        for (int64_t j = 0; j < nkv * hd; j++) kc[j] = float_to_half(kr[j]), vc[j] = float_to_half(vr[j]);
                    } else {
                        memcpy((float *)L->k_cache + cat, kr, nkv * hd * sizeof(float));
                        memcpy((float *)L->v_cache + cat, vr, nkv * hd * sizeof(float));
                    }
                }
#pragma omp for schedule(dynamic, 1)
                for (int64_t p = 0; p < t * nkv * nsplit; p++) { /* (row, KV head, piece of its group) */
                    const int64_t i = p / (nkv * nsplit), g = p / nsplit % nkv, h0 = g * group + p % nsplit * per;
                    attend_group(m, L, qkv + i * ldq + h0 * hd, per, g, seq_lens[i],
                                 tables + i * table_stride, att + i * nq * hd + h0 * hd, mysc,
                                 mysc + sc_stride - hd, L->sinks ? L->sinks + h0 : NULL);
                }
                if (L->q_gate) {
#pragma omp for schedule(static)
                    for (int64_t i = 0; i < t; i++) {
                        const float *gt = qkv + i * ldq + nqkv;
                        float *a = att + i * nq * hd;
                        for (int64_t j = 0; j < nq * hd; j++) a[j] *= 1.f / (1.f + expf(-gt[j]));
                    }
                }
                linear_groups(&L->o, 1, att, nq * hd, t, nq * hd, y, dim, q8, d8, bs);
                if (lora) lora_add(lora[4 * l + 1], att, nq * hd, t, nq * hd, y, dim);
            }
#pragma omp for schedule(static)
            for (int64_t i = 0; i < t; i++) {
                float *yi = y + i * dim;
                if (L->o_bias)
                    for (int64_t j = 0; j < dim; j++) yi[j] += L->o_bias[j];
                if (L->post_attn_norm) rms_norm_row(yi, L->post_attn_norm, dim, m->eps, yi);
                for (int64_t j = 0; j < dim; j++) x[i * dim + j] += rs * yi[j];
                rms_norm_row(x + i * dim, L->ffn_norm, dim, m->eps, h + i * dim);
            }
            if (L->n_expert) {
                moe_ffn_rows(L, dim, t, h, gu, y, q8, d8, bs, moe);
                if (L->n_sh_gu) { /* the shared experts on h, their output in h's place, added */
                    if (L->sh_gate) { /* Qwen3-Next's: times sigmoid(sh_gate . h), taken before */
#pragma omp for schedule(static)
                        for (int64_t i = 0; i < t; i++) {
                            float s = 0.f;
                            for (int64_t j = 0; j < dim; j++) s += h[i * dim + j] * L->sh_gate[j];
                            shg[i] = 1.f / (1.f + expf(-s));
                        }
                    }
                    gated_mlp(L->sh_gu, L->n_sh_gu, &L->sh_down, L->sh_ff, 0, h, dim, t, gu, h, q8, d8, bs,
                              NULL, NULL);
                    if (L->sh_gate) {
#pragma omp for schedule(static)
                        for (int64_t i = 0; i < t; i++)
                            for (int64_t j = 0; j < dim; j++) y[i * dim + j] += shg[i] * h[i * dim + j];
                    } else {
#pragma omp for schedule(static)
                        for (int64_t i = 0; i < t; i++)
                            for (int64_t j = 0; j < dim; j++) y[i * dim + j] += h[i * dim + j];
                    }
                }
            } else {
                gated_mlp(L->gu, L->n_gu, &L->down, L->hidden ? L->hidden : hidden, m->act, h, dim, t,
                          gu, y, q8, d8, bs, lora ? lora[4 * l + 2] : NULL, lora ? lora[4 * l + 3] : NULL);
            }
#pragma omp for schedule(static)
            for (int64_t i = 0; i < t; i++) {
                float *yi = y + i * dim;
                if (L->post_ffn_norm) rms_norm_row(yi, L->post_ffn_norm, dim, m->eps, yi);
                for (int64_t j = 0; j < dim; j++) x[i * dim + j] += rs * yi[j];
            }
        }
    }
}

/* Attention of nd single-token rows over their paged context, the step's own attend_group (so a
 * row's bits depend on its sequence alone, wherever it sits in the batch: torch's batched
 * matmuls do not promise that). q / out [nd, n_q, hd]; caches [blocks, block_size, n_kv, hd]
 * float32 or float16; seq_lens [nd]; tables [nd, table_stride]; sc as decode_step's. */
void paged_decode(int64_t nd, const float *q, const void *k_cache, const void *v_cache,
                  int64_t kv_f16, int64_t n_q, int64_t n_kv, int64_t hd, int64_t block_size,
                  double scale, int64_t window, const int64_t *seq_lens, const int64_t *tables,
                  int64_t table_stride, float *out, float *sc, int64_t sc_stride, int threads) {
    model_t m = {0};
    layer_t L = {0};
    m.n_q = n_q, m.n_kv = n_kv, m.hd = hd, m.block_size = block_size, m.kv_f16 = kv_f16;
    m.scale = scale;
    L.k_cache = (void *)k_cache, L.v_cache = (void *)v_cache, L.window = window;
    const int64_t group = n_q / n_kv;
    int64_t nsplit = 1; /* as decode_step: pieces of <= MAX_GROUP heads, enough for the threads */
    while ((group / nsplit > MAX_GROUP || nd * n_kv * nsplit < threads) && group % (2 * nsplit) == 0)
        nsplit *= 2;
    if (group / nsplit > MAX_GROUP) nsplit = group;
    const int64_t per = group / nsplit;
#pragma omp parallel num_threads(threads)
    {
        int id = 0;
#ifdef _OPENMP
        id = omp_get_thread_num();
#endif
        float *mysc = sc + id * sc_stride;
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < nd * n_kv * nsplit; p++) {
            const int64_t i = p / (n_kv * nsplit), g = p / nsplit % n_kv, h0 = g * group + p % nsplit * per;
            attend_group(&m, &L, q + (i * n_q + h0) * hd, per, g, seq_lens[i],
                         tables + i * table_stride, out + (i * n_q + h0) * hd, mysc,
                         mysc + sc_stride - hd, NULL);
        }
    }
}
