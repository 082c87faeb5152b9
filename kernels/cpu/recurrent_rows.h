/* The recurrent layers' decode rows as worksharing loops (call them inside an OpenMP parallel
 * region), in place on each sequence's state slot: Mamba-2's scan, the causal short conv,
 * Mamba-2's and Gated DeltaNet's whole mixers between their projections. Included by
 * recurrent_step.c (its calls) and decode_step.c (Granite-4.0-H's Mamba-2 and Qwen3-Next's
 * DeltaNet layers inside the one-call decode step). */
#ifndef LOCALLLM_RECURRENT_ROWS_H
#define LOCALLLM_RECURRENT_ROWS_H
#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* softplus as torch's (threshold 20: x itself above it) */
static inline float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

/* The scan's rows, a worksharing loop (call inside a parallel region): row i's x at x + i * lx
 * [H, P], B and C at B + i * lbc and C + i * lbc [G, N], dt at dt + i * ldt [H]; y [b, H, P] at
 * y + i * ly. Mamba-2's mixer passes `bias` (dt + bias, then softplus), D and z (z + i * lz:
 * y' = (y + D x) * silu(z)); NULL: dt as given and y alone. */
static void ssd_rows(int64_t b, const float *x, int64_t lx, const float *dt, int64_t ldt,
                     const float *bias, const float *A, const float *B, const float *C,
                     int64_t lbc, float *states, const int64_t *slots, const uint8_t *fresh,
                     int64_t H, int64_t P, int64_t N, int64_t G, const float *D, const float *z,
                     int64_t lz, float *y, int64_t ly) {
    const int64_t per = H / G;
#pragma omp for schedule(static)
    for (int64_t w = 0; w < b * H; w++) {
        const int64_t i = w / H, h = w % H, g = h / per;
        const float d = bias ? softplus(dt[i * ldt + h] + bias[h]) : dt[i * ldt + h];
        const float decay = fresh[i] ? 0.f : expf(d * A[h]);
        const float *bg = B + i * lbc + g * N, *cg = C + i * lbc + g * N;
        const float *xh = x + i * lx + h * P;
        float *s = states + (slots[i] * H + h) * P * N, *yh = y + i * ly + h * P;
        for (int64_t p = 0; p < P; p++) {
            const float xd = d * xh[p];
            float *sp = s + p * N, acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t n = 0; n < N; n++) {
                /* (a fresh slot's old bytes may be NaN: never multiplied in) */
                const float v = (fresh[i] ? 0.f : sp[n] * decay) + xd * bg[n];
                sp[n] = v;
                acc += v * cg[n];
            }
            if (z) {
                const float zv = z[i * lz + h * P + p];
                acc = (acc + D[h] * xh[p]) * (zv / (1.f + expf(-zv)));
            }
            yh[p] = acc;
        }
    }
}

/* The causal depthwise conv's rows, a worksharing loop: row i's x at x + i * lx [C], y at
 * y + i * ly; see conv_step_slots. */
static void conv_rows(int64_t b, const float *x, int64_t lx, const float *w, int64_t taps,
                      float *states, const int64_t *slots, const uint8_t *fresh,
                      const float *bias, int silu, int64_t C, float *y, int64_t ly) {
    enum { PIECE = 512 };
    const int64_t np = (C + PIECE - 1) / PIECE;
#pragma omp for schedule(static)
    for (int64_t q = 0; q < b * np; q++) {
        const int64_t i = q / np, c0 = q % np * PIECE, c1 = c0 + PIECE < C ? c0 + PIECE : C;
        float *st = states + slots[i] * (taps - 1) * C;
        const float *xi = x + i * lx;
        for (int64_t c = c0; c < c1; c++) {
            const float *wc = w + c * taps;
            float acc = 0.f;
            for (int64_t k = 0; k < taps - 1; k++) acc += (fresh[i] ? 0.f : st[k * C + c]) * wc[k];
            acc += xi[c] * wc[taps - 1];
            for (int64_t k = 0; k + 1 < taps - 1; k++) st[k * C + c] = fresh[i] ? 0.f : st[(k + 1) * C + c];
            st[(taps - 2) * C + c] = xi[c];
            if (bias) acc += bias[c];
            y[i * ly + c] = silu ? acc / (1.f + expf(-acc)) : acc;
        }
    }
}

/* Mamba-2's mixer between its projections for b decode rows, worksharing loops (call inside a
 * parallel region): zxd [b, Din + Cc + H] the in-projection's output (z | x B C | dt; Din = H P,
 * Cc = Din + 2 G N); the conv (+ bias, SiLU) of x B C into xbc [b, Cc] (scratch) on conv_states
 * [slots, taps - 1, Cc]; the scan on ssm_states [slots, H, P, N] with softplus(dt + dt_bias), the
 * D skip and the SiLU(z) gate; then each group of Din / G channels RMS-normalised and scaled by
 * norm_w [Din]. out [b, Din]: what the out-projection reads. */
static void mamba2_rows(int64_t b, const float *zxd, const float *conv_w, const float *conv_b,
                        int64_t taps, float *conv_states, const float *dt_bias, const float *A,
                        const float *D, const float *norm_w, float eps, float *ssm_states,
                        const int64_t *slots, const uint8_t *fresh, int64_t H, int64_t P,
                        int64_t N, int64_t G, float *xbc, float *out) {
    const int64_t din = H * P, cc = din + 2 * G * N, row = din + cc + H, gw = din / G;
    conv_rows(b, zxd + din, row, conv_w, taps, conv_states, slots, fresh, conv_b, 1, cc, xbc, cc);
    ssd_rows(b, xbc, cc, zxd + din + cc, row, dt_bias, A, xbc + din, xbc + din + G * N, cc,
             ssm_states, slots, fresh, H, P, N, G, D, zxd, row, out, din);
#pragma omp for schedule(static)
    for (int64_t q = 0; q < b * G; q++) {
        float *o = out + q / G * din + q % G * gw;
        const float *wg = norm_w + q % G * gw;
        float ss = 0.f;
        for (int64_t c = 0; c < gw; c++) ss += o[c] * o[c];
        const float r = 1.f / sqrtf(ss / (float)gw + eps);
        for (int64_t c = 0; c < gw; c++) o[c] = o[c] * r * wg[c];
    }
}

/* One head's gated delta rule on its state s [K, V], in place: s = s decay (zeros where fresh:
 * a fresh slot's old bytes may be NaN, never multiplied in); delta = (v - s^T k) beta;
 * s += k delta^T; o = s^T q [V]. pr: V floats of scratch. */
static inline void delta_head(float *s, const float *qh, const float *kh, const float *vh,
                              float decay, int fresh, float bt, int64_t K, int64_t V, float *pr,
                              float *oh) {
    for (int64_t c = 0; c < V; c++) pr[c] = 0.f;
    for (int64_t r = 0; r < K; r++) { /* decay in place, the prediction s^T k */
        float *sr = s + r * V;
        const float kr = kh[r];
#pragma omp simd
        for (int64_t c = 0; c < V; c++) {
            const float e = fresh ? 0.f : sr[c] * decay;
            sr[c] = e;
            pr[c] += e * kr;
        }
    }
    for (int64_t c = 0; c < V; c++) pr[c] = (vh[c] - pr[c]) * bt, oh[c] = 0.f;
    for (int64_t r = 0; r < K; r++) { /* the rank-one update, the output s^T q */
        float *sr = s + r * V;
        const float kr = kh[r], qr = qh[r];
#pragma omp simd
        for (int64_t c = 0; c < V; c++) {
            const float e = sr[c] + kr * pr[c];
            sr[c] = e;
            oh[c] += e * qr;
        }
    }
}

/* Gated DeltaNet's mixer between its projections for b decode rows (Qwen3-Next), worksharing
 * loops (call inside a parallel region): in [b, lin] the in-projections' outputs side by side
 * (q k v into the conv, Cc = 2 Hk Dk + Hv Dv | z [Hv Dv] | b and a, Hv / Hk of each per key
 * head); the conv (SiLU) of q k v into xbc [b, Cc] (scratch) on conv_states [slots, taps - 1,
 * Cc]; q and k L2-normalised per key head, q then scaled by 1 / sqrt(Dk), key head h / (Hv / Hk)
 * serving value head h; beta = sigmoid(b), decay exp(A softplus(a + dt_bias)); the delta rule on
 * states [slots, Hv, Dk, Dv] (delta_step_slots's); each head's output RMS-normalised (norm_w
 * [Dv]) times SiLU(z). out [b, Hv Dv]: what the out-projection reads. */
static void delta_rows(int64_t b, const float *in, int64_t lin, const float *conv_w, int64_t taps,
                       float *conv_states, const float *dt_bias, const float *A,
                       const float *norm_w, float eps, float *states, const int64_t *slots,
                       const uint8_t *fresh, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv,
                       float *xbc, float *out) {
    const int64_t cc = 2 * Hk * Dk + Hv * Dv, rep = Hv / Hk;
    conv_rows(b, in, lin, conv_w, taps, conv_states, slots, fresh, NULL, 1, cc, xbc, cc);
    const float qs = 1.f / sqrtf((float)Dk);
#pragma omp for schedule(static)
    for (int64_t w = 0; w < b * 2 * Hk; w++) { /* each row's q and k heads, in place */
        float *v = xbc + w / (2 * Hk) * cc + w % (2 * Hk) * Dk;
        float ss = 0.f;
        for (int64_t j = 0; j < Dk; j++) ss += v[j] * v[j];
        const float r = 1.f / sqrtf(ss + eps);
        for (int64_t j = 0; j < Dk; j++) v[j] *= r;
        if (w % (2 * Hk) < Hk)
            for (int64_t j = 0; j < Dk; j++) v[j] *= qs;
    }
#pragma omp for schedule(static)
    for (int64_t w = 0; w < b * Hv; w++) {
        const int64_t i = w / Hv, h = w % Hv, kh = h / rep;
        const float *row = in + i * lin, *ba = row + cc + Hv * Dv + kh * 2 * rep;
        const float bt = 1.f / (1.f + expf(-ba[h % rep]));
        const float decay = fresh[i] ? 0.f : expf(A[h] * softplus(ba[rep + h % rep] + dt_bias[h]));
        const float *x = xbc + i * cc, *qh = x + kh * Dk, *kv = x + Hk * Dk + kh * Dk;
        const float *vh = x + 2 * Hk * Dk + h * Dv, *z = row + cc + h * Dv;
        float *s = states + (slots[i] * Hv + h) * Dk * Dv, *oh = out + i * Hv * Dv + h * Dv;
        float pr[Dv];
        delta_head(s, qh, kv, vh, decay, fresh[i], bt, Dk, Dv, pr, oh);
        float ss = 0.f;
        for (int64_t c = 0; c < Dv; c++) ss += oh[c] * oh[c];
        const float r = 1.f / sqrtf(ss / (float)Dv + eps);
        for (int64_t c = 0; c < Dv; c++) /* the gated norm: RMSNorm times SiLU(z) */
            oh[c] = oh[c] * r * norm_w[c] * (z[c] / (1.f + expf(-z[c])));
    }
}

#endif
