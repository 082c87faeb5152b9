/* The dense linears' dot products beside quant_dots.h's (included by dense_linear.c): Q4_0, Q4_1,
 * Q5_0, Q5_1, IQ4_NL, MXFP4 (32-value blocks) and IQ4_XS against int8 activations per 32 (ggml's
 * Q8_0 rows with the sums of every 16 codes: the minimum terms of Q4_1 / Q5_1), and Q5_K against
 * llama.cpp's Q8_K (per 256). `*_rows` dot one weight row with R activation rows (R = 1 ..
 * ROWS_MAX, a literal at each call so each count unrolls), its codes decoded once; each row's
 * arithmetic is the one-row dot's, in the same order, so its bits do not depend on R. `*_tile`
 * (the 32-value types and Q8_0): the same dots over up to TILE_ROWS rows laid out as one tile.
 * AVX2 forms (VNNI through quant_dots.h's dot_u8s8) and plain C ones for other CPUs. */
#ifndef LOCALLLM_BLOCK_DOTS_H
#define LOCALLLM_BLOCK_DOTS_H
#include "quant_dots.h"

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q5_K = 13, IQ4_NL = 20, IQ4_XS = 23, MXFP4 = 39 };

static const int8_t IQ4NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                        1,    13,   25,  38,  53,  69,  89,  113};

/* MXFP4's E2M1 values doubled (ggml's kvalues_mxfp4); its E8M0 scale is taken at half */
static const int8_t FP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* ggml's GGML_E8M0_TO_FP32_HALF: 2^(e - 128), the two smallest as denormals; as a table of the
 * float bits (one load a block where the shifts and compares took ~8 instructions of the ~25 an
 * MXFP4 block's dot spent, at the CPU's issue width) */
#define E8M0_BITS(e) ((e) < 2 ? 0x00200000u << (e) : (uint32_t)((e) - 1) << 23)
#define E8M0_4(e) E8M0_BITS(e), E8M0_BITS((e) + 1), E8M0_BITS((e) + 2), E8M0_BITS((e) + 3)
#define E8M0_16(e) E8M0_4(e), E8M0_4((e) + 4), E8M0_4((e) + 8), E8M0_4((e) + 12)
#define E8M0_64(e) E8M0_16(e), E8M0_16((e) + 16), E8M0_16((e) + 32), E8M0_16((e) + 48)
static const uint32_t E8M0_HALF[256] = {E8M0_64(0), E8M0_64(64), E8M0_64(128), E8M0_64(192)};
static inline float e8m0_half(uint8_t e) {
    float f;
    memcpy(&f, &E8M0_HALF[e], 4);
    return f;
}
/* a 32-value block's scale: an fp16 at its start (Q4_0 .. IQ4_NL, Q8_0), or MXFP4's E8M0 byte */
static inline float f16_at(const uint8_t *b) { return h2f(rd16(b)); }
static inline float e8m0_at(const uint8_t *b) { return e8m0_half(b[0]); }
static inline float scale32(int type, const uint8_t *b) {
    return type == MXFP4 ? e8m0_at(b) : f16_at(b);
}

/* IQ4_XS sub-block ib's signed scale (ls - 32) */
static inline int iq4xs_scale(const uint8_t *w, int ib) {
    const int lo = (w[4 + ib / 2] >> (4 * (ib % 2))) & 0xF, hi = (rd16(w + 2) >> (2 * ib)) & 3;
    return (lo | (hi << 4)) - 32;
}

#if defined(__AVX2__) && defined(__FMA__)
/* 32 codes of a 16-byte nibble run: lane l < 16 the low nibble of byte l, lane 16 + l its high.
 * The run loaded into both halves (a load, not a shuffle) and the high half shifted by 4: these
 * dots were bound by the CPU's issue width, the shuffle ports among the busiest. */
static inline __m256i nibbles32(const uint8_t *qs) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_set_epi32(4, 4, 4, 4, 0, 0, 0, 0)),
                            _mm256_set1_epi8(0x0F));
}

/* a block's scale in every lane, loaded as such: the fp16 at its start, or MXFP4's E8M0 byte */
static inline __m256 f16_v(const uint8_t *b) {
    return _mm256_cvtph_ps(_mm_set1_epi16((short)rd16(b)));
}
static inline __m256 e8m0_v(const uint8_t *b) {
    return _mm256_castsi256_ps(_mm256_set1_epi32((int)E8M0_HALF[b[0]]));
}

/* 0x10 in lane i where bit i of the 32-bit word at p is set (Q5_0 / Q5_1's fifth bits) */
static inline __m256i fifth_bits(const uint8_t *p) {
    uint32_t x;
    memcpy(&x, p, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0x0000000000000000);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuf);
    b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_and_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

/* signed weight codes w times int8 x: the signs moved onto x so w enters unsigned */
static inline __m256i dot_s8s8(__m256i w, __m256i x) {
    return dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

/* One 32-value block of every kind at wb: its codes as bytes (signed where `sgn`) and its
 * scale(s); acc[r] += dot x d x dx; the minimum terms (Q4_1 / Q5_1) summed in floats beside.
 * Even and odd blocks go to their own accumulators (a0 / a1): one chain of dependent
 * multiply-adds through every block was the limit (4 cycles of latency for ~2 of work). */
#define BLOCK_ONE(A, M, B, CODES, SGN, HASMIN, MINAT, SCALE)                                             \
    {                                                                                             \
        const __m256 d = SCALE(wb);                                                               \
        const __m256i q = CODES;                                                                  \
        for (int r = 0; r < R; r++) {                                                             \
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(q8[r] + 32 * (B)));           \
            const __m256i p = SGN ? dot_s8s8(q, xv) : dot_u8s8(q, xv);                           \
            const __m256 dd = _mm256_mul_ps(d, _mm256_broadcast_ss(d8[r] + (B)));                 \
            A[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), dd, A[r]);                              \
            if (HASMIN)                                                                           \
                M[r] += h2f(rd16(wb + (MINAT))) * d8[r][B] * (float)(bs[r][2 * (B)] + bs[r][2 * (B) + 1]); \
        }                                                                                         \
    }
#define BLOCK_ROWS_LOOP(NB, BYTES, CODES, SGN, HASMIN, MINAT, SCALE)                                     \
    __m256 a0[ROWS_MAX], a1[ROWS_MAX];                                                            \
    float m0[ROWS_MAX], m1[ROWS_MAX];                                                             \
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps(), m0[r] = m1[r] = 0.f;        \
    int64_t b = 0;                                                                                \
    for (; b + 1 < (NB); b += 2) {                                                                \
        const uint8_t *wb = w + b * (BYTES);                                                      \
        BLOCK_ONE(a0, m0, b, CODES, SGN, HASMIN, MINAT, SCALE)                                           \
        wb += (BYTES);                                                                            \
        BLOCK_ONE(a1, m1, b + 1, CODES, SGN, HASMIN, MINAT, SCALE)                                       \
    }                                                                                             \
    if (b < (NB)) {                                                                               \
        const uint8_t *wb = w + b * (BYTES);                                                      \
        BLOCK_ONE(a0, m0, b, CODES, SGN, HASMIN, MINAT, SCALE)                                           \
    }                                                                                             \
    for (int r = 0; r < R; r++) out[r] = hsum(_mm256_add_ps(a0[r], a1[r])) + (m0[r] + m1[r]);

#define BLOCK_ARGS                                                                   \
    const uint8_t *w, const int8_t *const *q8, const float *const *d8,              \
        const int16_t *const *bs, int64_t nb, int R, float *out

static inline void dot_q4_0_rows(BLOCK_ARGS) {
    (void)bs;
    BLOCK_ROWS_LOOP(nb, 18, _mm256_sub_epi8(nibbles32(wb + 2), _mm256_set1_epi8(8)), 1, 0, 0, f16_v)
}
static inline void dot_q4_1_rows(BLOCK_ARGS) { BLOCK_ROWS_LOOP(nb, 20, nibbles32(wb + 4), 0, 1, 2, f16_v) }
static inline void dot_q5_0_rows(BLOCK_ARGS) {
    (void)bs;
    BLOCK_ROWS_LOOP(nb, 22,
                    _mm256_sub_epi8(_mm256_or_si256(nibbles32(wb + 6), fifth_bits(wb + 2)),
                                    _mm256_set1_epi8(16)),
                    1, 0, 0, f16_v)
}
static inline void dot_q5_1_rows(BLOCK_ARGS) {
    BLOCK_ROWS_LOOP(nb, 24, _mm256_or_si256(nibbles32(wb + 8), fifth_bits(wb + 4)), 0, 1, 2, f16_v)
}
static inline void dot_iq4_nl_rows(BLOCK_ARGS) {
    (void)bs;
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4NL_VALUES));
    BLOCK_ROWS_LOOP(nb, 18, _mm256_shuffle_epi8(lut, nibbles32(wb + 2)), 1, 0, 0, f16_v)
}
static inline void dot_mxfp4_rows(BLOCK_ARGS) { /* IQ4_NL's dot: another table, an E8M0 scale */
    (void)bs;
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)FP4_VALUES));
    BLOCK_ROWS_LOOP(nb, 17, _mm256_shuffle_epi8(lut, nibbles32(wb + 1)), 1, 0, 0, e8m0_v)
}

/* The same dots over a row tile (block_linear.c's `tile_rows` lays it out): R <= TILE_ROWS
 * activation rows interleaved per block (qt: block b's 32 codes of row r at 32 (R b + r)), their
 * scales and the float sums of each block's codes transposed (dt / st: [nb][8], lanes >= R zero),
 * so the minimum terms of all R rows are one vector multiply-add per block and the scale of every
 * row one vector multiply; a row's float operations are the `*_rows` ones, in the same order. */
#if defined(__AVX512VL__)
#define TILE_ROWS 8 /* 16 accumulators: the 32 vector registers of AVX-512 hold them */
#else
#define TILE_ROWS 4
#endif
#define TILE_ONE(A, MV, B, CODES, SGN, HASMIN, MINAT, SCALE)                                             \
    {                                                                                             \
        const __m256i q = CODES;                                                                  \
        const __m256 dv = _mm256_loadu_ps(dt + 8 * (B));                                          \
        float sc[8];                                                                              \
        _mm256_storeu_ps(sc, _mm256_mul_ps(SCALE(wb), dv));                                       \
        const int8_t *xb = qt + (B) * R * 32;                                                     \
        for (int r = 0; r < R; r++) {                                                             \
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xb + 32 * r));                \
            const __m256i p = SGN ? dot_s8s8(q, xv) : dot_u8s8(q, xv);                           \
            A[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(sc + r), A[r]);    \
        }                                                                                         \
        if (HASMIN)                                                                               \
            MV = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(h2f(rd16(wb + (MINAT)))), dv),      \
                                 _mm256_loadu_ps(st + 8 * (B)), MV);                              \
    }
#define TILE_LOOP(NB, BYTES, CODES, SGN, HASMIN, MINAT, SCALE)                                           \
    __m256 a0[TILE_ROWS], a1[TILE_ROWS], m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();     \
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();                              \
    int64_t b = 0;                                                                                \
    for (; b + 1 < (NB); b += 2) {                                                                \
        const uint8_t *wb = w + b * (BYTES);                                                      \
        TILE_ONE(a0, m0, b, CODES, SGN, HASMIN, MINAT, SCALE)                                            \
        wb += (BYTES);                                                                            \
        TILE_ONE(a1, m1, b + 1, CODES, SGN, HASMIN, MINAT, SCALE)                                        \
    }                                                                                             \
    if (b < (NB)) {                                                                               \
        const uint8_t *wb = w + b * (BYTES);                                                      \
        TILE_ONE(a0, m0, b, CODES, SGN, HASMIN, MINAT, SCALE)                                            \
    }                                                                                             \
    float ms[8];                                                                                  \
    _mm256_storeu_ps(ms, _mm256_add_ps(m0, m1));                                                  \
    for (int r = 0; r < R; r++) out[r] = hsum(_mm256_add_ps(a0[r], a1[r])) + ms[r];

#define TILE_ARGS                                                                         \
    const uint8_t *w, const int8_t *qt, const float *dt, const float *st, int64_t nb, const int R, \
        float *out
#define TILE_FN static inline __attribute__((always_inline)) void

TILE_FN dot_q4_0_tile(TILE_ARGS) {
    (void)st;
    TILE_LOOP(nb, 18, _mm256_sub_epi8(nibbles32(wb + 2), _mm256_set1_epi8(8)), 1, 0, 0, f16_v)
}
TILE_FN dot_q4_1_tile(TILE_ARGS) { TILE_LOOP(nb, 20, nibbles32(wb + 4), 0, 1, 2, f16_v) }
TILE_FN dot_q5_0_tile(TILE_ARGS) {
    (void)st;
    TILE_LOOP(nb, 22,
              _mm256_sub_epi8(_mm256_or_si256(nibbles32(wb + 6), fifth_bits(wb + 2)),
                              _mm256_set1_epi8(16)),
              1, 0, 0, f16_v)
}
TILE_FN dot_q5_1_tile(TILE_ARGS) {
    TILE_LOOP(nb, 24, _mm256_or_si256(nibbles32(wb + 8), fifth_bits(wb + 4)), 0, 1, 2, f16_v)
}
TILE_FN dot_iq4_nl_tile(TILE_ARGS) {
    (void)st;
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4NL_VALUES));
    TILE_LOOP(nb, 18, _mm256_shuffle_epi8(lut, nibbles32(wb + 2)), 1, 0, 0, f16_v)
}
TILE_FN dot_mxfp4_tile(TILE_ARGS) {
    (void)st;
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)FP4_VALUES));
    TILE_LOOP(nb, 17, _mm256_shuffle_epi8(lut, nibbles32(wb + 1)), 1, 0, 0, e8m0_v)
}
/* Q8_0 (quant_dots.h's dot_q8_0): one accumulator per row through every block */
TILE_FN dot_q8_0_tile(TILE_ARGS) {
    (void)st;
    __m256 a[TILE_ROWS], m0 = _mm256_setzero_ps();
    for (int r = 0; r < R; r++) a[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + 34 * b;
        TILE_ONE(a, m0, b, _mm256_loadu_si256((const __m256i *)(wb + 2)), 1, 0, 0, f16_v)
    }
    for (int r = 0; r < R; r++) out[r] = hsum(a[r]);
}

/* IQ4_XS: 8 sub-blocks of 32 per 256, each its own 6-bit scale; activations per 32 */
static inline void dot_iq4_xs_rows(BLOCK_ARGS) {
    (void)bs;
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4NL_VALUES));
    __m256 acc[ROWS_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 136) {
        const float d = h2f(rd16(w));
        for (int ib = 0; ib < 8; ib++) {
            const __m256i q = _mm256_shuffle_epi8(lut, nibbles32(w + 8 + 16 * ib));
            const float dl = d * (float)iq4xs_scale(w, ib);
            for (int r = 0; r < R; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(q8[r] + 256 * b + 32 * ib));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_s8s8(q, xv)),
                                         _mm256_set1_ps(dl * d8[r][8 * b + ib]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]);
}

/* Q5_K against Q8_K: dot_q4_k_rows (its VNNI multiply-adds and scale shuffles too) with each
 * code's fifth bit from qh (bit 2j / 2j + 1 of byte l for sub-blocks 2j / 2j + 1); codes <= 31,
 * so the 16-bit pair sums stay below 2 x 31 x 127. */
ROWS_FN dot_q5_k_rows(BLOCK_ARGS) {
    const __m256i low = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    __m256 acc[ROWS_MAX], macc[ROWS_MAX];
    for (int r = 0; r < R; r++) acc[r] = macc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 176) {
        const uint8_t *qh = w + 16, *qs = w + 48;
        const __m128 ddm = d_dmin(w);
        const __m128i smv = scales_mins_k4v(w + 4);
        const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(smv));
        const __m128i m16 = _mm_cvtepu8_epi16(_mm_srli_si128(smv, 8));
        const __m256i mdup =
            _mm256_set_m128i(_mm_unpackhi_epi16(m16, m16), _mm_unpacklo_epi16(m16, m16));
        const __m256i hb = _mm256_loadu_si256((const __m256i *)qh);
        __m256i slo[ROWS_MAX], shi[ROWS_MAX];
        for (int r = 0; r < R; r++) slo[r] = shi[r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * j), one);
            const __m256i h2 = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * j + 1), one);
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(q, low), _mm256_slli_epi16(h1, 4));
            const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), low),
                                               _mm256_slli_epi16(h2, 4));
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
            const __m256i bs16 = _mm256_loadu_si256((const __m256i *)(bs[r] + 16 * b));
            const __m256 mterm = _mm256_cvtepi32_ps(_mm256_madd_epi16(bs16, mdup));
            macc[r] = _mm256_fmadd_ps(mterm, _mm256_broadcastss_ps(_mm_movehdup_ps(e)), macc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]) - hsum(macc[r]);
}
#define BLOCK_DOTS_AVX2 1

#else /* plain C: one row at a time, called R times */

#define BLOCK_ARGS                                                                   \
    const uint8_t *w, const int8_t *const *q8, const float *const *d8,              \
        const int16_t *const *bs, int64_t nb, int R, float *out

/* code of value l (0..31) of a 32-value block: nibble run at qs, fifth bits at qh (or NULL) */
static inline int code32(const uint8_t *qs, const uint8_t *qh, int l) {
    int c = l < 16 ? qs[l] & 0xF : qs[l - 16] >> 4;
    if (qh) c |= ((rd16(qh + 2 * (l / 16)) >> (l % 16)) & 1) << 4;
    return c;
}

static float dot32(int type, const uint8_t *w, const int8_t *x, const float *dx,
                   const int16_t *s, int64_t nb) {
    const int bytes = type == MXFP4 ? 17 : type == Q4_0 || type == IQ4_NL ? 18 : type == Q4_1 ? 20
                      : type == Q5_0 ? 22 : 24;
    const int at = type == MXFP4 ? 1 : type == Q4_0 || type == IQ4_NL ? 2 : type == Q4_1 ? 4
                   : type == Q5_0 ? 6 : 8;
    float sum = 0.f;
    for (int64_t b = 0; b < nb; b++, w += bytes, x += 32) {
        const uint8_t *qh = type == Q5_0 ? w + 2 : type == Q5_1 ? w + 4 : NULL;
        int32_t a = 0;
        for (int l = 0; l < 32; l++) {
            int c = code32(w + at, qh, l);
            c = type == Q4_0 ? c - 8 : type == Q5_0 ? c - 16 : type == IQ4_NL ? IQ4NL_VALUES[c]
                : type == MXFP4 ? FP4_VALUES[c] : c;
            a += c * x[l];
        }
        sum += scale32(type, w) * dx[b] * (float)a;
        if (type == Q4_1 || type == Q5_1)
            sum += h2f(rd16(w + 2)) * dx[b] * (float)(s[2 * b] + s[2 * b + 1]);
    }
    return sum;
}

#define ROWS_OF(TYPE)                                                                       \
    for (int r = 0; r < R; r++) out[r] = dot32(TYPE, w, q8[r], d8[r], bs[r], nb);
static void dot_q4_0_rows(BLOCK_ARGS) { ROWS_OF(Q4_0) }
static void dot_q4_1_rows(BLOCK_ARGS) { ROWS_OF(Q4_1) }
static void dot_q5_0_rows(BLOCK_ARGS) { ROWS_OF(Q5_0) }
static void dot_q5_1_rows(BLOCK_ARGS) { ROWS_OF(Q5_1) }
static void dot_iq4_nl_rows(BLOCK_ARGS) { ROWS_OF(IQ4_NL) }
static void dot_mxfp4_rows(BLOCK_ARGS) { ROWS_OF(MXFP4) }

static void dot_iq4_xs_rows(BLOCK_ARGS) {
    for (int r = 0; r < R; r++) {
        const uint8_t *wb = w;
        float sum = 0.f;
        for (int64_t b = 0; b < nb; b++, wb += 136) {
            for (int ib = 0; ib < 8; ib++) {
                const int8_t *x = q8[r] + 256 * b + 32 * ib;
                int32_t a = 0;
                for (int l = 0; l < 32; l++) a += IQ4NL_VALUES[code32(wb + 8 + 16 * ib, NULL, l)] * x[l];
                sum += h2f(rd16(wb)) * (float)iq4xs_scale(wb, ib) * d8[r][8 * b + ib] * (float)a;
            }
        }
        out[r] = sum;
    }
}

static void dot_q5_k_rows(BLOCK_ARGS) {
    for (int r = 0; r < R; r++) {
        const uint8_t *wb = w;
        const int8_t *x = q8[r];
        const int16_t *s = bs[r];
        float sum = 0.f;
        for (int64_t b = 0; b < nb; b++, wb += 176, x += 256, s += 16) {
            const uint8_t *sc = wb + 4, *qh = wb + 16, *ql = wb + 48;
            int32_t sumi = 0, summ = 0;
            for (int j = 0; j < 4; j++, ql += 32) {
                int s1, m1, s2, m2;
                scale_min_k4(2 * j, sc, &s1, &m1);
                scale_min_k4(2 * j + 1, sc, &s2, &m2);
                int32_t a1 = 0, a2 = 0;
                for (int l = 0; l < 32; l++) {
                    a1 += ((ql[l] & 0xF) | (((qh[l] >> (2 * j)) & 1) << 4)) * x[64 * j + l];
                    a2 += ((ql[l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4)) * x[64 * j + 32 + l];
                }
                sumi += s1 * a1 + s2 * a2;
                summ += m1 * (s[4 * j] + s[4 * j + 1]) + m2 * (s[4 * j + 2] + s[4 * j + 3]);
            }
            sum += d8[r][b] * (h2f(rd16(wb)) * (float)sumi - h2f(rd16(wb + 2)) * (float)summ);
        }
        out[r] = sum;
    }
}
#endif
#endif /* LOCALLLM_BLOCK_DOTS_H */
