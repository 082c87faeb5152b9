/* The attention of decode_step.c (included after its structs): float16 <-> float32 for the KV
 * cache, rope over a head's first dims, and attend_group, the query heads of one KV head over
 * a row's paged context (each K and V row read once for the group, K/V rows prefetched ahead).
 * paged_decode (decode_step.c) runs it for the torch layers' decode attention too. */
#ifndef LOCALLLM_DECODE_ATTENTION_H
#define LOCALLLM_DECODE_ATTENTION_H

static inline float half_to_float(uint16_t h) { return h2f(h); }

static inline uint16_t float_to_half(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, 0); /* round to nearest even, as torch's .half() */
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000;
    int32_t e = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    uint32_t m = x & 0x7fffff;
    if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (m ? 0x200 : 0));
    if (e >= 31) return (uint16_t)(sign | 0x7c00);
    if (e <= 0) {
        if (e < -10) return (uint16_t)sign;
        m |= 0x800000;
        const int shift = 14 - e;
        uint32_t h = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((uint32_t)e << 10) | (m >> 13), rem = m & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
#endif
}
/* rotate the first `dims` values of one head: adjacent pairs (llama's NORM) or halves (NEOX) */
static void rope_head(float *v, const float *cos, const float *sin, int64_t dims, int64_t neox) {
    const int64_t half = dims / 2;
    for (int64_t i = 0; i < half; i++) {
        const int64_t a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        const float x0 = v[a], x1 = v[b];
        v[a] = x0 * cos[i] - x1 * sin[i];
        v[b] = x1 * cos[i] + x0 * sin[i];
    }
}

/* K or V of one token at `slot` for KV head g, as float32 (a float16 cache widened into tmp) */
static inline const float *cache_row(const model_t *m, const void *cache, int64_t slot, int64_t g,
                                     float *tmp) {
    const int64_t at = (slot * m->n_kv + g) * m->hd;
    if (!m->kv_f16) return (const float *)cache + at;
    const uint16_t *h = (const uint16_t *)cache + at;
#if defined(__F16C__) && defined(__AVX2__)
    int64_t j = 0;
    for (; j + 8 <= m->hd; j += 8)
        _mm256_storeu_ps(tmp + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j))));
    for (; j < m->hd; j++) tmp[j] = half_to_float(h[j]);
#else
    for (int64_t j = 0; j < m->hd; j++) tmp[j] = half_to_float(h[j]);
#endif
    return tmp;
}

/* K or V row of one token for KV head g toward the cache, KV_AHEAD keys before its use */
enum { KV_AHEAD = 8 };
static inline void prefetch_kv(const model_t *m, const void *cache, int64_t slot, int64_t g) {
    const int64_t es = m->kv_f16 ? 2 : 4, bytes = m->hd * es;
    const char *p = (const char *)cache + (slot * m->n_kv + g) * bytes;
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}

enum { MAX_GROUP = 16 }; /* query heads per KV head read together */

/* The query heads h0 .. h0 + ng - 1 of row i, which share KV head g, over the row's context:
 * softmax(q . K^T x scale) V -> out [ng, hd] (each K and V row read once for all ng heads);
 * sink [ng] (or NULL): each head's sink logit, a key with no value in its softmax (gpt-oss).
 * sc: scratch of ng x ctx floats, tmp: hd floats. */
static void attend_group(const model_t *m, const layer_t *L, const float *q, int64_t ng, int64_t g,
                         int64_t ctx, const int64_t *table, float *out, float *sc, float *tmp,
                         const float *sink) {
    const int64_t bsz = m->block_size, hd = m->hd;
    const int64_t j0 = L->window > 0 && ctx > L->window ? ctx - L->window : 0;
    table += j0 / bsz; /* the window's first block; its first key at j0 % bsz */
    const int64_t skip = j0 % bsz;
    ctx -= j0 - skip;
    const float scale = (float)m->scale, cap = (float)m->softcap;
    float mx[MAX_GROUP], sum[MAX_GROUP];
    for (int64_t h = 0; h < ng; h++) mx[h] = -INFINITY, sum[h] = 0.f;
    for (int64_t j = skip; j < ctx; j++) {
        const int64_t slot = table[j / bsz] * bsz + j % bsz;
        if (j + KV_AHEAD < ctx) { /* the rows of keys ahead, K and V: misses were ~2/3 of the time */
            const int64_t ahead = table[(j + KV_AHEAD) / bsz] * bsz + (j + KV_AHEAD) % bsz;
            prefetch_kv(m, L->k_cache, ahead, g);
            prefetch_kv(m, L->v_cache, ahead, g);
        }
        const float *kr = cache_row(m, L->k_cache, slot, g, tmp);
        for (int64_t h = 0; h < ng; h++) {
            const float *qh = q + h * hd;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < hd; d++) s += qh[d] * kr[d];
            s *= scale;
            sc[h * ctx + j - skip] = s;
            mx[h] = s > mx[h] ? s : mx[h];
        }
    }
    if (cap > 0.f) /* Gemma 2: cap * tanh(s / cap), after the loop above (a branch inside it
                    * changed how the compiler sums the dot products: other bits for every family);
                    * the cap rises with s, so the capped max is the max's cap */
        for (int64_t h = 0; h < ng; h++) {
            float *sh = sc + h * ctx;
            for (int64_t j = 0; j < ctx - skip; j++) sh[j] = cap * tanhf(sh[j] / cap);
            mx[h] = cap * tanhf(mx[h] / cap);
        }
    for (int64_t h = 0; h < ng; h++) {
        float *sh = sc + h * ctx;
        if (sink) mx[h] = sink[h] > mx[h] ? sink[h] : mx[h], sum[h] = expf(sink[h] - mx[h]);
        for (int64_t j = 0; j < ctx - skip; j++) sum[h] += (sh[j] = expf(sh[j] - mx[h]));
        sum[h] = 1.f / sum[h];
        for (int64_t d = 0; d < hd; d++) out[h * hd + d] = 0.f;
    }
    for (int64_t j = skip; j < ctx; j++) {
        const int64_t slot = table[j / bsz] * bsz + j % bsz;
        const float *vr = cache_row(m, L->v_cache, slot, g, tmp);
        for (int64_t h = 0; h < ng; h++) {
            const float p = sc[h * ctx + j - skip] * sum[h];
            float *oh = out + h * hd;
#pragma omp simd
            for (int64_t d = 0; d < hd; d++) oh[d] += p * vr[d];
        }
    }
}

#endif
