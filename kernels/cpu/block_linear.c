/* Dense linears on the CPU over the file's raw GGUF blocks (kernels/cpu/block_linear.py loads it):
 * Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4, IQ4_XS, Q4_K, Q5_K and Q6_K, llama.cpp's decode
 * arithmetic: a few activation rows quantized to int8 (per 256 values for Q4_K / Q5_K, as its
 * Q8_K; per 32 for the others; sums of every 16 codes for the minimum terms), integer dots per
 * block, float scales per block. A weight may come in parts (a fused q/k/v or gate/up whose
 * tensors lie apart in the file): the rows of all parts are one row space, so nothing is copied
 * or stacked. One OpenMP region per call; each weight row is read once for all token rows.
 * `block_dequant` gives prompts exact float32 rows for an fp32 GEMM; `block_gemm_i16`
 * (i16_gemm.h) multiplies prompts through int16 activations, `block_gemm_i8` (i8_gemm.h)
 * through int8 ones in llama.cpp's activation formats. */
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "block_dequant.h"
#include "i16_gemm.h"
#include "i8_gemm.h"

#ifndef PREFETCH_ROWS /* file pages are 4 KiB: the hardware prefetchers stop at each */
#define PREFETCH_ROWS 4
#endif
/* Only calls of at least this many token rows prefetch: with one row the dots are short, and a
 * burst of a row's prefetches (18-105 lines) stalled the core (AMD EPYC, 2026-12-06: a
 * Llama-3.2-1B-shape step 46.5 -> 37.3 ms at 1 thread without them, 25.5 -> 20.9 at 2; with 4
 * and 16 rows they still gained 5-10 %). */
#ifndef PREFETCH_MIN_T
#define PREFETCH_MIN_T 2
#endif
static inline void prefetch_row(const uint8_t *w, int64_t rb) {
    for (int64_t o = 0; o < rb; o += 64) __builtin_prefetch(w + o, 0, 2);
}

enum { MAX_PARTS = 8 };

/* activations per 256 (Q8_K) for these types, per 32 for the others */
static int per_256(int type) { return type == Q4_K || type == Q5_K; }

#define CALL_R(fn) \
    (R == 4 ? fn(w, q, d, s, nb, 4, out) : R == 3 ? fn(w, q, d, s, nb, 3, out) \
     : R == 2 ? fn(w, q, d, s, nb, 2, out) : fn(w, q, d, s, nb, 1, out))

/* out[r] = weight row w . activation rows q/d/s[r], r < R <= ROWS_MAX */
static void row_dots(int type, const uint8_t *w, int64_t k, const int8_t *const *q,
                     const float *const *d, const int16_t *const *s, int R, float *out) {
    switch (type) {
    case Q4_0: { int64_t nb = k / 32; CALL_R(dot_q4_0_rows); return; }
    case Q4_1: { int64_t nb = k / 32; CALL_R(dot_q4_1_rows); return; }
    case Q5_0: { int64_t nb = k / 32; CALL_R(dot_q5_0_rows); return; }
    case Q5_1: { int64_t nb = k / 32; CALL_R(dot_q5_1_rows); return; }
    case IQ4_NL: { int64_t nb = k / 32; CALL_R(dot_iq4_nl_rows); return; }
    case MXFP4: { int64_t nb = k / 32; CALL_R(dot_mxfp4_rows); return; }
    case IQ4_XS: { int64_t nb = k / 256; CALL_R(dot_iq4_xs_rows); return; }
    case Q5_K: { int64_t nb = k / 256; CALL_R(dot_q5_k_rows); return; }
#ifdef Q4K_ROWS
    case Q4_K: { int64_t nb = k / 256; CALL_R(dot_q4_k_rows); return; }
#endif
#ifdef Q6K_ROWS
    case Q6_K: { int64_t nb = k / 256; CALL_R(dot_q6_k_rows); return; }
#endif
    default:
        break;
    }
    for (int r = 0; r < R; r++) {
        if (type == Q4_K) out[r] = dot_q4_k(w, q[r], d[r], s[r], k / 256);
        else if (type == Q6_K) out[r] = dot_q6_k(w, q[r], d[r], s[r], k / 256);
        else out[r] = dot_q8_0(w, q[r], d[r], k / 32);
    }
}

/* The int8 codes of t activation rows x [t, k] (row stride ldx) in `type`'s format: q8 [t*k],
 * d8 [t*k/32], bs [t*k/16]. A worksharing loop: call from every thread of a parallel region.
 * Shared out in pieces of c values (whole groups; the same codes as whole rows), so a single
 * decode row does not leave the other threads waiting at the barrier. */
static void quantize_rows(int type, const float *x, int64_t ldx, int64_t t, int64_t k, int8_t *q8,
                          float *d8, int16_t *bs) {
    const int g = per_256(type) ? 256 : 32;
    const int64_t c = k % 1024 == 0 ? 1024 : k % 256 == 0 ? 256 : 32; /* a multiple of g */
    const int64_t pieces = k / c;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < t * pieces; p++) {
        const int64_t i = p / pieces, o = p % pieces * c;
        quantize_groups(x + i * ldx + o, c, g, q8 + i * k + o, d8 + i * k / 32 + o / g,
                        bs + (i * k + o) / 16);
    }
}

#ifdef BLOCK_DOTS_AVX2
/* the 32-value block types, dotted over row tiles (block_dots.h's `*_tile`) */
static int tiled(int type) {
    return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == IQ4_NL ||
           type == MXFP4 || type == Q8_0;
}

#define TILE_CASE(fn, N) case N: fn(w, qt, dt, st, nb, N, out); return;
#if TILE_ROWS == 8
#define CALL_T(fn)                                                                  \
    switch (R) {                                                                    \
        TILE_CASE(fn, 8) TILE_CASE(fn, 7) TILE_CASE(fn, 6) TILE_CASE(fn, 5)        \
        TILE_CASE(fn, 4) TILE_CASE(fn, 3) TILE_CASE(fn, 2) default: fn(w, qt, dt, st, nb, 1, out); return; \
    }
#else
#define CALL_T(fn)                                                                  \
    switch (R) {                                                                    \
        TILE_CASE(fn, 4) TILE_CASE(fn, 3) TILE_CASE(fn, 2) default: fn(w, qt, dt, st, nb, 1, out); return; \
    }
#endif

/* out[r] = weight row w . the tile's row r, r < R <= TILE_ROWS */
static void tile_dots(int type, const uint8_t *w, const int8_t *qt, const float *dt,
                      const float *st, int64_t nb, int R, float *out) {
    switch (type) {
    case Q4_0: CALL_T(dot_q4_0_tile)
    case Q4_1: CALL_T(dot_q4_1_tile)
    case Q5_0: CALL_T(dot_q5_0_tile)
    case Q5_1: CALL_T(dot_q5_1_tile)
    case Q8_0: CALL_T(dot_q8_0_tile)
    case MXFP4: CALL_T(dot_mxfp4_tile)
    default: CALL_T(dot_iq4_nl_tile)
    }
}

/* Each thread's tiles of one call, kept between calls (grown, never shrunk). */
static _Thread_local uint8_t *tile_mem;
static _Thread_local size_t tile_cap;

static uint8_t *tile_scratch(size_t bytes) {
    if (bytes > tile_cap) {
        free(tile_mem);
        tile_cap = (bytes + 4095) & ~(size_t)4095;
        tile_mem = aligned_alloc(64, tile_cap);
        if (!tile_mem) tile_cap = 0;
    }
    return tile_mem;
}

/* bytes of one tile of nb blocks: interleaved codes, then scales and sums [nb][8] */
static inline size_t tile_bytes(int64_t nb) { return (size_t)nb * (32 * TILE_ROWS + 64); }

/* rows i0 .. i0 + R - 1 of the quantized activations as one tile at tb (layout: block_dots.h) */
static void tile_rows(const int8_t *q8, const float *d8, const int16_t *bs, int64_t k, int64_t i0,
                      int R, uint8_t *tb) {
    const int64_t nb = k / 32;
    int8_t *qt = (int8_t *)tb;
    float *dt = (float *)(tb + nb * 32 * TILE_ROWS), *st = dt + nb * 8;
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < 8; r++) {
            const int64_t i = i0 + r;
            if (r < R) memcpy(qt + (b * R + r) * 32, q8 + i * k + 32 * b, 32);
            dt[8 * b + r] = r < R ? d8[i * (k / 32) + b] : 0.f;
            st[8 * b + r] = r < R ? (float)(bs[i * (k / 16) + 2 * b] + bs[i * (k / 16) + 2 * b + 1]) : 0.f;
        }
}
#endif

/* y [t, n] (row stride ldy) = the quantized rows (quantize_rows) . W^T, W's n rows the rows of
 * `nparts` parts (part p: rows[p] rows of `type` at parts[p]), each weight row read once and
 * dotted with up to ROWS_MAX token rows per decode of its codes (TILE_ROWS for the 32-value
 * types: each thread lays the rows out as tiles first). A worksharing loop. */
static void rows_dot(int type, int64_t nparts, const uint8_t *const *parts, const int64_t *rows,
                     int64_t k, int64_t t, const int8_t *q8, const float *d8, const int16_t *bs,
                     float *y, int64_t ldy) {
    int64_t n = 0, start[MAX_PARTS + 1];
    for (int64_t p = 0; p < nparts; p++) start[p] = n, n += rows[p];
    start[nparts] = n;
    const int64_t rb = block_row_bytes(type, k);
    const int pf = PREFETCH_ROWS > 0 && t >= PREFETCH_MIN_T;
    uint8_t *tiles = NULL;
#ifdef BLOCK_DOTS_AVX2
    const int64_t ntiles = (t + TILE_ROWS - 1) / TILE_ROWS;
    if (tiled(type) && t > 1) /* (one row: the row dot is ~7 % faster, same bits) */
        tiles = tile_scratch(ntiles * tile_bytes(k / 32));
    if (tiles)
        for (int64_t c = 0; c < ntiles; c++)
            tile_rows(q8, d8, bs, k, c * TILE_ROWS,
                      (int)(t - c * TILE_ROWS < TILE_ROWS ? t - c * TILE_ROWS : TILE_ROWS),
                      tiles + c * tile_bytes(k / 32));
#endif
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        int64_t p = 0;
        while (r >= start[p + 1]) p++;
        const int64_t rr = r - start[p];
        const uint8_t *wr = parts[p] + rr * rb;
        if (pf && rr + PREFETCH_ROWS < rows[p]) prefetch_row(wr + PREFETCH_ROWS * rb, rb);
#ifdef BLOCK_DOTS_AVX2
        if (tiles) {
            const int64_t nb = k / 32;
            for (int64_t i = 0; i < t; i += TILE_ROWS) {
                const int R = t - i < TILE_ROWS ? (int)(t - i) : TILE_ROWS;
                const uint8_t *tb = tiles + i / TILE_ROWS * tile_bytes(nb);
                const float *dt = (const float *)(tb + nb * 32 * TILE_ROWS);
                float out[TILE_ROWS];
                tile_dots(type, wr, (const int8_t *)tb, dt, dt + nb * 8, nb, R, out);
                for (int j = 0; j < R; j++) y[(i + j) * ldy + r] = out[j];
            }
            continue;
        }
#endif
        for (int64_t i = 0; i < t; i += ROWS_MAX) {
            const int R = t - i < ROWS_MAX ? (int)(t - i) : ROWS_MAX;
            const int8_t *q[ROWS_MAX];
            const float *d[ROWS_MAX];
            const int16_t *s[ROWS_MAX];
            float out[ROWS_MAX];
            for (int j = 0; j < R; j++)
                q[j] = q8 + (i + j) * k, d[j] = d8 + (i + j) * k / 32, s[j] = bs + (i + j) * k / 16;
            row_dots(type, wr, k, q, d, s, R, out);
            for (int j = 0; j < R; j++) y[(i + j) * ldy + r] = out[j];
        }
    }
}

/* y [t, n] = x [t, k] . W^T over the parts (rows_dot), one parallel region. Scratch: q8 [t*k],
 * d8 [t*k/32], bs [t*k/16]. k a multiple of 256 for the 256-value types, of 32 for the others. */
void block_rows(int type, int64_t nparts, const uint8_t *const *parts, const int64_t *rows,
                int64_t k, int64_t t, const float *x, float *y, int8_t *q8, float *d8,
                int16_t *bs, int threads) {
    if (nparts < 1 || nparts > MAX_PARTS) return;
    int64_t n = 0;
    for (int64_t p = 0; p < nparts; p++) n += rows[p];
#pragma omp parallel num_threads(threads)
    {
        quantize_rows(type, x, k, t, k, q8, d8, bs);
        rows_dot(type, nparts, parts, rows, k, t, q8, d8, bs, y, n);
    }
}

/* out [rows, k] = the float32 values of rows r0 .. r0 + rows - 1 of the parts' row space */
void block_dequant(int type, int64_t nparts, const uint8_t *const *parts, const int64_t *prow,
                   int64_t r0, int64_t rows, int64_t k, float *out, int threads) {
    const int64_t rb = block_row_bytes(type, k);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        int64_t p = 0, rr = r0 + r;
        while (p + 1 < nparts && rr >= prow[p]) rr -= prow[p], p++;
        dequant_row(type, parts[p] + rr * rb, k, out + r * k);
    }
}
