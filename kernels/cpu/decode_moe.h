/* The routed-expert FFN of a decode step's MoE layers (Qwen3-MoE's, Mixtral's and gpt-oss's: a
 * float32 router (with a bias or not), softmax over every expert, the top k, their weights
 * renormalised (or not); SiLU experts or gpt-oss's biased ones with the clamped SwiGLU; no shared
 * expert), as worksharing loops inside decode_step's parallel region, where the torch layers
 * spent ~0.35 ms a layer on routing, index tensors and wrappers around the same kernels (gpt-oss:
 * ~1 ms). Included by decode_step.c after its layer_t; the experts' linears are block_linear.c's
 * row dots. */
#ifndef LOCALLLM_DECODE_MOE_H
#define LOCALLLM_DECODE_MOE_H

/* gpt-oss's clamped SwiGLU (kernels/moe/experts.py's SWIGLU_OAI_LIMIT / _ALPHA) */
#define SWIGLU_LIMIT 7.0f
#define SWIGLU_ALPHA 1.702f

/* The step's (row, expert) pairs in runs of up to ROWS_MAX pairs of one expert: order [P] the
 * pairs by expert (a counting sort, stable), run [n + 1] where each run starts in `order`; n. A
 * weight row is then decoded once for every pair of its run (rows of other sequences routed to
 * the same expert in a batched step); a pair's bits do not depend on its run (row_dots). */
static int64_t expert_runs(const int32_t *ids, int64_t P, int64_t E, int32_t *count,
                           int32_t *order, int32_t *run) {
    for (int64_t e = 0; e <= E; e++) count[e] = 0;
    for (int64_t p = 0; p < P; p++) count[ids[p] + 1]++;
    for (int64_t e = 0; e < E; e++) count[e + 1] += count[e];
    for (int64_t p = 0; p < P; p++) order[count[ids[p]]++] = (int32_t)p;
    int64_t n = 0;
    for (int64_t a = 0; a < P;) {
        int64_t b = a + 1;
        while (b < P && b - a < ROWS_MAX && ids[order[b]] == ids[order[a]]) b++;
        run[n++] = (int32_t)a;
        a = b;
    }
    run[n] = (int32_t)P;
    return n;
}

/* Weight row w (k values of `type`) dotted with the activations of a run's R pairs, each
 * pair's row pairs[r] / div of q8 / d8 / bs (k codes a row), into out[pairs[r] * ldo]. */
static void run_dots(int type, const uint8_t *w, int64_t k, const int32_t *pairs, int R,
                     int64_t div, const int8_t *q8, const float *d8, const int16_t *bs, float *out,
                     int64_t ldo) {
    const int8_t *q[ROWS_MAX];
    const float *d[ROWS_MAX];
    const int16_t *s[ROWS_MAX];
    float o[ROWS_MAX];
    for (int r = 0; r < R; r++) {
        const int64_t a = pairs[r] / div;
        q[r] = q8 + a * k, d[r] = d8 + a * k / 32, s[r] = bs + a * k / 16;
    }
    row_dots(type, w, k, q, d, s, R, o);
    for (int r = 0; r < R; r++) out[pairs[r] * ldo] = o[r];
}

/* y [t, dim] = the weighted sum of each row's k experts on h [t, dim]; every thread calls it.
 * moe: float scratch of t * (n_expert + k * (dim + 4)) + n_expert + 2; gu [t * k * 2 ff] and
 * q8 / d8 / bs as decode_step's (sized for t * k * ff codes). */
static void moe_ffn_rows(const layer_t *L, int64_t dim, int64_t t, const float *h, float *gu,
                         float *y, int8_t *q8, float *d8, int16_t *bs, float *moe) {
    const int64_t E = L->n_expert, K = L->n_used, ff = L->exp_ff, P = t * K;
    float *logit = moe, *wts = moe + t * E, *dn = wts + 2 * t * K;
    int32_t *ids = (int32_t *)(wts + t * K), *order = (int32_t *)(dn + P * dim);
    int32_t *run = order + P, *count = run + P + 1;
    const int tg = (int)L->exp_types[0], td = (int)L->exp_types[2];
#pragma omp for schedule(static)
    for (int64_t p = 0; p < t * E; p++) {
        const float *a = h + p / E * dim, *r = L->router + p % E * dim;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < dim; j++) s += a[j] * r[j];
        logit[p] = L->router_bias ? s + L->router_bias[p % E] : s;
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < t; i++) {
        /* scores: softmax, or sigmoid (scoring 1); the top k by logit (plain softmax) or by score
         * + probs_bias, lower index first on ties; the chosen scores, renormalised (norm_topk),
         * times w_scale (where set) */
        float *l = logit + i * E;
        const int by_score = L->scoring == 1 || L->probs_bias;
        float mx = l[0], sum = 0.f, kept = 0.f;
        if (L->scoring == 0) {
            for (int64_t e = 1; e < E; e++) mx = l[e] > mx ? l[e] : mx;
            for (int64_t e = 0; e < E; e++) sum += expf(l[e] - mx);
        }
        float score[by_score ? E : 1];
        if (by_score) /* each logit's place takes its score plus the choice bias */
            for (int64_t e = 0; e < E; e++) {
                score[e] = L->scoring == 1 ? 1.f / (1.f + expf(-l[e])) : expf(l[e] - mx) / sum;
                l[e] = L->probs_bias ? score[e] + L->probs_bias[e] : score[e];
            }
        for (int64_t j = 0; j < K; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t q = 0; q < j; q++) taken |= ids[i * K + q] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            ids[i * K + j] = (int32_t)best;
            wts[i * K + j] = by_score ? score[best] : expf(l[best] - mx) / sum;
            kept += wts[i * K + j];
        }
        if (L->norm_topk)
            for (int64_t j = 0; j < K; j++) wts[i * K + j] /= kept;
        if (L->w_scale != 0.0 && L->w_scale != 1.0)
            for (int64_t j = 0; j < K; j++) wts[i * K + j] *= (float)L->w_scale;
        if (L->ids_out) memcpy(L->ids_out + i * K, ids + i * K, K * sizeof(int32_t));
    }
    int64_t nrun = 0;
#pragma omp single copyprivate(nrun)
    nrun = expert_runs(ids, P, E, count, order, run);
    /* gate | up of every (row, expert) pair: 2 ff weight rows each, a run's pairs at once */
    quantize_rows(tg, h, dim, t, dim, q8, d8, bs);
    const int64_t rg = block_row_bytes(tg, dim), rd = block_row_bytes(td, ff);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < nrun * 2 * ff; r++) {
        const int64_t c = r / (2 * ff), j = r % (2 * ff), e = ids[order[run[c]]];
        const uint8_t *w = (j < ff ? L->exp_gate : L->exp_up) + (e * ff + j % ff) * rg;
        run_dots(tg, w, dim, order + run[c], run[c + 1] - run[c], K, q8, d8, bs, gu + j, 2 * ff);
    }
#pragma omp for schedule(static)
    for (int64_t p = 0; p < P; p++) { /* act(gate) x up, in the gate's place */
        float *g = gu + p * 2 * ff, *u = g + ff;
        if (L->exp_bias_g) {
            const float *bg = L->exp_bias_g + ids[p] * ff, *bu = L->exp_bias_u + ids[p] * ff;
            for (int64_t j = 0; j < ff; j++) g[j] += bg[j], u[j] += bu[j];
        }
        if (L->exp_act == 1) /* gpt-oss: min(g, 7) sigmoid(1.702 min(g, 7)) (clamp(u, +-7) + 1) */
            for (int64_t j = 0; j < ff; j++) {
                const float a = g[j] < SWIGLU_LIMIT ? g[j] : SWIGLU_LIMIT;
                const float b = u[j] < -SWIGLU_LIMIT ? -SWIGLU_LIMIT : u[j] > SWIGLU_LIMIT ? SWIGLU_LIMIT : u[j];
                g[j] = a / (1.f + expf(-SWIGLU_ALPHA * a)) * (b + 1.f);
            }
        else
            for (int64_t j = 0; j < ff; j++) g[j] = g[j] / (1.f + expf(-g[j])) * u[j];
    }
    quantize_rows(td, gu, 2 * ff, P, ff, q8, d8, bs);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < nrun * dim; r++) {
        const int64_t c = r / dim, j = r % dim, e = ids[order[run[c]]];
        run_dots(td, L->exp_down + (e * dim + j) * rd, ff, order + run[c], run[c + 1] - run[c], 1,
                 q8, d8, bs, dn + j, dim);
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < t; i++) /* the experts in routing order, as moe_combine sums them */
        for (int64_t j = 0; j < dim; j++) {
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++) {
                const float *bd = L->exp_bias_d ? L->exp_bias_d + ids[i * K + k] * dim : NULL;
                acc += wts[i * K + k] * (bd ? dn[(i * K + k) * dim + j] + bd[j] : dn[(i * K + k) * dim + j]);
            }
            y[i * dim + j] = acc;
        }
}

#endif
