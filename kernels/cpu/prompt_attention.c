/* Causal prompt attention on the CPU over the paged KV cache (kernels/cpu/prompt_attention.py
 * loads it): each sequence's chunk of t query rows at positions n - t .. n - 1, GQA, an optional
 * sliding window, float32 or float16 caches.
 *
 * A work item is one KV head and a tile of query vectors (up to LANES of (row, head) pairs that
 * share that KV head), one vector per SIMD lane. Keys go in blocks of BLOCK aligned to absolute
 * key 0; a block's K and V rows are loaded once for the tile, the scores are vertical FMAs (lane =
 * query vector, the dot over d in order 0..hd-1), then an online softmax step and P.V in key
 * order, all elementwise across lanes. So a query vector's bits depend only on its own q, its
 * position, the context length and the cache: never on the chunk's row count, its lane, the
 * tile's other rows or the thread count (tests/kernels/test_cpu_prompt_attention.py). Built with
 * -ffp-contract=off: the compiler fuses nothing on its own, in one place and not another. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__F16C__) || defined(__FMA__)
#include <immintrin.h>
#endif

enum { LANES = 16, BLOCK = 16 };

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));

static inline v16 vbcast(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static inline i16v ibcast(int32_t x) { return (i16v){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static inline v16 vsel(i16v m, v16 a, v16 b) { return (v16)(((i16v)a & m) | ((i16v)b & ~m)); }
static inline v16 vmax(v16 a, v16 b) { return vsel(a > b, a, b); }

/* a * b + c with one rounding where the CPU fuses (the same instruction for every lane) */
static inline v16 vfma(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
    return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    v16 r;
    __m256 *o = (__m256 *)&r;
    const __m256 *x = (const __m256 *)&a, *y = (const __m256 *)&b, *z = (const __m256 *)&c;
    o[0] = _mm256_fmadd_ps(x[0], y[0], z[0]);
    o[1] = _mm256_fmadd_ps(x[1], y[1], z[1]);
    return r;
#else
    return a * b + c;
#endif
}

/* exp elementwise for x <= 0 (Cephes' expf: ~1 ulp); -inf and x < -87.3 give 0 */
static inline v16 vexp(v16 x) {
    const v16 magic = vbcast(12582912.f); /* 1.5 * 2^23: adding it rounds to an integer */
    const v16 xc = vmax(x, vbcast(-87.3f));
    const v16 n = (xc * vbcast(1.44269504f) + magic) - magic;
    const v16 r = (xc - n * vbcast(0.693359375f)) - n * vbcast(-2.12194440e-4f);
    v16 p = vbcast(1.9875691500e-4f);
    p = p * r + vbcast(1.3981999507e-3f);
    p = p * r + vbcast(8.3334519073e-3f);
    p = p * r + vbcast(4.1665795894e-2f);
    p = p * r + vbcast(1.6666665459e-1f);
    p = p * r + vbcast(5.0000001201e-1f);
    p = (p * (r * r) + r) + vbcast(1.f);
    const i16v e = (__builtin_convertvector(n, i16v) + ibcast(127)) << 23;
    return vsel(x < vbcast(-87.3f), vbcast(0.f), p * (v16)e);
}

static inline float h2f(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    uint32_t x;
    if (e == 0) {
        float f = ldexpf((float)m, -24);
        memcpy(&x, &f, 4);
        x |= sign;
    } else if (e == 31) {
        x = sign | 0x7f800000 | (m << 13);
    } else {
        x = sign | ((e + 112) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &x, 4);
    return f;
#endif
}

/* n float16 values widened to float32 (exact) */
static inline void widen(const uint16_t *h, float *f, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(f + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
#elif defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) f[i] = h2f(h[i]);
}

typedef struct {
    const float *q;
    const void *k, *v;
    int64_t kv_f16, n_q, n_kv, hd, bs, window;
    float scale;
    const int64_t *starts, *counts, *lens, *tables;
    int64_t table_stride;
    float *out;
} args_t;

typedef struct { /* one thread's scratch, 64-byte aligned */
    v16 *qt, *acc; /* [hd] lanes each: the tile's queries and outputs, transposed */
    float *kf, *vf; /* [BLOCK][hd]: a float16 block widened */
    float *zero;    /* [hd] zeros: the rows of keys outside the tile's range */
} work_t;

/* P.V for output dims d0 .. d0 + nd - 1: acc[d] = acc[d] * corr + sum_j p[j] v[j][d] over the
 * keys j valid for each lane, in key order; lanes not active in this block keep their acc */
static inline void pv(v16 *acc, const v16 *p, const float *const *vp, const i16v *valid,
                      i16v active, v16 corr, int64_t d0, int nd) {
    v16 a[LANES];
    for (int k = 0; k < nd; k++) a[k] = acc[d0 + k] * corr;
    for (int j = 0; j < BLOCK; j++) {
        const float *vj = vp[j] + d0;
#if defined(__AVX512F__)
        const __mmask16 kj = _mm512_cmpneq_epi32_mask((__m512i)valid[j], _mm512_setzero_si512());
        for (int k = 0; k < nd; k++)
            a[k] = (v16)_mm512_mask3_fmadd_ps((__m512)p[j], _mm512_set1_ps(vj[k]), (__m512)a[k], kj);
#else
        for (int k = 0; k < nd; k++) a[k] = vsel(valid[j], vfma(p[j], vbcast(vj[k]), a[k]), a[k]);
#endif
    }
    for (int k = 0; k < nd; k++) acc[d0 + k] = vsel(active, a[k], acc[d0 + k]);
}

/* One tile: rows r0 .. r0 + nr - 1 of sequence s, query heads h0 .. h0 + per - 1 (KV head g) */
static void tile(const args_t *A, int64_t s, int64_t r0, int64_t nr, int64_t g, int64_t h0,
                 int64_t per, work_t *w) {
    const int64_t hd = A->hd, n = A->lens[s], t = A->counts[s], bs = A->bs;
    const int64_t *table = A->tables + s * A->table_stride;
    int32_t lo_a[LANES], hi_a[LANES];
    int64_t kmin = INT64_MAX, kmax = -1;
    for (int64_t d = 0; d < hd; d++) w->qt[d] = vbcast(0.f), w->acc[d] = vbcast(0.f);
    for (int64_t lane = 0; lane < LANES; lane++) {
        lo_a[lane] = 1, hi_a[lane] = 0; /* padding: no key */
        if (lane >= nr * per) continue;
        const int64_t r = r0 + lane / per, h = h0 + lane % per, pos = n - t + r;
        hi_a[lane] = (int32_t)pos;
        lo_a[lane] = (int32_t)(A->window > 0 && pos + 1 > A->window ? pos + 1 - A->window : 0);
        kmin = lo_a[lane] < kmin ? lo_a[lane] : kmin;
        kmax = hi_a[lane] > kmax ? hi_a[lane] : kmax;
        const float *qr = A->q + ((A->starts[s] + r) * A->n_q + h) * hd;
        for (int64_t d = 0; d < hd; d++) w->qt[d][lane] = qr[d];
    }
    i16v lo, hi;
    memcpy(&lo, lo_a, sizeof lo);
    memcpy(&hi, hi_a, sizeof hi);
    v16 m = vbcast(-INFINITY), l = vbcast(0.f);
    const v16 scale = vbcast(A->scale);
    const int64_t es = A->kv_f16 ? 2 : 4, row = A->n_kv * hd * es;
    for (int64_t k0 = kmin / BLOCK * BLOCK; k0 <= kmax; k0 += BLOCK) {
        const float *kp[BLOCK], *vp[BLOCK];
        for (int j = 0; j < BLOCK; j++) {
            const int64_t key = k0 + j;
            if (key < kmin || key > kmax) { /* no lane's key: zeros, never read beyond the table */
                kp[j] = vp[j] = w->zero;
                continue;
            }
            const int64_t slot = table[key / bs] * bs + key % bs;
            const char *kr = (const char *)A->k + slot * row + g * hd * es;
            const char *vr = (const char *)A->v + slot * row + g * hd * es;
            if (!A->kv_f16) {
                kp[j] = (const float *)kr, vp[j] = (const float *)vr;
                continue;
            }
            float *kf = w->kf + j * hd, *vf = w->vf + j * hd;
            widen((const uint16_t *)kr, kf, hd);
            widen((const uint16_t *)vr, vf, hd);
            kp[j] = kf, vp[j] = vf;
        }
        v16 sc[BLOCK];
        for (int j = 0; j < BLOCK; j++) sc[j] = vbcast(0.f);
        for (int64_t d = 0; d < hd; d++) {
            const v16 qd = w->qt[d];
#pragma GCC unroll 16
            for (int j = 0; j < BLOCK; j++) sc[j] = vfma(qd, vbcast(kp[j][d]), sc[j]);
        }
        i16v valid[BLOCK];
        v16 bm = vbcast(-INFINITY);
        for (int j = 0; j < BLOCK; j++) {
            const i16v key = ibcast((int32_t)(k0 + j));
            valid[j] = (lo <= key) & (key <= hi);
            sc[j] = vsel(valid[j], sc[j] * scale, vbcast(-INFINITY));
            bm = vmax(bm, sc[j]);
        }
        const i16v active = (lo <= ibcast((int32_t)(k0 + BLOCK - 1))) & (hi >= ibcast((int32_t)k0));
        const v16 mn = vmax(m, bm);
        const v16 corr = vexp(m - mn); /* 0 at a lane's first block (m = -inf) */
        v16 p[BLOCK], psum = vbcast(0.f);
        for (int j = 0; j < BLOCK; j++) {
            p[j] = vsel(valid[j], vexp(sc[j] - mn), vbcast(0.f));
            psum = psum + p[j];
        }
        l = vsel(active, l * corr + psum, l);
        m = vsel(active, mn, m);
        int64_t d0 = 0;
        for (; d0 + LANES <= hd; d0 += LANES) pv(w->acc, p, vp, valid, active, corr, d0, LANES);
        if (d0 < hd) pv(w->acc, p, vp, valid, active, corr, d0, (int)(hd - d0));
    }
    for (int64_t lane = 0; lane < nr * per; lane++) {
        const int64_t r = r0 + lane / per, h = h0 + lane % per;
        float *o = A->out + ((A->starts[s] + r) * A->n_q + h) * hd;
        const float inv = l[lane];
        for (int64_t d = 0; d < hd; d++) o[d] = w->acc[d][lane] / inv;
    }
}

/* ns sequences: rows starts[s] .. starts[s] + counts[s] - 1 of q / out [*, n_q, hd] are
 * sequence s's last counts[s] tokens (already in the cache) of lens[s]; tables [ns,
 * table_stride] their blocks; caches [blocks, bs, n_kv, hd] float32 or float16 (kv_f16).
 * window > 0: each row sees its last `window` keys. Returns 0, or -1 when out of memory. */
int prompt_attention(int64_t ns, const float *q, const void *k, const void *v, int64_t kv_f16,
                     int64_t n_q, int64_t n_kv, int64_t hd, int64_t bs, double scale,
                     int64_t window, const int64_t *starts, const int64_t *counts,
                     const int64_t *lens, const int64_t *tables, int64_t table_stride, float *out,
                     int threads) {
    const args_t A = {q, k, v, kv_f16, n_q, n_kv, hd, bs, window, (float)scale, starts, counts,
                      lens, tables, table_stride, out};
    const int64_t group = n_q / n_kv;
    int64_t nsplit = (group + LANES - 1) / LANES; /* pieces of <= LANES heads, evenly */
    while (group % nsplit) nsplit++;
    const int64_t per = group / nsplit, rows = LANES / per; /* a tile: rows x per lanes */
    int64_t *first = malloc((ns + 1) * sizeof *first); /* each sequence's first work item */
    if (!first) return -1;
    first[0] = 0;
    for (int64_t s = 0; s < ns; s++) first[s + 1] = first[s] + (counts[s] + rows - 1) / rows * n_kv * nsplit;
    const int64_t items = first[ns];
    const size_t bytes = (2 * hd * sizeof(v16) + (2 * BLOCK + 1) * hd * sizeof(float) + 63) / 64 * 64;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        char *mem = aligned_alloc(64, bytes);
        work_t w = {0};
        if (mem) {
            w.qt = (v16 *)mem, w.acc = w.qt + hd;
            w.kf = (float *)(w.acc + hd), w.vf = w.kf + BLOCK * hd, w.zero = w.vf + BLOCK * hd;
            memset(w.zero, 0, hd * sizeof(float));
        } else {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!mem) continue;
            const int64_t p = items - 1 - it; /* the last tiles (the longest rows) first */
            int64_t s = 0;
            while (first[s + 1] <= p) s++;
            const int64_t local = p - first[s], per_tile = n_kv * nsplit;
            const int64_t tile_i = local / per_tile, g = local % per_tile / nsplit;
            const int64_t h0 = g * group + local % nsplit * per, r0 = tile_i * rows;
            const int64_t nr = counts[s] - r0 < rows ? counts[s] - r0 : rows;
            tile(&A, s, r0, nr, g, h0, per, &w);
        }
        free(mem);
    }
    free(first);
    return failed ? -1 : 0;
}
