/* The quantized dot products under the native CPU kernels (included by moe_gemv.c): ggml's block
 * types Q4_K, Q6_K and Q8_0 against int8 activations (`quantize_for`: per 256 values for Q4_K,
 * llama.cpp's Q8_K; per 32 for the others; sums of every 16 codes), with AVX2 / AVX512-VNNI forms
 * and plain C ones for other CPUs. Each dot's arithmetic does not depend on how many rows share a
 * decoded weight row (`dot_q4_k_rows`, `dot_q6_k_rows`). */
#ifndef LOCALLLM_QUANT_DOTS_H
#define LOCALLLM_QUANT_DOTS_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__SSE2__)
#include <immintrin.h>
#endif

enum { Q8_0 = 8, Q4_K = 12, Q6_K = 14 };
enum { ROWS_MAX = 4 }; /* activation rows per decoded weight row (the AVX2 Q4_K / Q6_K dots) */
/* the R-row dots, inlined at each call: R is a literal there, so the per-row accumulators stay
 * in registers (an out-of-line copy with R unknown kept them on the stack: 4-row Q4_K calls ran
 * at half speed once its sums took two multiply-add chains) */
#define ROWS_FN static inline __attribute__((always_inline)) void

static float h2f(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);  /* one instruction where the CPU has it (x86-64-v3 and up) */
#elif defined(__aarch64__)
    __fp16 v;
    memcpy(&v, &h, 2);
    return (float)v;
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, f;
    if (exp == 0) {
        if (man == 0) {
            f = sign;
        } else {  /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            f = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        f = sign | 0x7f800000 | (man << 13);
    } else {
        f = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float out;
    memcpy(&out, &f, 4);
    return out;
#endif
}

static uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* lrintf in the default rounding mode (to nearest, ties to even), inlined */
static inline int round_even(float v) {
#if defined(__SSE2__)
    return _mm_cvtss_si32(_mm_set_ss(v));
#else
    return (int)lrintf(v);
#endif
}

/* x [k] -> q [k] int8 with one scale per g values d [k/g] (g = 32, or 256: llama.cpp's Q8_K,
 * whose super-block sums stay in integers before one float multiply) and bs [k/16] sums of 16
 * codes; k a multiple of 256 (the weights' super-blocks) */
static void quantize_groups(const float *x, int64_t k, int g, int8_t *q, float *d, int16_t *bs) {
    for (int64_t b = 0; b < k / g; b++) {
        const float *xb = x + b * g;
        int8_t *qb = q + b * g;
        float amax = 0.f;
        for (int i = 0; i < g; i++) {  /* (no libm calls: fmaxf / lrintf were not inlined) */
            const float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
        float inv = amax > 0.f ? 127.f / amax : 0.f;
        d[b] = amax / 127.f;
        for (int i = 0; i < g; i++) qb[i] = (int8_t)round_even(xb[i] * inv);
        for (int j = 0; j < g / 16; j++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += qb[16 * j + i];
            bs[b * (g / 16) + j] = (int16_t)s;
        }
    }
}

static void quantize_row(const float *x, int64_t k, int8_t *q, float *d, int16_t *bs) {
    quantize_groups(x, k, 32, q, d, bs);
}

static void quantize_row_k(const float *x, int64_t k, int8_t *q, float *d, int16_t *bs) {
    quantize_groups(x, k, 256, q, d, bs);
}

/* the activation format `type`'s dot reads: per 256 values for Q4_K, per 32 for Q6_K and Q8_0 */
static void quantize_for(int type, const float *x, int64_t k, int8_t *q, float *d, int16_t *bs) {
    if (type == Q4_K)
        quantize_row_k(x, k, q, d, bs);
    else
        quantize_row(x, k, q, d, bs);
}

/* Q4_K's 6-bit scale and min of sub-block j (the plain dot and dequantization; the AVX2 dot
 * unpacks all 8 at once) */
static void scale_min_k4(int j, const uint8_t *q, int *d, int *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* Q4_K with AVX2: 32 nibbles x 32 int8 per multiply-add pair, the int32 sums scaled and kept in
 * float lanes across the row (one horizontal sum per row, where the plain loop reduces every 32
 * values); same integer sums, float additions in another order. */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline __m256 lane(__m256 v, int i) {
    return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(i));
}

static inline float hsum(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* The 8 6-bit scales (bytes 0-7) and mins (bytes 8-15) of a Q4_K / Q5_K super-block's 12 packed
 * bytes at q, all at once (scale_min_k4 for j = 0..7), unpacked in vector registers from 16
 * bytes (a super-block always has 4 more after them): the words a0 a1 a2 give a0 & 0x3f..,
 * (a2 & 0x0f..) | (a0 >> 6 & 3..) << 4, a1 & 0x3f.., (a2 >> 4 & 0x0f..) | (a1 >> 6 & 3..) << 4.
 * (Unpacked in scalar registers and inserted word by word, they were ~5 % of the Q4_K dot.) */
static inline __m128i scales_mins_k4v(const uint8_t *q) {
    const __m128i v = _mm_loadu_si128((const __m128i *)q);          /* a0 a1 a2 . */
    const __m128i t1 = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)); /* a0 a2 a1 a2 */
    const __m128i lo = _mm_and_si128(_mm_srlv_epi32(t1, _mm_setr_epi32(0, 0, 0, 4)),
                                     _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m128i t2 = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)); /* a0 a0 a1 a1 */
    const __m128i hi =
        _mm_and_si128(_mm_srli_epi32(t2, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(lo, hi);
}

/* a K-quant super-block's two float16 scales at w (d, dmin) in lanes 0 and 1 */
static inline __m128 d_dmin(const uint8_t *w) {
#if defined(__F16C__)
    uint32_t v;
    memcpy(&v, w, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int)v));
#else
    return _mm_setr_ps(h2f(rd16(w)), h2f(rd16(w + 2)), 0.f, 0.f);
#endif
}

/* acc + the pairwise 16-bit products of a and b summed into 32 bits: one AVX512-VNNI
 * instruction where the CPU has it (the same integers either way) */
static inline __m256i madd_acc(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* 16-bit word i of each 128-bit half of v in every word of that half */
static inline __m256i word_bcast(__m256i v, int i) {
    return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)(0x0100 + 0x0202 * i)));
}

/* Q4_K rows of R pairs at once (R = 1 .. ROWS_MAX) against Q8_K activations (`quantize_row_k`): per
 * 32-value sub-block the code products are summed in 16 bits and scaled by the 6-bit scale in
 * 32 (maddubs, madd: at most 2 x 15 x 127 and 2 x 3810 x 63), so a super-block's sums stay in
 * integers and meet the floats d x dx once. The weight's scales, minimums and nibbles are
 * decoded once for all R; each pair's arithmetic is the one-pair dot's, in the same order.
 * Per thread this runs as fast as llama.cpp's AVX2 ggml_vec_dot_q4_K_q8_K (the same steps);
 * the scale multiply-adds fused into VNNI's dpwssd over two chains (lo / hi nibbles) and the
 * scales broadcast by byte shuffles from one vector made it ~10 % faster on the AMD EPYC box
 * (in-cache rows, 2026-12-06), with the same integer sums, so the same bits. */
ROWS_FN dot_q4_k_rows(const uint8_t *w, const int8_t *const *q8, const float *const *d8,
                                 const int16_t *const *bs, int64_t nb, int R, float *out) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 acc[ROWS_MAX], macc[ROWS_MAX];
    for (int r = 0; r < R; r++) acc[r] = macc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 144) {
        const uint8_t *qs = w + 16;
        const __m128 ddm = d_dmin(w);
        const __m128i smv = scales_mins_k4v(w + 4);
        const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(smv));
        /* each sub-block's min twice, beside its two 16-value code sums: one madd gives
         * min x (sum + sum) per sub-block, exactly (|sum| <= 2032, min <= 63) */
        const __m128i m16 = _mm_cvtepu8_epi16(_mm_srli_si128(smv, 8));
        const __m256i mdup = _mm256_set_m128i(_mm_unpackhi_epi16(m16, m16), _mm_unpacklo_epi16(m16, m16));
        __m256i slo[ROWS_MAX], shi[ROWS_MAX];
        for (int r = 0; r < R; r++) slo[r] = shi[r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            const __m256i lo = _mm256_and_si256(q, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
            const __m256i s1 = word_bcast(sc16, 2 * j), s2 = word_bcast(sc16, 2 * j + 1);
            for (int r = 0; r < R; r++) {
                const int8_t *x = q8[r] + 256 * b + 64 * j;
                slo[r] = madd_acc(slo[r], _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)x)), s1);
                shi[r] = madd_acc(shi[r], _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 32))), s2);
            }
        }
        for (int r = 0; r < R; r++) {
            const __m128 e = _mm_mul_ps(ddm, _mm_set1_ps(d8[r][b])); /* d x dx, dmin x dx */
            const __m256i sumi = _mm256_add_epi32(slo[r], shi[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_broadcastss_ps(e), acc[r]);
            /* minimums: each sub-block's min times its activation code sum */
            const __m256i bs16 = _mm256_loadu_si256((const __m256i *)(bs[r] + 16 * b));
            const __m256 mterm = _mm256_cvtepi32_ps(_mm256_madd_epi16(bs16, mdup));
            macc[r] = _mm256_fmadd_ps(mterm, _mm256_broadcastss_ps(_mm_movehdup_ps(e)), macc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]) - hsum(macc[r]);
}

static float dot_q4_k(const uint8_t *w, const int8_t *q8, const float *d8, const int16_t *bs,
                      int64_t nb) {
    float out;
    dot_q4_k_rows(w, &q8, &d8, &bs, nb, 1, &out);
    return out;
}
#define Q4K_ROWS 1
#else
static float dot_q4_k(const uint8_t *w, const int8_t *q8, const float *d8, const int16_t *bs,
                      int64_t nb) {
    float sum = 0.f;
    for (int64_t b = 0; b < nb; b++, w += 144, q8 += 256, bs += 16) {
        const uint8_t *sc = w + 4, *qs = w + 16;
        int32_t sumi = 0, summ = 0;
        for (int j = 0; j < 4; j++) {
            int s1, m1, s2, m2;
            scale_min_k4(2 * j, sc, &s1, &m1);
            scale_min_k4(2 * j + 1, sc, &s2, &m2);
            const uint8_t *qj = qs + 32 * j;
            const int8_t *xj = q8 + 64 * j;
            int32_t a1 = 0, a2 = 0;
            for (int l = 0; l < 32; l++) {
                a1 += (uint8_t)(qj[l] & 0xF) * xj[l];
                a2 += (uint8_t)(qj[l] >> 4) * xj[l + 32];
            }
            sumi += s1 * a1 + s2 * a2;
            summ += m1 * (bs[4 * j] + bs[4 * j + 1]) + m2 * (bs[4 * j + 2] + bs[4 * j + 3]);
        }
        sum += d8[b] * (h2f(rd16(w)) * (float)sumi - h2f(rd16(w + 2)) * (float)summ);
    }
    return sum;
}

#endif

#if defined(__AVX2__) && defined(__FMA__)
/* Q6_K with AVX2: the 6-bit codes of 32 values assembled per vector (low nibbles | 2 high bits),
 * two 16-value scales per vector (lanes 0-3 and 4-7), the -32 offset through the 16-sums. R = 1
 * to ROWS_MAX pairs per call: the codes are assembled once for both; each pair's arithmetic is the
 * one-pair dot's, in the same order, so its bits do not depend on R. The float multiply-adds
 * alternate between two accumulators (even / odd 32-value quarters): one chain of 8 dependent
 * FMAs per super-block was the limit (~12 % faster in-cache on the AMD EPYC box, 2026-12-06).
 * (Reverted once for a test_graph_ladder failure; its cause was a CPU graph step's torch
 * attention, not these dots: tests/kernels/test_cpu_row_invariance.py holds every row count.) */
ROWS_FN dot_q6_k_rows(const uint8_t *w, const int8_t *const *q8, const float *const *d8,
                                 const int16_t *const *bs, int64_t nb, int R, float *out) {
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3);
    /* 16-value group g of half n uses activation scale d8[4 n + g / 2]: lanes duplicated */
    const __m256i dup = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    __m256 acc[ROWS_MAX], acc1[ROWS_MAX], oacc[ROWS_MAX]; /* acc / acc1: even / odd quarters */
    for (int r = 0; r < R; r++) acc[r] = acc1[r] = oacc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 210) {
        const int8_t *sc = (const int8_t *)(w + 192);
        const __m256 d = _mm256_set1_ps(h2f(rd16(w + 208)));
        __m256 e8[ROWS_MAX]; /* per 32 values: activation scale x d */
        for (int r = 0; r < R; r++) e8[r] = _mm256_mul_ps(_mm256_loadu_ps(d8[r] + 8 * b), d);
        for (int n = 0; n < 2; n++) {
            const uint8_t *l0 = w + 64 * n, *h0 = w + 128 + 32 * n;
            const __m256i s16 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8 * n)));
            const __m256i la = _mm256_loadu_si256((const __m256i *)l0);
            const __m256i lb = _mm256_loadu_si256((const __m256i *)(l0 + 32));
            const __m256i hh = _mm256_loadu_si256((const __m256i *)h0);
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(la, low),
                                   _mm256_slli_epi16(_mm256_and_si256(hh, two), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(lb, low),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 2), two), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), low),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 4), two), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), low),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 6), two), 4));
            for (int r = 0; r < R; r++) {
                const int8_t *x = q8[r] + 256 * b + 128 * n;
                /* e x scale per 16-value group, lanes 2p and 2p + 1 for quarter p */
                const __m256 en = _mm256_permutevar8x32_ps(
                    _mm256_castps128_ps256(n ? _mm256_extractf128_ps(e8[r], 1)
                                             : _mm256_castps256_ps128(e8[r])),
                    dup);
                const __m256 scale = _mm256_mul_ps(en, _mm256_cvtepi32_ps(s16));
                for (int p = 0; p < 4; p++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + 32 * p));
                    const __m256i idx = _mm256_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p + 1,
                                                          2 * p + 1, 2 * p + 1, 2 * p + 1);
                    const __m256 sp = _mm256_permutevar8x32_ps(scale, idx);
                    const __m256 prod = _mm256_cvtepi32_ps(dot_u8s8(q[p], xv));
                    if (p & 1)
                        acc1[r] = _mm256_fmadd_ps(prod, sp, acc1[r]);
                    else
                        acc[r] = _mm256_fmadd_ps(prod, sp, acc[r]);
                }
            }
        }
        /* the -32 offset, both halves at once: scale x code sum per 16-value group, paired per
         * quarter (8 sums), times that quarter's e */
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        for (int r = 0; r < R; r++) {
            const __m256i off =
                _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(bs[r] + 16 * b)));
            oacc[r] = _mm256_fmadd_ps(e8[r], _mm256_cvtepi32_ps(off), oacc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum(_mm256_add_ps(acc[r], acc1[r])) - 32.f * hsum(oacc[r]);
}

static float dot_q6_k(const uint8_t *w, const int8_t *q8, const float *d8, const int16_t *bs,
                      int64_t nb) {
    float out;
    dot_q6_k_rows(w, &q8, &d8, &bs, nb, 1, &out);
    return out;
}
#define Q6K_ROWS 1
#else
static float dot_q6_k(const uint8_t *w, const int8_t *q8, const float *d8, const int16_t *bs,
                      int64_t nb) {
    float sum = 0.f;
    for (int64_t b = 0; b < nb; b++, w += 210, q8 += 256, d8 += 8, bs += 16) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        float acc = 0.f;
        for (int n = 0; n < 2; n++) {
            const uint8_t *l0 = ql + 64 * n, *h0 = qh + 32 * n;
            const int8_t *s = sc + 8 * n, *x = q8 + 128 * n;
            const float *e = d8 + 4 * n;  /* the 32-value groups at +0, +32, +64, +96 */
            for (int half = 0; half < 2; half++) {
                const uint8_t *lo = l0 + 16 * half, *hi = h0 + 16 * half;
                const int8_t *xx = x + 16 * half;
                int32_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
                for (int l = 0; l < 16; l++) {
                    a0 += (uint8_t)((lo[l] & 0xF) | ((hi[l] & 3) << 4)) * xx[l];
                    a1 += (uint8_t)((lo[l + 32] & 0xF) | (((hi[l] >> 2) & 3) << 4)) * xx[l + 32];
                    a2 += (uint8_t)((lo[l] >> 4) | (((hi[l] >> 4) & 3) << 4)) * xx[l + 64];
                    a3 += (uint8_t)((lo[l + 32] >> 4) | (((hi[l] >> 6) & 3) << 4)) * xx[l + 96];
                }
                const int16_t *bj = bs + 8 * n + half;
                acc += e[0] * (float)(s[half] * (a0 - 32 * bj[0])) +
                       e[1] * (float)(s[half + 2] * (a1 - 32 * bj[2])) +
                       e[2] * (float)(s[half + 4] * (a2 - 32 * bj[4])) +
                       e[3] * (float)(s[half + 6] * (a3 - 32 * bj[6]));
            }
        }
        sum += h2f(rd16(w + 208)) * acc;
    }
    return sum;
}

#endif

#if defined(__AVX2__) && defined(__FMA__)
/* Q8_0 with AVX2: the signs moved onto the activations so the weights enter unsigned (|w| <= 127:
 * the pair sums cannot saturate), one multiply-add chain per 32 values, scales in float lanes. */
static float dot_q8_0(const uint8_t *w, const int8_t *q8, const float *d8, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 34, q8 += 32) {
        const __m256i qw = _mm256_loadu_si256((const __m256i *)(w + 2));
        const __m256i xv = _mm256_loadu_si256((const __m256i *)q8);
        const __m256i p = dot_u8s8(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(xv, qw));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(h2f(rd16(w)) * d8[b]), acc);
    }
    return hsum(acc);
}
#else
static float dot_q8_0(const uint8_t *w, const int8_t *q8, const float *d8, int64_t nb) {
    float sum = 0.f;
    for (int64_t b = 0; b < nb; b++, w += 34, q8 += 32) {
        const int8_t *qw = (const int8_t *)(w + 2);
        int32_t a = 0;
        for (int l = 0; l < 32; l++) a += qw[l] * q8[l];
        sum += h2f(rd16(w)) * d8[b] * (float)a;
    }
    return sum;
}
#endif
#endif /* LOCALLLM_QUANT_DOTS_H */
