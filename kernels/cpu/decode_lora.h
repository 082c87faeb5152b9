/* The LoRA adapters of a decode step (engine/lora), applied unmerged inside decode_step.c's
 * parallel region: its lora_t table (set per step by kernels/cpu/decode_lora.py), the float16
 * shrink and expand. Included by decode_step.c after its lin_t and MAX_GROUPS. */
#ifndef LOCALLLM_DECODE_LORA_H
#define LOCALLLM_DECODE_LORA_H

/* LoRA adapters (engine/lora), unmerged: y[:, col_s : col_s + n_s] += ((x @ A.T) * W)[:, lo_s : hi_s]
 * @ Bt_s for each output part s; A [r, k] and Bt_s [hi_s - lo_s, n_s] float16 (half the bytes a
 * memory-bound step reads), the rows' adapter factors W [t, r] (row stride r) and the math
 * float32, tmp [t * r] scratch; Bt_s chunk-major, [ceil(n_s / LORA_CHUNK)][hi_s - lo_s][LORA_CHUNK]
 * (zero-padded: an expand work item reads one contiguous block). kernels/cpu/decode_lora.py lays them out;
 * `set_lora` hands a step its table [n_layers * 4] (q|k|v, o, gate|up, down; NULL: none) on the
 * calling thread, which `decode_step` reads before its parallel region. */
typedef struct {
    int64_t r, nseg;
    const uint16_t *a;
    const float *w;
    float *tmp;
    int64_t lo[MAX_GROUPS], hi[MAX_GROUPS], col[MAX_GROUPS], n[MAX_GROUPS];
    const uint16_t *bt[MAX_GROUPS];
} lora_t;

/* sum x[c] * h[c] over n, h float16 */
static float dot_f16(const float *x, const uint16_t *h, int64_t n) {
    int64_t c = 0;
    float s = 0.f;
#if defined(__F16C__) && defined(__AVX__)
    __m256 acc = _mm256_setzero_ps();
    for (; c + 8 <= n; c += 8)
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(x + c),
                                               _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + c)))));
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int i = 0; i < 8; i++) s += lanes[i];
#endif
    for (; c < n; c++) s += x[c] * half_to_float(h[c]);
    return s;
}

/* y[c] += sum_j v[j] * h[j * ldh + c] over c < n and j < rank, h float16; a full chunk of
 * LORA_CHUNK columns sums in registers and touches y once */
static void expand_f16(float *y, const float *v, const uint16_t *h, int64_t ldh, int64_t rank,
                       int64_t n) {
    int64_t c = 0;
#if defined(__F16C__) && defined(__AVX__)
    if (n == 64) {
        __m256 acc[8];
        for (int q = 0; q < 8; q++) acc[q] = _mm256_setzero_ps();
        for (int64_t j = 0; j < rank; j++) {
            if (v[j] == 0.f) continue;
            const __m256 vv = _mm256_set1_ps(v[j]);
            const uint16_t *hj = h + j * ldh;
            for (int q = 0; q < 8; q++)
                acc[q] = _mm256_add_ps(acc[q], _mm256_mul_ps(vv, _mm256_cvtph_ps(
                                                                    _mm_loadu_si128((const __m128i *)(hj + 8 * q)))));
        }
        for (int q = 0; q < 8; q++) _mm256_storeu_ps(y + 8 * q, _mm256_add_ps(_mm256_loadu_ps(y + 8 * q), acc[q]));
        return;
    }
#endif
    for (; c < n; c++) {
        float s = 0.f;
        for (int64_t j = 0; j < rank; j++) s += v[j] * half_to_float(h[j * ldh + c]);
        y[c] += s;
    }
}

enum { LORA_CHUNK = 64 }; /* output columns per expand work item (expand_f16's full chunk) */

static _Thread_local const lora_t *const *step_lora;

void set_lora(const lora_t *const *table) { step_lora = table; }

/* decode_lora.py lays Bt out chunk-major for a library that exports this */
int lora_chunk_major(void) { return 1; }

/* inside the parallel region: shrink (rows x ranks), a barrier, expand (column chunks) */
static void lora_add(const lora_t *L, const float *x, int64_t ldx, int64_t t, int64_t k, float *y,
                     int64_t ldy) {
    if (!L) return;
    const int64_t r = L->r;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < t * r; p++) {
        const int64_t i = p / r, j = p % r;
        const float f = L->w[i * r + j];
        float s = 0.f;
        if (f != 0.f) s = dot_f16(x + i * ldx, L->a + j * k, k); /* else: nothing to read */
        L->tmp[p] = s * f;
    }
    int64_t total = 0;
    for (int64_t s = 0; s < L->nseg; s++) total += (L->n[s] + LORA_CHUNK - 1) / LORA_CHUNK;
#pragma omp for schedule(static)
    for (int64_t q = 0; q < total; q++) {
        int64_t s = 0, c0 = q;
        while (c0 >= (L->n[s] + LORA_CHUNK - 1) / LORA_CHUNK) c0 -= (L->n[s] + LORA_CHUNK - 1) / LORA_CHUNK, s++;
        c0 *= LORA_CHUNK;
        const int64_t len = L->n[s] - c0 < LORA_CHUNK ? L->n[s] - c0 : LORA_CHUNK;
        for (int64_t i = 0; i < t; i++)
            expand_f16(y + i * ldy + L->col[s] + c0, L->tmp + i * r + L->lo[s],
                       L->bt[s] + c0 * (L->hi[s] - L->lo[s]), LORA_CHUNK, L->hi[s] - L->lo[s], len);
    }
}

#endif
