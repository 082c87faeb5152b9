/* A decode step of the recurrent layers on the CPU, straight on each sequence's state slot:
 * Mamba-2's scan (SSD), Gated DeltaNet's delta rule and the causal short conv before them
 * (recurrent_rows.h holds the rows' loops, shared with decode_step.c). The torch references
 * (kernels/recurrent/decode.py: gather the slot, zero it where the sequence is fresh, decay, add
 * the outer product, contract, scatter back) pass over a [heads, 64, 128] float32 state five or six times a layer,
 * ~0.34 ms of a Granite-4.0-H-Tiny step's layer on two cores; here one pass (two for the delta
 * rule, whose prediction needs the decayed state first), the state in place. Mamba-2's whole mixer
 * between its projections (conv, scan, gate, group norm) is one call too: as separate torch ops
 * it cost ~40 us a layer of glue around ~90 us of work (Granite-4.0-H-Tiny, 2 threads).
 * kernels/cpu/recurrent_step.py binds these and checks them against the references. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include "recurrent_rows.h"
#ifdef _OPENMP
#include <omp.h>
#endif

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
            delta_head(s, qh, kh, vh, decay, fresh[i], bt, K, V, pr, oh);
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

/* Mamba-2's mixer between its projections, one decode row per sequence, one parallel region
 * (recurrent_rows.h's mamba2_rows). */
void mamba2_step_slots(int64_t b, const float *zxd, const float *conv_w, const float *conv_b,
                       int64_t taps, float *conv_states, const float *dt_bias, const float *A,
                       const float *D, const float *norm_w, float eps, float *ssm_states,
                       const int64_t *slots, const uint8_t *fresh, int64_t H, int64_t P,
                       int64_t N, int64_t G, float *xbc, float *out, int threads) {
#pragma omp parallel num_threads(threads)
    mamba2_rows(b, zxd, conv_w, conv_b, taps, conv_states, dt_bias, A, D, norm_w, eps, ssm_states,
                slots, fresh, H, P, N, G, xbc, out);
}
