/* The native CPU decode step's LoRA add (kernels/cpu/decode_step.c's lora_add, one thread, one row)
 * alone, on SmolLM2-135M's shapes with four rank-16 adapters on q|k|v, o, gate|up and down of 30
 * layers (separate weights per layer: ~39 MB of float16 a token, as the real step reads), in five
 * variants alternated rep by rep; best and mean ms per token. Not a test (issue 36).
 *
 *   cc -O3 -march=native tests/perf/bench_lora_add.c -o /tmp/bench_lora_add && /tmp/bench_lora_add 40
 *
 * orig:           the shipped shrink (one accumulator) and expand over row-major B.T [rank, n]
 *                 (a 64-column work item reads 64 rows, n * 2 bytes apart)
 * 4-acc dot:      the shrink with four accumulators
 * chunk-major B:  B.T as [n / 64][rank][64]: a work item reads one contiguous 8 KB block
 *                 (kernels/cpu/decode_lora.py's `chunk_major`)
 * int8 A and B:   int8 weights with a float scale per row (per 64-column row piece for B),
 *                 chunk-major: the bytes halved, what lower precision would buy
 * Weights are random; only the time is measured. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + ts.tv_nsec * 1e-9; }
typedef struct { int64_t r, nseg, k; int8_t *a8, *b8[3]; float *as, *bs[3]; uint16_t *a; float *w, *tmp; int64_t lo[3], hi[3], col[3], n[3]; uint16_t *bt[3], *btc[3]; } L_t;
static float dot1(const float *x, const uint16_t *h, int64_t n) {
    __m256 acc = _mm256_setzero_ps(); int64_t c = 0;
    for (; c + 8 <= n; c += 8) acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(x + c), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + c)))));
    float l[8]; _mm256_storeu_ps(l, acc); float s = 0; for (int i = 0; i < 8; i++) s += l[i]; return s; }
static float dot4(const float *x, const uint16_t *h, int64_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0; int64_t c = 0;
    for (; c + 32 <= n; c += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + c), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + c))), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + c + 8), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + c + 8))), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + c + 16), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + c + 16))), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + c + 24), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + c + 24))), a3); }
    for (; c + 8 <= n; c += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + c), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + c))), a0);
    __m256 acc = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    float l[8]; _mm256_storeu_ps(l, acc); float s = 0; for (int i = 0; i < 8; i++) s += l[i]; return s; }
static void expand(float *y, const float *v, const uint16_t *h, int64_t ldh, int64_t rank) {
    __m256 acc[8]; for (int q = 0; q < 8; q++) acc[q] = _mm256_setzero_ps();
    for (int64_t j = 0; j < rank; j++) { if (v[j] == 0.f) continue; const __m256 vv = _mm256_set1_ps(v[j]); const uint16_t *hj = h + j * ldh;
        for (int q = 0; q < 8; q++) acc[q] = _mm256_add_ps(acc[q], _mm256_mul_ps(vv, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hj + 8 * q))))); }
    for (int q = 0; q < 8; q++) _mm256_storeu_ps(y + 8 * q, _mm256_add_ps(_mm256_loadu_ps(y + 8 * q), acc[q])); }
static float dot8(const float *x, const int8_t *h, int64_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0; int64_t c = 0;
    for (; c + 16 <= n; c += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + c), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(h + c)))), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + c + 8), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(h + c + 8)))), a1); }
    __m256 acc = _mm256_add_ps(a0, a1); float l[8]; _mm256_storeu_ps(l, acc); float s = 0; for (int i = 0; i < 8; i++) s += l[i]; return s; }
static void expand8(float *y, const float *v, const float *sc, const int8_t *h, int64_t rank) {
    __m256 acc[8]; for (int q = 0; q < 8; q++) acc[q] = _mm256_setzero_ps();
    for (int64_t j = 0; j < rank; j++) { if (v[j] == 0.f) continue; const __m256 vv = _mm256_set1_ps(v[j] * sc[j]); const int8_t *hj = h + j * 64;
        for (int q = 0; q < 8; q++) acc[q] = _mm256_fmadd_ps(vv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(hj + 8 * q)))), acc[q]); }
    for (int q = 0; q < 8; q++) _mm256_storeu_ps(y + 8 * q, _mm256_add_ps(_mm256_loadu_ps(y + 8 * q), acc[q])); }
static void add8(const L_t *L, const float *x, float *y) {
    for (int64_t j = 0; j < L->r; j++) L->tmp[j] = dot8(x, L->a8 + j * L->k, L->k) * L->as[j] * L->w[j];
    for (int64_t s = 0; s < L->nseg; s++) { int64_t rk = L->hi[s] - L->lo[s];
        for (int64_t c0 = 0; c0 < L->n[s]; c0 += 64)
            expand8(y + L->col[s] + c0, L->tmp + L->lo[s], L->bs[s] + (c0 / 64) * rk, L->b8[s] + c0 * rk, rk); } }
static void add(const L_t *L, const float *x, float *y, int dotv, int chunked) {
    for (int64_t j = 0; j < L->r; j++) L->tmp[j] = (dotv ? dot4 : dot1)(x, L->a + j * L->k, L->k) * L->w[j];
    for (int64_t s = 0; s < L->nseg; s++) { int64_t rk = L->hi[s] - L->lo[s];
        for (int64_t c0 = 0; c0 < L->n[s]; c0 += 64)
            if (chunked) expand(y + L->col[s] + c0, L->tmp + L->lo[s], L->btc[s] + c0 * rk, 64, rk);
            else expand(y + L->col[s] + c0, L->tmp + L->lo[s], L->bt[s] + c0, L->n[s], rk); } }
static uint16_t *rnd(int64_t n) { uint16_t *p = aligned_alloc(64, ((n * 2 + 63) / 64) * 64); for (int64_t i = 0; i < n; i++) p[i] = _cvtss_sh((rand() / (float)RAND_MAX - 0.5f) * 0.1f, 0); return p; }
int main(int argc, char **argv) {
    int layers = 30, reps = atoi(argv[1]); int64_t R = 64; /* 4 adapters x rank 16 */
    int64_t K[4] = {576, 576, 576, 1536}, NS[4] = {3, 1, 2, 1}; int64_t NN[4][3] = {{576, 192, 192}, {576}, {1536, 1536}, {576}};
    L_t *ls = calloc(layers * 4, sizeof(L_t));
    for (int l = 0; l < layers * 4; l++) { L_t *L = &ls[l]; int t = l % 4; L->k = K[t]; L->nseg = NS[t]; L->r = R * NS[t];
        L->a = rnd(L->r * L->k); L->w = malloc(L->r * 4); L->tmp = malloc(L->r * 4); for (int j = 0; j < L->r; j++) L->w[j] = 1.f;
        int64_t col = 0; for (int s = 0; s < L->nseg; s++) { L->lo[s] = s * R; L->hi[s] = (s + 1) * R; L->n[s] = NN[t][s]; L->col[s] = col; col += L->n[s];
            L->bt[s] = rnd(R * L->n[s]); L->btc[s] = malloc(R * L->n[s] * 2);
            for (int64_t c = 0; c < L->n[s]; c++) for (int64_t j = 0; j < R; j++) L->btc[s][(c / 64) * R * 64 + j * 64 + c % 64] = L->bt[s][j * L->n[s] + c];
            L->b8[s] = malloc(R * L->n[s]); L->bs[s] = malloc(R * L->n[s] / 64 * 4);
            for (int64_t i = 0; i < R * L->n[s]; i++) L->b8[s][i] = (int8_t)(rand() % 255 - 127);
            for (int64_t i = 0; i < R * L->n[s] / 64; i++) L->bs[s][i] = 1e-3f; }
        L->a8 = malloc(L->r * L->k); L->as = malloc(L->r * 4);
        for (int64_t i = 0; i < L->r * L->k; i++) L->a8[i] = (int8_t)(rand() % 255 - 127);
        for (int64_t j = 0; j < L->r; j++) L->as[j] = 1e-3f; }
    float *x = malloc(1536 * 4), *y = calloc(4096, 4); for (int i = 0; i < 1536; i++) x[i] = rand() / (float)RAND_MAX;
    const char *name[5] = {"orig (1-acc dot, row-major B)", "4-acc dot", "chunk-major B", "4-acc dot + chunk-major B", "int8 A and B (chunk-major)"};
    double best[5] = {1e9, 1e9, 1e9, 1e9, 1e9}, sum[5] = {0};
    for (int r = 0; r < reps; r++) for (int v = 0; v < 5; v++) { double t0 = now();
        for (int l = 0; l < layers * 4; l++) if (v == 4) add8(&ls[l], x, y); else add(&ls[l], x, y, v & 1, v >> 1);
        double dt = now() - t0; if (dt < best[v]) best[v] = dt; sum[v] += dt; }
    for (int v = 0; v < 5; v++) printf("%-32s best %.3f ms  mean %.3f ms per token\n", name[v], best[v] * 1e3, sum[v] / reps * 1e3);
    printf("check %f\n", y[0]);
}
