/* Prompt GEMMs over the file's blocks with int8 activations in llama.cpp's formats (included by
 * block_linear.c): y [t, n] = x [t, k] . W^T, x quantized as ggml's `vec_dot_type` of the weight
 * type (ggml-cpu.c's type traits): Q8_K for Q4_K / Q5_K / Q6_K / IQ4_XS (one float scale per
 * 256, 1 / (-127 / the signed largest value), sums of 32 for the minimums), Q8_0 for Q4_0 /
 * Q5_0 / Q8_0 / IQ4_NL (amax / 127 per 32 rounded to fp16), Q8_1 for Q4_1 / Q5_1 (Q8_0 and
 * s = fp16(d x the codes' sum)). Weight rows are decoded once per tile of I8_NC to int8 codes
 * with their integer sub-block scales; sums stay in int32 up to each group (a super-block for
 * Q8_K, as llama.cpp's dots), then one float multiply-add per group in a fixed order per output,
 * so a row's result does not depend on the call's other rows. AVX512-VNNI `vpdpbusd` multiplies
 * 64 byte pairs per instruction (twice `vpdpwssd`); it takes unsigned bytes on one side, so the
 * activation codes go in as code + 128 and 128 x (the weight codes' scaled sum) comes off each
 * group's integer sum (the tile's, not the row's: computed once per weight row). Plain C
 * elsewhere gives the same bits. */
#ifndef LOCALLLM_I8_GEMM_H
#define LOCALLLM_I8_GEMM_H
#include "i16_gemm.h"

#define I8_NC 32 /* weight rows per tile: two 16-lane vectors */
#define I8_R 6   /* activation rows per microkernel step (rows are padded to a multiple) */

enum { I8_Q8_0 = 1, I8_Q8_1 = 2, I8_Q8_K = 3 };

/* ggml's vec_dot_type of `type` (0: not covered) */
static int i8_format(int type) {
    switch (type) {
    case Q4_0: case Q5_0: case Q8_0: case IQ4_NL: case MXFP4: return I8_Q8_0;
    case Q4_1: case Q5_1: return I8_Q8_1;
    case Q4_K: case Q5_K: case Q6_K: case IQ4_XS: return I8_Q8_K;
    default: return 0;
    }
}
static int i8_group(int type) { return i8_format(type) == I8_Q8_K ? 256 : 32; }
static int i8_sub(int type) { return type == Q6_K ? 16 : 32; } /* values per integer weight scale */
static int i8_mins(int type) { return type == Q4_K || type == Q5_K; }

/* f rounded to fp16 and back (round to nearest even, as F16C's vcvtps2ph with imm 0): the
 * bit-exact algorithm of the FP16 library, so a build without F16C rounds the same */
static float i8_f16_round(float f) {
    const float to_inf = 0x1.0p+112f, to_zero = 0x1.0p-110f;
    float base = (fabsf(f) * to_inf) * to_zero;
    uint32_t w, bits;
    memcpy(&w, &f, 4);
    const uint32_t shl1 = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1 & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    const uint32_t bb = (bias >> 1) + 0x07800000u;
    float bf;
    memcpy(&bf, &bb, 4);
    base = bf + base;
    memcpy(&bits, &base, 4);
    const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    return h2f((uint16_t)((sign >> 16) | (shl1 > 0xFF000000u ? 0x7E00u : nonsign)));
}

/* largest |x| of n values */
static float i8_amax(const float *x, int n) {
#if defined(__AVX512F__)
    __m512 m = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    return _mm512_reduce_max_ps(m);
#else
    float amax = 0.f;
    for (int i = 0; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    return amax;
#endif
}

/* codes round_even(x[i] x inv), clamped to 127, as bytes + 128 in a; returns their sum */
static int i8_codes_of(const float *x, int n, float inv, uint8_t *a) {
    int s = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (int i = 0; i < n; i += 16) {
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(inv)));
        q = _mm512_min_epi32(q, _mm512_set1_epi32(127));
        s += _mm512_reduce_add_epi32(q);
        _mm_storeu_si128((__m128i *)(a + i), _mm512_cvtepi32_epi8(_mm512_add_epi32(q, _mm512_set1_epi32(128))));
    }
#else
    for (int i = 0; i < n; i++) {
        int v = round_even(x[i] * inv);
        v = v > 127 ? 127 : v;
        s += v;
        a[i] = (uint8_t)(v + 128);
    }
#endif
    return s;
}

/* x [k] -> a [k] (codes + 128), xd [k/G] scales, xs [k/32] Q8_1's s, bs [k/64] Q8_K's sums of
 * 32 as int16 pairs (Q4_K / Q5_K minimums); the formats of ggml's quantize_row_q8_K_ref and
 * x86 quantize_row_q8_0 / _q8_1 (round to nearest even there) */
static void i8_quantize(int type, const float *x, int64_t k, uint8_t *a, float *xd, float *xs,
                        int32_t *bs) {
    const int fmt = i8_format(type);
    if (fmt != I8_Q8_K) {
        for (int64_t b = 0; b < k / 32; b++) {
            const float amax = i8_amax(x + 32 * b, 32), d = amax / 127.f;
            const int s = i8_codes_of(x + 32 * b, 32, amax != 0.f ? 127.f / amax : 0.f, a + 32 * b);
            xd[b] = i8_f16_round(d);
            if (fmt == I8_Q8_1) xs[b] = i8_f16_round(d * (float)s);
        }
        return;
    }
    for (int64_t b = 0; b < k / 256; b++) {
        const float *xb = x + 256 * b;
        const float amax = i8_amax(xb, 256);
        float max = 0.f; /* the first value of largest magnitude, with its sign */
        for (int i = 0; i < 256 && amax > 0.f; i++)
            if (fabsf(xb[i]) == amax) { max = xb[i]; break; }
        const float iscale = amax > 0.f ? -127.f / max : 0.f;
        i8_codes_of(xb, 256, iscale, a + 256 * b);
        xd[b] = amax > 0.f ? 1.f / iscale : 0.f;
        if (!i8_mins(type)) continue;
        for (int p = 0; p < 4; p++) {
            int s2[2] = {0, 0};
            for (int e = 0; e < 2; e++)
                for (int i = 0; i < 32; i++) s2[e] += (int)a[256 * b + 64 * p + 32 * e + i] - 128;
            bs[4 * b + p] = (int32_t)((uint32_t)(uint16_t)s2[0] | (uint32_t)(uint16_t)s2[1] << 16);
        }
    }
}

/* the 32 int8 codes of values 32j .. 32j + 31 of a weight row (value = scale x code + min;
 * Q6_K's q - 32, its scales per 16 apart) */
static void i8_codes(int type, const uint8_t *w, int64_t j, int8_t *c) {
#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(BLOCK_DOTS_AVX2)
    __m256i v;
    if (codes8_v(type, w, j, &v)) {
        _mm256_storeu_si256((__m256i *)c, v);
        return;
    }
#endif
    if (type == Q6_K) {
        const uint8_t *b = w + (j / 8) * 210;
        const int h = (int)(j % 8) / 4, i = (int)(j % 4);
        const uint8_t *ql = b + 64 * h + (i % 2) * 32, *qh = b + 128 + 32 * h;
        for (int l = 0; l < 32; l++)
            c[l] = (int8_t)(((i < 2 ? ql[l] & 0xF : ql[l] >> 4) | (((qh[l] >> (2 * i)) & 3) << 4)) - 32);
        return;
    }
    int16_t c16[32];
    float s, m;
    i16_sub(type, w, j, c16, &s, &m);
    for (int l = 0; l < 32; l++) c[l] = (int8_t)c16[l];
}

/* Tile scratch of one thread: codes pk [k/4][I8_NC][4], integer scales isc [k/S][I8_NC] (Q8_K
 * types), float scales wd [k/G][I8_NC] and wm [k/G][I8_NC] (Q8_1's minimums; -dmin for Q4_K /
 * Q5_K), corr [k/G][I8_NC] (128 x the group's scaled code sum), pm [k/256][4][I8_NC][2] (Q4_K /
 * Q5_K minimums as int16 pairs). */
typedef struct {
    int8_t *pk;
    int32_t *isc, *corr;
    float *wd, *wm;
    int16_t *pm;
} i8_tile_t;

/* The tile of weight rows (those past nvalid zero) in t's buffers. */
static void i8_tile(int type, const uint8_t *const *wrow, int nvalid, int64_t k, i8_tile_t *t) {
    const int fmt = i8_format(type), G = i8_group(type), nj = G / 32;
    const int64_t gb = block_row_bytes(type, G);
    for (int64_t g = 0; g < k / G; g++)
        for (int col = 0; col < I8_NC; col++) {
            const uint8_t *b = col < nvalid ? wrow[col] + g * gb : NULL;
            int sc[8][2], mn[8] = {0}; /* each 32's integer scale (per 16: Q6_K) and minimum */
            float wd = 0.f, wm = 0.f;
            for (int jj = 0; jj < nj; jj++) sc[jj][0] = sc[jj][1] = b ? 1 : 0;
            if (!b) {
            } else if (fmt != I8_Q8_K) {
                wd = scale32(type, b);
                if (fmt == I8_Q8_1) wm = h2f(rd16(b + 2));
            } else if (type == Q6_K) {
                const int8_t *s8 = (const int8_t *)(b + 192);
                for (int jj = 0; jj < 8; jj++) /* 32 values: 8h + 2i and the next (i16_sub) */
                    sc[jj][0] = s8[8 * (jj / 4) + 2 * (jj % 4)], sc[jj][1] = s8[8 * (jj / 4) + 2 * (jj % 4) + 1];
                wd = h2f(rd16(b + 208));
            } else if (type == IQ4_XS) {
                for (int jj = 0; jj < 8; jj++) sc[jj][0] = sc[jj][1] = iq4xs_scale(b, jj);
                wd = h2f(rd16(b));
            } else { /* Q4_K, Q5_K */
                for (int jj = 0; jj < 8; jj++) scale_min_k4(jj, b + 4, &sc[jj][0], &mn[jj]), sc[jj][1] = sc[jj][0];
                wd = h2f(rd16(b)), wm = -h2f(rd16(b + 2));
            }
            int32_t corr = 0;
            for (int jj = 0; jj < nj; jj++) {
                const int64_t j = g * nj + jj;
                int32_t *at = (int32_t *)t->pk + j * 8 * I8_NC + col;
                int s16[2] = {0, 0};
#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(BLOCK_DOTS_AVX2)
                __m256i v = _mm256_setzero_si256();
                if (b && !codes8_v(type, wrow[col], j, &v)) i8_codes(type, wrow[col], j, (int8_t *)&v);
                /* quad q to pk's word (j x 8 + q) x I8_NC + col; the sums of 4 (then of 16) */
                _mm256_i32scatter_epi32(at, _mm256_setr_epi32(0, I8_NC, 2 * I8_NC, 3 * I8_NC, 4 * I8_NC, 5 * I8_NC, 6 * I8_NC, 7 * I8_NC), v, 4);
                const __m256i q4 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1));
                int32_t s4[8];
                _mm256_storeu_si256((__m256i *)s4, q4);
                s16[0] = s4[0] + s4[1] + s4[2] + s4[3], s16[1] = s4[4] + s4[5] + s4[6] + s4[7];
#else
                int32_t quad[8];
                if (b) i8_codes(type, wrow[col], j, (int8_t *)quad);
                else memset(quad, 0, sizeof quad);
                const int8_t *c = (const int8_t *)quad;
                for (int l = 0; l < 32; l++) s16[l / 16] += c[l];
                for (int q = 0; q < 8; q++) at[q * I8_NC] = quad[q];
#endif
                corr += 128 * (sc[jj][0] * s16[0] + sc[jj][1] * s16[1]);
                if (type == Q6_K) {
                    t->isc[(2 * j) * I8_NC + col] = sc[jj][0], t->isc[(2 * j + 1) * I8_NC + col] = sc[jj][1];
                } else if (fmt == I8_Q8_K) {
                    t->isc[j * I8_NC + col] = sc[jj][0];
                }
                if (i8_mins(type)) t->pm[((g * 4 + jj / 2) * I8_NC + col) * 2 + jj % 2] = (int16_t)mn[jj];
            }
            t->corr[g * I8_NC + col] = corr, t->wd[g * I8_NC + col] = wd, t->wm[g * I8_NC + col] = wm;
        }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
/* acc += byte products of xu (unsigned) and w (signed), in place (see I16_DPWSSD) */
#define I8_DPBUSD(acc, xu, w) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(xu), "v"(w))
#endif

/* y rows 0 .. I8_R - 1 (stride ldy; those >= R not stored), columns 0 .. nvalid - 1 = the tile
 * times activation rows a / xd / xs / bs (strides lda, ldd: scales per row, ldb: pairs per
 * row); fmt, S and mins literals at each call */
static inline __attribute__((always_inline)) void
i8_kernel(const i8_tile_t *tl, int64_t k, const uint8_t *a, int64_t lda, const float *xd,
          const float *xs, int64_t ldd, const int32_t *bs, int64_t ldb, int R, float *y,
          int64_t ldy, int nvalid, const int fmt, const int S, const int mins) {
    const int G = fmt == I8_Q8_K ? 256 : 32;
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    __m512 acc[I8_R][2];
    for (int r = 0; r < I8_R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < k / G; g++) {
        /* the integer sums start at -corr (the codes' offset of 128 taken off) */
        const __m512i k0 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(tl->corr + g * I8_NC));
        const __m512i k1 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(tl->corr + g * I8_NC + 16));
        __m512i is[I8_R][2];
        for (int r = 0; r < I8_R; r++) is[r][0] = k0, is[r][1] = k1;
        for (int64_t sb = g * G / S; sb < (g + 1) * G / S; sb++) {
            __m512i s[I8_R][2]; /* (Q8_0 / Q8_1: one sub-block a group, its sum is the group's) */
            for (int r = 0; r < I8_R; r++)
                s[r][0] = fmt == I8_Q8_K ? _mm512_setzero_si512() : is[r][0],
                s[r][1] = fmt == I8_Q8_K ? _mm512_setzero_si512() : is[r][1];
            for (int64_t q = sb * S / 4; q < (sb + 1) * S / 4; q++) {
                const int8_t *pq = tl->pk + q * 4 * I8_NC;
                const __m512i w0 = _mm512_loadu_si512(pq), w1 = _mm512_loadu_si512(pq + 64);
                for (int r = 0; r < I8_R; r++) {
                    int32_t quad;
                    memcpy(&quad, a + r * lda + 4 * q, 4);
                    const __m512i x = _mm512_set1_epi32(quad);
                    I8_DPBUSD(s[r][0], x, w0);
                    I8_DPBUSD(s[r][1], x, w1);
                }
            }
            if (fmt == I8_Q8_K) {
                const __m512i c0 = _mm512_loadu_si512(tl->isc + sb * I8_NC), c1 = _mm512_loadu_si512(tl->isc + sb * I8_NC + 16);
                for (int r = 0; r < I8_R; r++) {
                    is[r][0] = _mm512_add_epi32(is[r][0], _mm512_mullo_epi32(s[r][0], c0));
                    is[r][1] = _mm512_add_epi32(is[r][1], _mm512_mullo_epi32(s[r][1], c1));
                }
            } else {
                for (int r = 0; r < I8_R; r++) is[r][0] = s[r][0], is[r][1] = s[r][1];
            }
        }
        const __m512 d0 = _mm512_loadu_ps(tl->wd + g * I8_NC), d1 = _mm512_loadu_ps(tl->wd + g * I8_NC + 16);
        const __m512 m0 = _mm512_loadu_ps(tl->wm + g * I8_NC), m1 = _mm512_loadu_ps(tl->wm + g * I8_NC + 16);
        for (int r = 0; r < I8_R; r++) {
            const __m512 d = _mm512_set1_ps(xd[r * ldd + g]);
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r][0]), _mm512_mul_ps(d0, d), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r][1]), _mm512_mul_ps(d1, d), acc[r][1]);
            if (fmt == I8_Q8_1) {
                const __m512 xsr = _mm512_set1_ps(xs[r * ldd + g]);
                acc[r][0] = _mm512_fmadd_ps(m0, xsr, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(m1, xsr, acc[r][1]);
            }
            if (mins) {
                __m512i ms0 = _mm512_setzero_si512(), ms1 = _mm512_setzero_si512();
                for (int p = 0; p < 4; p++) {
                    const int16_t *pp = tl->pm + (g * 4 + p) * I8_NC * 2;
                    const __m512i x = _mm512_set1_epi32(bs[r * ldb + 4 * g + p]);
                    I16_DPWSSD(ms0, x, _mm512_loadu_si512(pp));
                    I16_DPWSSD(ms1, x, _mm512_loadu_si512(pp + 32));
                }
                acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ms0), _mm512_mul_ps(m0, d), acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ms1), _mm512_mul_ps(m1, d), acc[r][1]);
            }
        }
    }
    const __mmask16 k0 = nvalid >= 16 ? 0xFFFF : (__mmask16)((1u << nvalid) - 1);
    const __mmask16 k1 = nvalid >= 32 ? 0xFFFF : nvalid <= 16 ? 0 : (__mmask16)((1u << (nvalid - 16)) - 1);
    for (int r = 0; r < R; r++) {
        _mm512_mask_storeu_ps(y + r * ldy, k0, acc[r][0]);
        _mm512_mask_storeu_ps(y + r * ldy + 16, k1, acc[r][1]);
    }
#else /* the same operations in the same order, one output at a time */
    const int32_t *pk = (const int32_t *)tl->pk;
    for (int r = 0; r < R; r++)
        for (int col = 0; col < nvalid; col++) {
            float acc = 0.f;
            for (int64_t g = 0; g < k / G; g++) {
                int32_t is = 0;
                for (int64_t sb = g * G / S; sb < (g + 1) * G / S; sb++) {
                    int32_t s = 0;
                    for (int64_t l = sb * S; l < (sb + 1) * S; l++)
                        s += (int32_t)a[r * lda + l] * ((const int8_t *)(pk + (l / 4) * I8_NC + col))[l % 4];
                    is += fmt == I8_Q8_K ? s * tl->isc[sb * I8_NC + col] : s;
                }
                const float d = xd[r * ldd + g];
                acc = fmaf((float)(is - tl->corr[g * I8_NC + col]), tl->wd[g * I8_NC + col] * d, acc);
                if (fmt == I8_Q8_1) acc = fmaf(tl->wm[g * I8_NC + col], xs[r * ldd + g], acc);
                if (mins) {
                    int32_t ms = 0;
                    for (int p = 0; p < 4; p++) {
                        const int32_t pair = bs[r * ldb + 4 * g + p];
                        const int16_t *pp = tl->pm + ((g * 4 + p) * I8_NC + col) * 2;
                        ms += (int32_t)pp[0] * (int16_t)(pair & 0xFFFF) + (int32_t)pp[1] * (int16_t)((uint32_t)pair >> 16);
                    }
                    acc = fmaf((float)ms, tl->wm[g * I8_NC + col] * d, acc);
                }
            }
            y[r * ldy + col] = acc;
        }
#endif
}

#define I8_CALL(fmt, S, mins) \
    i8_kernel(&tl, k, a + i * k, k, xd + i * ng, xs + i * ng, ng, bs + i * (k / 64), k / 64, R, \
              y + i * n + c0, n, nvalid, fmt, S, mins)

/* y [t, n] = x [t, k] . W^T through int8 activations in ggml's vec_dot_type of `type`, W's rows
 * the parts' (see block_rows); one parallel region: the activations quantized, then each
 * thread's tiles of I8_NC rows. Returns 0, or -1 for a type not covered, k not a multiple of
 * its group, bad parts or no memory (y then unset). */
int block_gemm_i8(int type, int64_t nparts, const uint8_t *const *parts, const int64_t *rows,
                  int64_t k, int64_t t, const float *x, float *y, int threads) {
    if (nparts < 1 || nparts > 8 || !i8_format(type) || k % i8_group(type)) return -1;
    int64_t n = 0;
    for (int64_t p = 0; p < nparts; p++) n += rows[p];
    const int G = i8_group(type), S = i8_sub(type), fmt = i8_format(type);
    const int64_t tp = (t + I8_R - 1) / I8_R * I8_R, ng = k / G, rb = block_row_bytes(type, k);
    uint8_t *a = calloc((size_t)(tp * k), 1);
    float *xd = calloc((size_t)(tp * ng), sizeof(float)), *xs = calloc((size_t)(tp * ng), sizeof(float));
    int32_t *bs = calloc((size_t)(tp * k / 64 + 1), sizeof(int32_t));
    if (!a || !xd || !xs || !bs) { free(a), free(xd), free(xs), free(bs); return -1; }
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < t; i++)
            i8_quantize(type, x + i * k, k, a + i * k, xd + i * ng, xs + i * ng, bs + i * (k / 64));
        i8_tile_t tl = {aligned_alloc(64, (size_t)k * I8_NC), aligned_alloc(64, (size_t)(k / 16) * I8_NC * 4),
                        aligned_alloc(64, (size_t)ng * I8_NC * 4), aligned_alloc(64, (size_t)ng * I8_NC * 4),
                        aligned_alloc(64, (size_t)ng * I8_NC * 4), aligned_alloc(64, (size_t)(k / 64 + 1) * I8_NC * 4)};
#pragma omp for schedule(static)
        for (int64_t c0 = 0; c0 < n; c0 += I8_NC) {
            if (!tl.pk || !tl.isc || !tl.corr || !tl.wd || !tl.wm || !tl.pm) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            const uint8_t *wrow[I8_NC];
            const int nvalid = n - c0 < I8_NC ? (int)(n - c0) : I8_NC;
            for (int col = 0; col < nvalid; col++) {
                int64_t p = 0, rr = c0 + col;
                while (p + 1 < nparts && rr >= rows[p]) rr -= rows[p], p++;
                wrow[col] = parts[p] + rr * rb;
            }
            i8_tile(type, wrow, nvalid, k, &tl);
            for (int64_t i = 0; i < tp; i += I8_R) {
                const int R = t - i < I8_R ? (int)(t - i) : I8_R;
                if (fmt == I8_Q8_0) I8_CALL(I8_Q8_0, 32, 0);
                else if (fmt == I8_Q8_1) I8_CALL(I8_Q8_1, 32, 0);
                else if (S == 16) I8_CALL(I8_Q8_K, 16, 0);
                else if (i8_mins(type)) I8_CALL(I8_Q8_K, 32, 1);
                else I8_CALL(I8_Q8_K, 32, 0);
            }
        }
        free(tl.pk), free(tl.isc), free(tl.corr), free(tl.wd), free(tl.wm), free(tl.pm);
    }
    free(a), free(xd), free(xs), free(bs);
    return failed ? -1 : 0;
}
#endif /* LOCALLLM_I8_GEMM_H */
