/* Prompt GEMMs over the file's blocks with int16 activations (included by block_linear.c):
 * y [t, n] = x [t, k] . W^T, x rounded to int16 codes per 32 values (scale amax / qmax, qmax
 * 32767, 16383 for Q6_K: 1.5e-5 / 3e-5 of the group's largest value), each weight
 * row decoded once per tile to its small integer codes per 32 values with a float scale and
 * minimum (ggml's values exactly: code x scale + min). Each 32 values' integer sum is exact in
 * int32 (|code| <= 4096 for Q6_K with its scale folded in, x 16383 x 32 < 2^31); the float terms
 * are then added in one fixed order per output, so a row's result does not depend on the call's
 * other rows (a prompt alone and batched give the same bits). AVX512-VNNI `vpdpwssd` multiplies
 * 32 pairs per instruction, twice the fp32 FMA's rate; plain C elsewhere gives the same bits. */
#ifndef LOCALLLM_I16_GEMM_H
#define LOCALLLM_I16_GEMM_H
#include <stdlib.h>
#include <string.h>
#include "block_dequant.h"

/* activation codes in [-qmax, qmax]: Q6_K's folded codes need 16383 for the int32 bound above;
 * the others' (|code| <= 127) take the whole int16 range */
static inline int i16_qmax(int type) { return type == Q6_K ? 16383 : 32767; }
#define I16_NC 32      /* weight rows per tile: two 16-lane vectors */
#define I16_R 6        /* activation rows per microkernel step (rows are padded to a multiple) */

#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(BLOCK_DOTS_AVX2)
/* The 32 codes of sub-block j as bytes (those of i16_sub; Q6_K's q - 32 without its scales),
 * in a vector register: 0 for a type it does not cover. Inlined: with a literal type (i16_block32)
 * the switch folds away. */
static inline __attribute__((always_inline)) int codes8_v(int type, const uint8_t *w, int64_t j,
                                                          __m256i *out) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    __m256i v;
    switch (type) {
    case Q4_K: case Q5_K: {
        const uint8_t *b = w + (j / 8) * (type == Q4_K ? 144 : 176);
        const int g = (int)(j % 8);
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + (type == Q4_K ? 16 : 48) + 32 * (g / 2)));
        v = _mm256_and_si256(g % 2 ? _mm256_srli_epi16(q, 4) : q, lo4);
        if (type == Q5_K) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 16));
            v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, g), _mm256_set1_epi8(1)), 4));
        }
        break;
    }
    case Q6_K: {
        const uint8_t *b = w + (j / 8) * 210;
        const int h = (int)(j % 8) / 4, i = (int)(j % 4);
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + (i % 2) * 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        v = _mm256_and_si256(i < 2 ? ql : _mm256_srli_epi16(ql, 4), lo4);
        v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * i), _mm256_set1_epi8(3)), 4));
        v = _mm256_sub_epi8(v, _mm256_set1_epi8(32));
        break;
    }
    case Q8_0: v = _mm256_loadu_si256((const __m256i *)(w + j * 34 + 2)); break;
    case Q4_0: v = _mm256_sub_epi8(nibbles32(w + j * 18 + 2), _mm256_set1_epi8(8)); break;
    case Q4_1: v = nibbles32(w + j * 20 + 4); break;
    case Q5_0: {
        const uint8_t *b = w + j * 22;
        v = _mm256_sub_epi8(_mm256_or_si256(nibbles32(b + 6), fifth_bits(b + 2)), _mm256_set1_epi8(16));
        break;
    }
    case Q5_1: v = _mm256_or_si256(nibbles32(w + j * 24 + 8), fifth_bits(w + j * 24 + 4)); break;
    case MXFP4: {
        const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)FP4_VALUES));
        v = _mm256_shuffle_epi8(tab, nibbles32(w + j * 17 + 1));
        break;
    }
    case IQ4_NL: case IQ4_XS: {
        const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4NL_VALUES));
        const uint8_t *qs = type == IQ4_NL ? w + j * 18 + 2 : w + (j / 8) * 136 + 8 + 16 * (j % 8);
        v = _mm256_shuffle_epi8(tab, nibbles32(qs));
        break;
    }
    default: return 0;
    }
    *out = v;
    return 1;
}

/* i16_sub's codes in vector registers (its scalar loops took 1-2.5 ns a value: a third of a
 * 512-row Q6_K call); the same integers. Returns 0 for a type it does not cover. */
static int i16_codes_v(int type, const uint8_t *w, int64_t j, int16_t *c) {
    __m256i v;
    if (!codes8_v(type, w, j, &v)) return 0;
    if (type == Q6_K) { /* the scale of each 16 folded in */
        const uint8_t *b = w + (j / 8) * 210;
        const int h = (int)(j % 8) / 4, i = (int)(j % 4);
        const int8_t *sc = (const int8_t *)(b + 192 + 8 * h);
        const __m512i s = _mm512_inserti64x4(_mm512_set1_epi16(sc[2 * i]), _mm256_set1_epi16(sc[2 * i + 1]), 1);
        _mm512_storeu_si512(c, _mm512_mullo_epi16(_mm512_cvtepi8_epi16(v), s));
        return 1;
    }
    _mm512_storeu_si512(c, _mm512_cvtepi8_epi16(v));
    return 1;
}
#else
static int i16_codes_v(int type, const uint8_t *w, int64_t j, int16_t *c) {
    (void)type, (void)w, (void)j, (void)c;
    return 0;
}
#endif

/* Sub-block j (values 32j .. 32j + 31) of a weight row of `type` at w: int16 codes c[32], its
 * scale and minimum: value l = *ws x c[l] + *wm, ggml's float32 value exactly. */
static void i16_sub(int type, const uint8_t *w, int64_t j, int16_t *c, float *ws, float *wm) {
    int v[32];
    *wm = 0.f;
    const int done = i16_codes_v(type, w, j, c); /* then only the scales below */
    switch (type) {
    case Q4_K: case Q5_K: {
        const uint8_t *b = w + (j / 8) * (type == Q4_K ? 144 : 176);
        const int g = (int)(j % 8);
        const uint8_t *qh = type == Q5_K ? b + 16 : NULL;
        const uint8_t *q = b + (type == Q4_K ? 16 : 48) + 32 * (g / 2);
        int s, m;
        scale_min_k4(g, b + 4, &s, &m);
        *ws = h2f(rd16(b)) * (float)s, *wm = -(h2f(rd16(b + 2)) * (float)m);
        for (int l = 0; l < 32 && !done; l++)
            c[l] = (int16_t)((g % 2 ? q[l] >> 4 : q[l] & 0xF) | (qh ? ((qh[l] >> g) & 1) << 4 : 0));
        return;
    }
    case Q6_K: { /* the scales of each 16 folded into the codes: |(q - 32) x sc| <= 4096 */
        const uint8_t *b = w + (j / 8) * 210;
        const int h = (int)(j % 8) / 4, i = (int)(j % 4);
        const uint8_t *ql = b + 64 * h + (i % 2) * 32, *qh = b + 128 + 32 * h;
        const int8_t *sc = (const int8_t *)(b + 192 + 8 * h);
        *ws = h2f(rd16(b + 208));
        for (int l = 0; l < 32 && !done; l++) {
            const int q = (i < 2 ? ql[l] & 0xF : ql[l] >> 4) | (((qh[l] >> (2 * i)) & 3) << 4);
            c[l] = (int16_t)((q - 32) * sc[l / 16 + 2 * i]);
        }
        return;
    }
    case IQ4_XS: {
        const uint8_t *b = w + (j / 8) * 136;
        *ws = h2f(rd16(b)) * (float)iq4xs_scale(b, (int)(j % 8));
        if (done) return;
        codes32(b + 8 + 16 * (j % 8), NULL, v);
        for (int l = 0; l < 32; l++) c[l] = IQ4NL_VALUES[v[l]];
        return;
    }
    case MXFP4: {
        const uint8_t *b = w + j * 17;
        *ws = e8m0_half(b[0]);
        if (done) return;
        codes32(b + 1, NULL, v);
        for (int l = 0; l < 32; l++) c[l] = FP4_VALUES[v[l]];
        return;
    }
    case Q8_0: {
        const uint8_t *b = w + j * 34;
        *ws = h2f(rd16(b));
        for (int l = 0; l < 32 && !done; l++) c[l] = (int8_t)b[2 + l];
        return;
    }
    default: { /* Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL */
        const uint8_t *b = w + j * block_row_bytes(type, 32);
        const int at = type == Q4_0 || type == IQ4_NL ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8;
        if (!done) codes32(b + at, type == Q5_0 ? b + 2 : type == Q5_1 ? b + 4 : NULL, v);
        *ws = h2f(rd16(b));
        if (type == Q4_1 || type == Q5_1) *wm = h2f(rd16(b + 2));
        const int off = type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0;
        for (int l = 0; l < 32 && !done; l++) c[l] = (int16_t)(type == IQ4_NL ? IQ4NL_VALUES[v[l]] : v[l] - off);
        return;
    }
    }
}

/* x [k] -> a [k] int16 codes in [-qmax, qmax], da [k/32] scales, as [k/32] = da x (sum of the group's codes) */
static void i16_quantize(const float *x, int64_t k, int qmax, int16_t *a, float *da, float *as) {
    for (int64_t b = 0; b < k / 32; b++) {
        const float *xb = x + 32 * b;
#if defined(__AVX512F__) && defined(__AVX512BW__) /* the same values (~5 % of a call in scalar) */
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float inv = amax > 0.f ? (float)qmax / amax : 0.f;
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(inv)));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(inv)));
        _mm256_storeu_si256((__m256i *)(a + 32 * b), _mm512_cvtepi32_epi16(q0));
        _mm256_storeu_si256((__m256i *)(a + 32 * b + 16), _mm512_cvtepi32_epi16(q1));
        const int s = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
        const float inv = amax > 0.f ? (float)qmax / amax : 0.f;
        int s = 0;
        for (int i = 0; i < 32; i++) s += a[32 * b + i] = (int16_t)round_even(xb[i] * inv);
#endif
        da[b] = amax / (float)qmax;
        as[b] = da[b] * (float)s;
    }
}

#if defined(__AVX512F__)
/* r[c] (16 int32 each) -> r[p][c] = the old r[c][p]: four rounds of 16 shuffles (the tile's
 * scatter of each column's 16 code pairs, ~40 % of a 64-row call's time, did this before) */
static inline void transpose16_epi32(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 16; i += 2) {
        a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int g = 0; g < 16; g += 4) { /* b[g + q], lane L: rows g .. g + 3 at element 4L + q */
        b[g] = _mm512_unpacklo_epi64(a[g], a[g + 2]);
        b[g + 1] = _mm512_unpackhi_epi64(a[g], a[g + 2]);
        b[g + 2] = _mm512_unpacklo_epi64(a[g + 1], a[g + 3]);
        b[g + 3] = _mm512_unpackhi_epi64(a[g + 1], a[g + 3]);
    }
    for (int q = 0; q < 4; q++) { /* the 4 x 4 lanes of b[q], b[4 + q], b[8 + q], b[12 + q] */
        const __m512i c0 = _mm512_shuffle_i32x4(b[q], b[4 + q], 0x88);
        const __m512i c1 = _mm512_shuffle_i32x4(b[q], b[4 + q], 0xDD);
        const __m512i c2 = _mm512_shuffle_i32x4(b[8 + q], b[12 + q], 0x88);
        const __m512i c3 = _mm512_shuffle_i32x4(b[8 + q], b[12 + q], 0xDD);
        r[q] = _mm512_shuffle_i32x4(c0, c2, 0x88);
        r[4 + q] = _mm512_shuffle_i32x4(c1, c3, 0x88);
        r[8 + q] = _mm512_shuffle_i32x4(c0, c2, 0xDD);
        r[12 + q] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
    }
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(BLOCK_DOTS_AVX2)
/* i16_sub of the 8 sub-blocks of super-block jb of a Q4_K / Q5_K / Q6_K row at once (the same
 * integers and floats; one pass over its bytes, its fp16 scales read once): codes c[8][32], ws[8],
 * wm[8]. Returns 0 for another type. */
static int i16_super_v(int type, const uint8_t *w, int64_t jb, int16_t (*c)[32], float *ws,
                       float *wm) {
    if (type == Q6_K) {
        const float d = h2f(rd16(w + jb * 210 + 208));
        for (int g = 0; g < 8; g++) i16_codes_v(type, w, 8 * jb + g, c[g]), ws[g] = d, wm[g] = 0.f;
        return 1;
    }
    if (type != Q4_K && type != Q5_K) return 0;
    const uint8_t *b = w + jb * (type == Q4_K ? 144 : 176);
    const float d = h2f(rd16(b)), dm = h2f(rd16(b + 2));
    const __m256i lo4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const __m256i h = type == Q5_K ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
    const uint8_t *q = b + (type == Q4_K ? 16 : 48);
    for (int pr = 0; pr < 4; pr++) { /* sub-blocks 2 pr (low nibbles) and 2 pr + 1 (high) */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * pr));
        __m256i lo = _mm256_and_si256(v, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
        if (type == Q5_K) {
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * pr), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * pr + 1), one), 4));
        }
        _mm512_storeu_si512(c[2 * pr], _mm512_cvtepi8_epi16(lo));
        _mm512_storeu_si512(c[2 * pr + 1], _mm512_cvtepi8_epi16(hi));
    }
    for (int g = 0; g < 8; g++) {
        int sc, mn;
        scale_min_k4(g, b + 4, &sc, &mn);
        ws[g] = d * (float)sc, wm[g] = -(dm * (float)mn);
    }
    return 1;
}
#define I16_SUPER(type) ((type) == Q4_K || (type) == Q5_K || (type) == Q6_K)
#else
static int i16_super_v(int type, const uint8_t *w, int64_t jb, int16_t (*c)[32], float *ws,
                       float *wm) {
    (void)type, (void)w, (void)jb, (void)c, (void)ws, (void)wm;
    return 0;
}
#define I16_SUPER(type) 0
#endif

#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(BLOCK_DOTS_AVX2)
/* i16_sub of a 32-value block type (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4, Q8_0), inlined where
 * the type is a literal: through i16_sub's switch and the out-of-line codes8_v these types'
 * tiles took ~26 % of a 64-token Q4_0 prompt (a Q4_K tile decodes a super-block a call) */
static inline __attribute__((always_inline)) void i16_block32(int type, const uint8_t *w,
                                                              int64_t j, int16_t *c, float *ws,
                                                              float *wm) {
    __m256i v;
    codes8_v(type, w, j, &v);
    _mm512_store_si512(c, _mm512_cvtepi8_epi16(v));
    const uint8_t *b = w + j * block_row_bytes(type, 32);
    *ws = type == MXFP4 ? e8m0_half(b[0]) : h2f(rd16(b));
    *wm = type == Q4_1 || type == Q5_1 ? h2f(rd16(b + 2)) : 0.f;
}
#define I16_SUB_Q4_0(w, j, c, s, m) i16_block32(Q4_0, w, j, c, s, m)
#define I16_SUB_Q4_1(w, j, c, s, m) i16_block32(Q4_1, w, j, c, s, m)
#define I16_SUB_Q5_0(w, j, c, s, m) i16_block32(Q5_0, w, j, c, s, m)
#define I16_SUB_Q5_1(w, j, c, s, m) i16_block32(Q5_1, w, j, c, s, m)
#define I16_SUB_IQ4_NL(w, j, c, s, m) i16_block32(IQ4_NL, w, j, c, s, m)
#define I16_SUB_MXFP4(w, j, c, s, m) i16_block32(MXFP4, w, j, c, s, m)
#define I16_SUB_Q8_0(w, j, c, s, m) i16_block32(Q8_0, w, j, c, s, m)
#endif

/* i16_tile's loop over the 32-value sub-blocks, with `sub` decoding one (a literal type: i16_sub
 * or i16_block32 specialised) */
#define I16_TILE_LOOP(SUB)                                                                        \
    for (int64_t j = 0; j < k / 32; j++)                                                          \
        for (int h = 0; h < I16_NC; h += 16) { /* 16 columns' sub-block j, transposed */          \
            __m512i r[16];                                                                        \
            for (int col = 0; col < 16; col++) {                                                  \
                float s = 0.f, m = 0.f;                                                           \
                if (h + col < nvalid) SUB(wrow[h + col], j, cc[col], &s, &m);                     \
                else memset(cc[col], 0, sizeof cc[col]);                                          \
                ws[j * I16_NC + h + col] = s, wm[j * I16_NC + h + col] = m;                       \
                r[col] = _mm512_load_si512(cc[col]);                                              \
            }                                                                                     \
            transpose16_epi32(r);                                                                 \
            for (int p = 0; p < 16; p++) _mm512_storeu_si512((int32_t *)pk + (j * 16 + p) * I16_NC + h, r[p]); \
        }
#define I16_SUB_ANY(w, j, c, s, m) i16_sub(type, w, j, c, s, m)

/* The tile of weight rows rows0 .. rows0 + I16_NC - 1 (those past n zero): codes as pairs
 * pk [k/2][I16_NC][2], scales ws [k/32][I16_NC] and minimums wm [k/32][I16_NC]. */
static void i16_tile(int type, const uint8_t *const *wrow, int nvalid, int64_t k, int16_t *pk,
                     float *ws, float *wm) {
#if defined(__AVX512F__)
    _Alignas(64) int16_t cc[16][32];
    if (k % 256 == 0 && I16_SUPER(type)) { /* Q4_K, Q5_K, Q6_K: a super-block at a time */
        _Alignas(64) int16_t cs[16][8][32];
        float s8[16][8], m8[16][8];
        for (int64_t jb = 0; jb < k / 256; jb++)
            for (int h = 0; h < I16_NC; h += 16) {
                for (int col = 0; col < 16; col++) {
                    if (h + col < nvalid) i16_super_v(type, wrow[h + col], jb, cs[col], s8[col], m8[col]);
                    else memset(cs[col], 0, sizeof cs[col]), memset(s8[col], 0, 32), memset(m8[col], 0, 32);
                }
                for (int g = 0; g < 8; g++) {
                    const int64_t j = 8 * jb + g;
                    __m512i r[16];
                    for (int col = 0; col < 16; col++) {
                        ws[j * I16_NC + h + col] = s8[col][g], wm[j * I16_NC + h + col] = m8[col][g];
                        r[col] = _mm512_load_si512(cs[col][g]);
                    }
                    transpose16_epi32(r);
                    for (int p = 0; p < 16; p++) _mm512_storeu_si512((int32_t *)pk + (j * 16 + p) * I16_NC + h, r[p]);
                }
            }
        return;
    }
#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(BLOCK_DOTS_AVX2)
    switch (type) {
    case Q4_0: I16_TILE_LOOP(I16_SUB_Q4_0) return;
    case Q4_1: I16_TILE_LOOP(I16_SUB_Q4_1) return;
    case Q5_0: I16_TILE_LOOP(I16_SUB_Q5_0) return;
    case Q5_1: I16_TILE_LOOP(I16_SUB_Q5_1) return;
    case IQ4_NL: I16_TILE_LOOP(I16_SUB_IQ4_NL) return;
    case MXFP4: I16_TILE_LOOP(I16_SUB_MXFP4) return;
    case Q8_0: I16_TILE_LOOP(I16_SUB_Q8_0) return;
    default: I16_TILE_LOOP(I16_SUB_ANY) return;
    }
#else
    I16_TILE_LOOP(I16_SUB_ANY)
#endif
#else
    int16_t c[32];
    for (int64_t j = 0; j < k / 32; j++) /* (columns inner: the writes stay in 2 KiB) */
        for (int col = 0; col < I16_NC; col++) {
            float s = 0.f, m = 0.f;
            if (col < nvalid) i16_sub(type, wrow[col], j, c, &s, &m);
            else memset(c, 0, sizeof c);
            ws[j * I16_NC + col] = s, wm[j * I16_NC + col] = m;
            for (int l = 0; l < 32; l++) pk[((j * 16 + l / 2) * I16_NC + col) * 2 + l % 2] = c[l];
        }
#endif
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
/* acc += pair products of x and w, in place: with the intrinsic, gcc 12 copied every
 * accumulator to another register and back on each pair (24 moves a 12 products) */
#define I16_DPWSSD(acc, x, w) __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w))
#endif

/* y rows 0 .. I16_R - 1 (stride ldy; those >= R not stored), columns 0 .. nvalid - 1 = the tile
 * times activation rows a / da / as (strides lda, ldd); `mins` 0 (a literal at each call) for
 * the types without minimums, whose terms would add zeros */
static inline __attribute__((always_inline)) void
i16_kernel(const int16_t *pk, const float *ws, const float *wm, int64_t k, const int16_t *a,
           int64_t lda, const float *da, const float *as, int64_t ldd, int R, float *y,
           int64_t ldy, int nvalid, const int mins) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    __m512 acc[I16_R][2];
    for (int r = 0; r < I16_R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k / 32; j++) {
        __m512i s[I16_R][2];
        for (int r = 0; r < I16_R; r++) s[r][0] = s[r][1] = _mm512_setzero_si512();
        const int16_t *pj = pk + j * 16 * I16_NC * 2;
        for (int p = 0; p < 16; p++) {
            const __m512i w0 = _mm512_loadu_si512(pj + p * 64), w1 = _mm512_loadu_si512(pj + p * 64 + 32);
            for (int r = 0; r < I16_R; r++) {
                int32_t pair;
                memcpy(&pair, a + r * lda + 32 * j + 2 * p, 4);
                const __m512i x = _mm512_set1_epi32(pair);
                I16_DPWSSD(s[r][0], x, w0);
                I16_DPWSSD(s[r][1], x, w1);
            }
        }
        const __m512 s0 = _mm512_loadu_ps(ws + j * I16_NC), s1 = _mm512_loadu_ps(ws + j * I16_NC + 16);
        const __m512 m0 = _mm512_loadu_ps(wm + j * I16_NC), m1 = _mm512_loadu_ps(wm + j * I16_NC + 16);
        for (int r = 0; r < I16_R; r++) {
            const __m512 d = _mm512_set1_ps(da[r * ldd + j]), ms = _mm512_set1_ps(as[r * ldd + j]);
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][0]), _mm512_mul_ps(s0, d), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][1]), _mm512_mul_ps(s1, d), acc[r][1]);
            if (mins) {
                acc[r][0] = _mm512_fmadd_ps(m0, ms, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(m1, ms, acc[r][1]);
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
    for (int r = 0; r < R; r++)
        for (int col = 0; col < nvalid; col++) {
            float acc = 0.f;
            for (int64_t j = 0; j < k / 32; j++) {
                int32_t s = 0;
                for (int l = 0; l < 32; l++)
                    s += (int32_t)a[r * lda + 32 * j + l] * pk[((j * 16 + l / 2) * I16_NC + col) * 2 + l % 2];
                const float sc = ws[j * I16_NC + col] * da[r * ldd + j];
                acc = fmaf((float)s, sc, acc);
                if (mins) acc = fmaf(wm[j * I16_NC + col], as[r * ldd + j], acc);
            }
            y[r * ldy + col] = acc;
        }
#endif
}

/* y [t, n] = x [t, k] . W^T through int16 activations, W's rows the parts' (see block_rows);
 * one parallel region: the activations quantized, then each thread's tiles of I16_NC rows.
 * Returns 0, or -1 for bad arguments or no memory (y then unset). */
int block_gemm_i16(int type, int64_t nparts, const uint8_t *const *parts, const int64_t *rows,
                    int64_t k, int64_t t, const float *x, float *y, int threads) {
    if (nparts < 1 || nparts > 8 || k % 32) return -1;
    int64_t n = 0;
    for (int64_t p = 0; p < nparts; p++) n += rows[p];
    const int64_t tp = (t + I16_R - 1) / I16_R * I16_R, g = k / 32, rb = block_row_bytes(type, k);
    const int mins = type == Q4_1 || type == Q5_1 || type == Q4_K || type == Q5_K;
    int16_t *a = calloc((size_t)(tp * k), sizeof(int16_t));
    float *da = calloc((size_t)(tp * g), sizeof(float)), *as = calloc((size_t)(tp * g), sizeof(float));
    if (!a || !da || !as) { free(a), free(da), free(as); return -1; }
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < t; i++) i16_quantize(x + i * k, k, i16_qmax(type), a + i * k, da + i * g, as + i * g);
        int16_t *pk = aligned_alloc(64, (size_t)k * I16_NC * 2);
        float *ws = aligned_alloc(64, (size_t)g * I16_NC * 4), *wm = aligned_alloc(64, (size_t)g * I16_NC * 4);
#pragma omp for schedule(static)
        for (int64_t c0 = 0; c0 < n; c0 += I16_NC) {
            if (!pk || !ws || !wm) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            const uint8_t *wrow[I16_NC];
            const int nvalid = n - c0 < I16_NC ? (int)(n - c0) : I16_NC;
            for (int col = 0; col < nvalid; col++) {
                int64_t p = 0, rr = c0 + col;
                while (p + 1 < nparts && rr >= rows[p]) rr -= rows[p], p++;
                wrow[col] = parts[p] + rr * rb;
            }
            i16_tile(type, wrow, nvalid, k, pk, ws, wm);
            for (int64_t i = 0; i < tp; i += I16_R) {
                const int R = t - i < I16_R ? (int)(t - i) : I16_R;
                if (mins)
                    i16_kernel(pk, ws, wm, k, a + i * k, k, da + i * g, as + i * g, g, R,
                               y + i * n + c0, n, nvalid, 1);
                else
                    i16_kernel(pk, ws, wm, k, a + i * k, k, da + i * g, as + i * g, g, R,
                               y + i * n + c0, n, nvalid, 0);
            }
        }
        free(pk), free(ws), free(wm);
    }
    free(a), free(da), free(as);
    return failed ? -1 : 0;
}
#endif /* LOCALLLM_I16_GEMM_H */
