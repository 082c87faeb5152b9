/* A decode step of the recurrent layers on the CPU, straight on each sequence's state slot:
 * Mamba-2's scan (SSD), Gated DeltaNet's delta rule and the causal short conv before them. The torch references (kernels/recurrent/
 * decode.py: gather the slot, zero it where the sequence is fresh, decay, add the outer product,
 * contract, scatter back) pass over a [heads, 64, 128] float32 state five or six times a layer,
 * ~0.34 ms of a Granite-4.0-H-Tiny step's layer on two cores; here one pass (two for the delta
 * rule, whose prediction needs the decayed state first), the state in place. Mamba-2's whole mixer
 * between its projections (conv, scan, gate, group norm) is one call too: as separate torch ops
 * it cost ~40 us a layer of glue around ~90 us of work (Granite-4.0-H-Tiny, 2 threads).
 * kernels/cpu/recurrent_step.py binds these and checks them against the references. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

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

/* x [b, H, P], dt [b, H] (after softplus), A [H], B and C [b, G, N] (group h / (H / G) serves
 * head h), states [slots, H, P, N]; row i's slot slots[i], read as zeros where fresh[i]. Per
 * head: s = s * exp(dt A) + (dt x) B^T, y = s C. y [b, H, P]. */
void ssd_step_slots(int64_t b, const float *x, const float *dt, const float *A, const float *B,
                    const float *C, float *states, const int64_t *slots, const uint8_t *fresh,
                    int64_t H, int64_t P, int64_t N, int64_t G, float *y, int threads) {
#pragma omp parallel num_threads(threads)
    ssd_rows(b, x, H * P, dt, H, NULL, A, B, C, G * N, states, slots, fresh, H, P, N, G, NULL,
             NULL, 0, y, H * P);
}

/* q, k [b, H, K] (normalized, q scaled, one per value head), v [b, H, V], g and beta [b, H],
 * states [slots, H, K, V]; row i's slot slots[i], zeros where fresh[i]. Per head:
 * s = s exp(g); delta = (v - s^T k) beta; s += k delta^T; o = s^T q. o [b, H, V]. pred
 * [threads, V] scratch. */
void delta_step_slots(int64_t b, const float *q, const float *k, const float *v, const float *g,
                      const float *beta, float *states, const int64_t *slots,
                      const uint8_t *fresh, int64_t H, int64_t K, int64_t V, float *o,
                      float *pred, int threads) {
#pragma omp parallel num_threads(threads)
    {
        int id = 0;
#ifdef _OPENMP
        id = omp_get_thread_num();
#endif
        float *pr = pred + id * V;
#pragma omp for schedule(static)
        for (int64_t w = 0; w < b * H; w++) {
            const int64_t i = w / H;
            const float decay = fresh[i] ? 0.f : expf(g[w]), bt = beta[w];
            const float *qh = q + w * K, *kh = k + w * K, *vh = v + w * V;
            float *s = states + (slots[i] * H + w % H) * K * V, *oh = o + w * V;
            for (int64_t c = 0; c < V; c++) pr[c] = 0.f;
            for (int64_t r = 0; r < K; r++) { /* decay in place, the prediction s^T k */
                float *sr = s + r * V;
                const float kr = kh[r];
#pragma omp simd
                for (int64_t c = 0; c < V; c++) {
                    const float e = fresh[i] ? 0.f : sr[c] * decay;
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

/* The causal depthwise conv's step: x [b, C], w [C, taps], states [slots, taps - 1, C] (each
 * sequence's last inputs; zeros where fresh), bias [C] or NULL; y = the taps' products summed
 * first to last (+ bias, then SiLU where silu), the state shifted by one with x at its end. */
void conv_step_slots(int64_t b, const float *x, const float *w, int64_t taps, float *states,
                     const int64_t *slots, const uint8_t *fresh, const float *bias, int silu,
                     int64_t C, float *y, int threads) {
#pragma omp parallel num_threads(threads)
    conv_rows(b, x, C, w, taps, states, slots, fresh, bias, silu, C, y, C);
}

/* Mamba-2's mixer between its projections, one decode row per sequence, one parallel region:
 * zxd [b, Din + Cc + H] the in-projection's output (z | x B C | dt; Din = H P, Cc = Din + 2 G N);
 * the conv (+ bias, SiLU) of x B C into xbc [b, Cc] (scratch) on conv_states [slots, taps - 1,
 * Cc]; the scan on ssm_states [slots, H, P, N] with softplus(dt + dt_bias), the D skip and the
 * SiLU(z) gate; then each group of Din / G channels RMS-normalised and scaled by norm_w [Din].
 * out [b, Din]: what the out-projection reads. */
void mamba2_step_slots(int64_t b, const float *zxd, const float *conv_w, const float *conv_b,
                       int64_t taps, float *conv_states, const float *dt_bias, const float *A,
                       const float *D, const float *norm_w, float eps, float *ssm_states,
                       const int64_t *slots, const uint8_t *fresh, int64_t H, int64_t P,
                       int64_t N, int64_t G, float *xbc, float *out, int threads) {
    const int64_t din = H * P, cc = din + 2 * G * N, row = din + cc + H, gw = din / G;
#pragma omp parallel num_threads(threads)
    {
        conv_rows(b, zxd + din, row, conv_w, taps, conv_states, slots, fresh, conv_b, 1, cc,
                  xbc, cc);
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
}
