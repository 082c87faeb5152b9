/* Float matrix times a few rows on the CPU: y [m, n] = x [m, k] . W [n, k]^T (+ bias), m <= 4,
 * W in float32 or bfloat16 (widened exactly to float32), x and y float32. A decode step with
 * classifier-free guidance has m = 2: torch's float32 path (MKL sgemm, on AMD CPUs too) runs it
 * as a GEMM at a quarter of the memory bandwidth its one-row GEMV reaches, and one weight read
 * for both rows is what a memory-bound step wants. Each output is one dot product summed in a
 * fixed order (16 lanes, then the lanes pairwise), so results do not depend on the thread count.
 * Built by float_gemv.py with the system compiler; checked against torch before use. */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 16
#define MAX_ROWS 4
#define BLOCK 4 /* output rows per inner step: BLOCK x m independent sums keep the FMAs busy */

static inline float widen_bf16(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float lanes_sum(const float *a) {
    float s[LANES];
    for (int i = 0; i < LANES; i++) s[i] = a[i];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int i = 0; i < w; i++) s[i] += s[i + w];
    return s[0];
}

/* BLOCK weight rows from `j` against M rows of x; W row-major [n, k], k % LANES == 0 */
#define DOT_BLOCK(M, WT, LOAD)                                                                 \
    static void dot_block_##M##_##WT(const WT *w, int64_t j, int64_t k, const float *x,       \
                                     float out[MAX_ROWS][BLOCK], int nb) {                    \
        float acc[BLOCK][M][LANES];                                                           \
        const WT *rows[BLOCK]; /* a short last block repeats its last row: fixed trip counts */ \
        memset(acc, 0, sizeof acc);                                                           \
        for (int b = 0; b < BLOCK; b++) rows[b] = w + (j + (b < nb ? b : nb - 1)) * k;       \
        for (int64_t c = 0; c < k; c += LANES) {                                              \
            for (int b = 0; b < BLOCK; b++) {                                                 \
                const WT *wr = rows[b] + c;                                                   \
                float wv[LANES];                                                              \
                for (int l = 0; l < LANES; l++) wv[l] = LOAD(wr[l]);                          \
                for (int r = 0; r < M; r++) {                                                 \
                    const float *xr = x + r * k + c;                                          \
                    for (int l = 0; l < LANES; l++) acc[b][r][l] += wv[l] * xr[l];            \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int b = 0; b < nb; b++)                                                          \
            for (int r = 0; r < M; r++) out[r][b] = lanes_sum(acc[b][r]);                     \
    }

#ifdef __AVX512F__
#include <immintrin.h>
/* The same sums in AVX-512 registers (the portable form keeps its sums in memory). */
static inline __m512 load_float(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load_uint16_t(const uint16_t *p) {
    __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
#define DOT_BLOCK_AVX512(M, WT)                                                                \
    static void dot_block_##M##_##WT(const WT *w, int64_t j, int64_t k, const float *x,       \
                                     float out[MAX_ROWS][BLOCK], int nb) {                    \
        __m512 acc[BLOCK][M];                                                                 \
        const WT *rows[BLOCK];                                                                \
        for (int b = 0; b < BLOCK; b++) {                                                     \
            rows[b] = w + (j + (b < nb ? b : nb - 1)) * k;                                    \
            for (int r = 0; r < M; r++) acc[b][r] = _mm512_setzero_ps();                      \
        }                                                                                     \
        for (int64_t c = 0; c < k; c += LANES) {                                              \
            __m512 xv[M];                                                                     \
            for (int r = 0; r < M; r++) xv[r] = _mm512_loadu_ps(x + r * k + c);               \
            for (int b = 0; b < BLOCK; b++) {                                                 \
                __builtin_prefetch(rows[b] + BLOCK * k + c, 0, 2); /* the next block's rows */ \
                __m512 wv = load_##WT(rows[b] + c);                                           \
                for (int r = 0; r < M; r++) acc[b][r] = _mm512_fmadd_ps(wv, xv[r], acc[b][r]); \
            }                                                                                 \
        }                                                                                     \
        for (int b = 0; b < nb; b++)                                                          \
            for (int r = 0; r < M; r++) {                                                     \
                float lanes[LANES];                                                           \
                _mm512_storeu_ps(lanes, acc[b][r]);                                           \
                out[r][b] = lanes_sum(lanes);                                                 \
            }                                                                                 \
    }
DOT_BLOCK_AVX512(1, float)
DOT_BLOCK_AVX512(2, float)
DOT_BLOCK_AVX512(3, float)
DOT_BLOCK_AVX512(4, float)
DOT_BLOCK_AVX512(1, uint16_t)
DOT_BLOCK_AVX512(2, uint16_t)
DOT_BLOCK_AVX512(3, uint16_t)
DOT_BLOCK_AVX512(4, uint16_t)
#else
#define AS_FLOAT(v) (v)
DOT_BLOCK(1, float, AS_FLOAT)
DOT_BLOCK(2, float, AS_FLOAT)
DOT_BLOCK(3, float, AS_FLOAT)
DOT_BLOCK(4, float, AS_FLOAT)
DOT_BLOCK(1, uint16_t, widen_bf16)
DOT_BLOCK(2, uint16_t, widen_bf16)
DOT_BLOCK(3, uint16_t, widen_bf16)
DOT_BLOCK(4, uint16_t, widen_bf16)
#endif

typedef void (*dot_fn)(const void *, int64_t, int64_t, const float *, float[MAX_ROWS][BLOCK],
                       int);

static dot_fn pick(int bf16, int64_t m) {
    static const dot_fn f32[MAX_ROWS] = {(dot_fn)dot_block_1_float, (dot_fn)dot_block_2_float,
                                         (dot_fn)dot_block_3_float, (dot_fn)dot_block_4_float};
    static const dot_fn b16[MAX_ROWS] = {
        (dot_fn)dot_block_1_uint16_t, (dot_fn)dot_block_2_uint16_t,
        (dot_fn)dot_block_3_uint16_t, (dot_fn)dot_block_4_uint16_t};
    return bf16 ? b16[m - 1] : f32[m - 1];
}

int float_gemv_max_rows(void) { return MAX_ROWS; }
int float_gemv_lanes(void) { return LANES; }

/* y [m, n] = x [m, k] . W [n, k]^T + bias [n] (bias may be NULL); 1 <= m <= MAX_ROWS,
 * k % LANES == 0; w is float32 (bf16 = 0) or bfloat16 bits (bf16 = 1). */
void float_gemv(int bf16, const void *w, int64_t n, int64_t k, const float *x, int64_t m,
                const float *bias, float *y, int threads) {
    dot_fn dot = pick(bf16, m);
    int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t ib = 0; ib < blocks; ib++) {
        int64_t j = ib * BLOCK;
        int nb = (int)(n - j < BLOCK ? n - j : BLOCK);
        float out[MAX_ROWS][BLOCK];
        dot(w, j, k, x, out, nb);
        for (int r = 0; r < m; r++)
            for (int b = 0; b < nb; b++)
                y[r * n + j + b] = out[r][b] + (bias ? bias[j + b] : 0.0f);
    }
}
