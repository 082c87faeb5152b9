/* Routed-expert FFN on the CPU over raw GGUF blocks (Q4_K, Q6_K, Q8_0), llama.cpp's arithmetic:
 * activations quantized to int8 (one float scale per 256 values for Q4_K, as llama.cpp's Q8_K;
 * per 32 for Q6_K and Q8_0; sums of every 16 codes), integer dot products per 32 (or 16)
 * weights, float scales applied per super-block (Q4_K) or group. One call computes every (token,
 * expert) pair of a layer in one OpenMP region: a decode step's 8 experts x 3 projections are
 * too small for per-matrix calls to pay their thread start-up (torch: ~1.45 ms per layer on 16
 * cores, H200 host). Built by native.py with the system compiler; checked against dequantized
 * float math before use. Codes enter the dot products unsigned (the Q6_K -32 offset goes through
 * the 16-sums): a signed form was mis-vectorized by GCC 12 with -march=native (AVX512-VNNI). */
#include <stdint.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "quant_dots.h"

/* The hardware prefetchers stop at 4 KiB pages (file pages are never huge): ask for the row
 * PREFETCH_ROWS ahead of the one being dotted, so each thread keeps reads in flight. Into L2
 * (prefetcht1): the non-temporal hint used before made experts already in cache 2.5x slower and
 * a layer from memory 1.3-1.6x slower (bench_moe_cold.py, 2026-12-01 18:10 UTC). */
#ifndef PREFETCH_ROWS /* (-D overrides: tests/perf/bench_moe_cold.py --defines) */
#define PREFETCH_ROWS 4
#endif
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 2
#endif
static inline void prefetch_row(const uint8_t *w, int64_t rb) {
    for (int64_t o = 0; o < rb; o += 64) __builtin_prefetch(w + o, 0, PREFETCH_LOCALITY);
}

static int64_t row_bytes(int type, int64_t k) {
    return type == Q4_K ? k / 256 * 144 : type == Q6_K ? k / 256 * 210 : k / 32 * 34;
}

static float dot(int type, const uint8_t *w, const int8_t *q8, const float *d8, const int16_t *bs,
                 int64_t k) {
    if (type == Q4_K) return dot_q4_k(w, q8, d8, bs, k / 256);
    if (type == Q6_K) return dot_q6_k(w, q8, d8, bs, k / 256);
    return dot_q8_0(w, q8, d8, k / 32);
}

int moe_supports(int type) { return type == Q4_K || type == Q6_K || type == Q8_0; }

/* y [n] = W [n, k] (raw blocks of `type`) . x [k]: the kernels one matrix at a time (tests) */
void gemv(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, float *y,
          int8_t *q8, float *d8, int16_t *bs, int threads) {
    quantize_for(type, x, k, q8, d8, bs);
    int64_t rb = row_bytes(type, k);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++) y[r] = dot(type, w + r * rb, q8, d8, bs, k);
}

/* A weight row's dots with token rows i .. i + R - 1 of gemm_rows' scratch (R <= ROWS_MAX), its
 * codes decoded once (Q4_K, Q6_K with AVX2); each dot's bits are the one-row kernel's. 0: not
 * for this type. */
static int dot_some_rows(int type, const uint8_t *w, const int8_t *q8, const float *d8,
                         const int16_t *bs, int64_t k, int64_t i, int R, float *out) {
    const int8_t *q[ROWS_MAX];
    const float *dd[ROWS_MAX];
    const int16_t *bb[ROWS_MAX];
    for (int r = 0; r < R; r++) {
        q[r] = q8 + (i + r) * k, dd[r] = d8 + (i + r) * k / 32, bb[r] = bs + (i + r) * k / 16;
    }
#ifdef Q4K_ROWS
    /* R a literal in each call, so each count compiles to its own unrolled loop; one call
     * through a function pointer for both types ran 1.3-1.5x slower (2026-12-01 22:37) */
    if (type == Q4_K) {
        if (R == 4)
            dot_q4_k_rows(w, q, dd, bb, k / 256, 4, out);
        else
            dot_q4_k_rows(w, q, dd, bb, k / 256, 2, out);
        return 1;
    }
#endif
#ifdef Q6K_ROWS
    if (type == Q6_K) {
        if (R == 4)
            dot_q6_k_rows(w, q, dd, bb, k / 256, 4, out);
        else
            dot_q6_k_rows(w, q, dd, bb, k / 256, 2, out);
        return 1;
    }
#endif
    (void)w, (void)q, (void)dd, (void)bb, (void)out, (void)type;
    return 0;
}

/* y [t, n] = x [t, k] . W [n, k]^T for a few token rows (dense linears at decode): each weight
 * row is read from memory once and dotted with every token row from cache, up to ROWS_MAX rows
 * per decode of its codes where the type allows. Scratch: q8 [t*k], d8 [t*k/32], bs [t*k/16]. */
void gemm_rows(int type, const uint8_t *w, int64_t n, int64_t k, int64_t t, const float *x,
               float *y, int8_t *q8, float *d8, int16_t *bs, int threads) {
    for (int64_t i = 0; i < t; i++)
        quantize_for(type, x + i * k, k, q8 + i * k, d8 + i * k / 32, bs + i * k / 16);
    int64_t rb = row_bytes(type, k);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *wr = w + r * rb;
        /* file-backed weights: pages of 4 KiB, where the hardware prefetchers stop */
        if (r + PREFETCH_ROWS < n) prefetch_row(w + (r + PREFETCH_ROWS) * rb, rb);
        int64_t i = 0;
        float some[ROWS_MAX];
        for (int R = ROWS_MAX; R >= 2; R /= 2) {  /* 4 rows at a time, then 2, then one */
            for (; i + R <= t && dot_some_rows(type, wr, q8, d8, bs, k, i, R, some); i += R)
                for (int j = 0; j < R; j++) y[(i + j) * n + r] = some[j];
        }
        for (; i < t; i++)
            y[i * n + r] = dot(type, wr, q8 + i * k, d8 + i * k / 32, bs + i * k / 16, k);
    }
}

/* One Q4_K row's values (ggml's dequantize: d * scale * q - dmin * min per 32). d * scale and
 * dmin * min are exact in float32 (11 + 6 bits), and so is their product with a 4-bit code: the
 * subtraction alone rounds, fused or not, as in gguf-py. */
static void dequant_q4_k_row(const uint8_t *b, int64_t nb, float *y) {
    for (int64_t j = 0; j < nb; j++, b += 144) {
        const float d = h2f(rd16(b)), dmin = h2f(rd16(b + 2));
        const uint8_t *sc = b + 4, *q = b + 16;
        for (int g = 0; g < 8; g += 2, q += 32, y += 64) {
            int s0, m0, s1, m1;
            scale_min_k4(g, sc, &s0, &m0);
            scale_min_k4(g + 1, sc, &s1, &m1);
            const float d0 = d * s0, n0 = dmin * m0, d1 = d * s1, n1 = dmin * m1;
            for (int l = 0; l < 32; l++) {
                y[l] = d0 * (float)(q[l] & 0xF) - n0;
                y[l + 32] = d1 * (float)(q[l] >> 4) - n1;
            }
        }
    }
}

/* out [rows, k] = float32 values of Q4_K, Q6_K or Q8_0 rows (ggml's dequantize) */
void dequant_rows(int type, const uint8_t *w, int64_t rows, int64_t k, float *out, int threads) {
    int64_t rb = row_bytes(type, k);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *b = w + r * rb;
        float *y = out + r * k;
        if (type == Q4_K) {
            dequant_q4_k_row(b, k / 256, y);
            continue;
        }
        if (type == Q8_0) {
            for (int64_t j = 0; j < k / 32; j++, b += 34, y += 32) {
                const float d = h2f(rd16(b));
                for (int l = 0; l < 32; l++) y[l] = d * (float)(int8_t)b[2 + l];
            }
            continue;
        }
        for (int64_t j = 0; j < k / 256; j++, b += 210) {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *sc = (const int8_t *)(b + 192);
            const float d = h2f(rd16(b + 208));
            for (int n2 = 0; n2 < 2; n2++, ql += 64, qh += 32, sc += 8, y += 128) {
                for (int l = 0; l < 32; l++) {
                    const int is = l / 16;
                    const int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    y[l] = d * sc[is] * q1;
                    y[l + 32] = d * sc[is + 2] * q2;
                    y[l + 64] = d * sc[is + 4] * q3;
                    y[l + 96] = d * sc[is + 6] * q4;
                }
            }
        }
    }
}

#ifndef MOE_ROWS
#define MOE_ROWS ROWS_MAX
#endif
/* fn with R (2 .. 4) a literal at each call: the inlined dot unrolls its per-row loops and keeps
 * the accumulators in registers (a runtime R left them in memory: ~10 % slower) */
#define ROWS_LITERAL(fn, w, q, d, s, nb, R, out)                                 \
    do {                                                                        \
        if ((R) == 4) fn(w, q, d, s, nb, 4, out);                               \
        else if ((R) == 3) fn(w, q, d, s, nb, 3, out);                          \
        else fn(w, q, d, s, nb, 2, out);                                        \
    } while (0)
/* pairs p .. end - 1 taken together by a multi-row dot: at most MOE_ROWS */
static inline int rows_left(int64_t p, int64_t end) {
    return end - p < MOE_ROWS ? (int)(end - p) : MOE_ROWS;
}

/* Pairs of one MoE layer grouped by expert: group g is pairs gstart[g] .. gstart[g+1]-1 of the
 * expert whose raw blocks start at gate[g], up[g], down[g] (gate, up: hidden rows of dim; down: dim
 * rows of hidden); pair p belongs to token row tok[p]. x [t, dim]; act 0 = SiLU, 1 = GELU (tanh).
 * dn [p, dim] = down(act(gate) * up) of pair p's row; every other dn row is left as it is, so a
 * caller may pass the groups in several calls. A weight row is read once per group and dotted
 * with each of its pairs (a prompt's tokens share their experts). Scratch (caller's): xq [t*dim]
 * + xd [t*dim/32] + xb [t*dim/16] and the same again in kq / kd / kb (used when one of gate and
 * up is Q4_K and the other not), h [pairs*2*hidden], aq [pairs*hidden] + ad [pairs*hidden/32]
 * + ab [pairs*hidden/16], pairs = gstart[ngroups] (indices of p). */
/* The flattened (group, row) index, groups of `rows` rows, where the cost of the rows before it
 * first reaches `work` (whole rows). A row costs its read (about one pair's dot) plus a dot per
 * pair of its group: pairs + 1. */
static int64_t cut(int64_t ngroups, const int64_t *gstart, int64_t rows, int64_t work) {
    for (int64_t g = 0; g < ngroups; g++) {
        int64_t c = gstart[g + 1] - gstart[g] + 1;
        if (work < c * rows) return g * rows + (work + c - 1) / c;
        work -= c * rows;
    }
    return ngroups * rows;
}

/* Thread `id` of `n`: one contiguous run [lo, hi) of the flattened (group, row) space with about
 * a 1/n share of the work. Contiguous runs keep each thread's weight reads sequential, which the
 * hardware prefetchers follow (chunks of 32 rows handed out dynamically interleaved the threads:
 * one row: a layer took 1.81-1.88 ms against 1.61-1.62); weighting rows by their pairs keeps
 * prompts' unequal groups balanced. Which thread computes a row does not change its sums. */
static void share(int64_t ngroups, const int64_t *gstart, int64_t rows, int n, int id,
                  int64_t *lo, int64_t *hi) {
    int64_t total = (gstart[ngroups] - gstart[0] + ngroups) * rows;
    *lo = cut(ngroups, gstart, rows, total * id / n);
    *hi = cut(ngroups, gstart, rows, total * (id + 1) / n);
}

void moe_pairs(int64_t t, int64_t ngroups, const int64_t *gstart, const uint8_t *const *gate,
               const uint8_t *const *up, const uint8_t *const *down, const int64_t *tok,
               const float *x, int tg, int tu, int td, int64_t dim, int64_t hidden, int act,
               int8_t *xq, float *xd, int16_t *xb, int8_t *kq, float *kd, int16_t *kb, float *h,
               int8_t *aq, float *ad, int16_t *ab, float *dn, int threads) {
    int64_t rg = row_bytes(tg, dim), ru = row_bytes(tu, dim), rd = row_bytes(td, hidden);
    int64_t p0 = gstart[0], p1 = gstart[ngroups];
    /* gate and up read x in their types' formats: one quantization, or (a Q4_K beside another
     * type) a second one per 256 into kq / kd / kb */
    int two = (tg == Q4_K) != (tu == Q4_K);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < t; i++) {
            quantize_for(two ? (tg == Q4_K ? tu : tg) : tg, x + i * dim, dim, xq + i * dim,
                         xd + i * dim / 32, xb + i * dim / 16);
            if (two)
                quantize_row_k(x + i * dim, dim, kq + i * dim, kd + i * dim / 256, kb + i * dim / 16);
        }
        int nth = 1, id = 0;
#ifdef _OPENMP
        nth = omp_get_num_threads();
        id = omp_get_thread_num();
#endif
        int64_t lo, hi;
        share(ngroups, gstart, 2 * hidden, nth, id, &lo, &hi);
        for (int64_t idx = lo; idx < hi; idx++) {
            int64_t g = idx / (2 * hidden), r = idx % (2 * hidden);
            int64_t rr = r < hidden ? r : r - hidden;
            int type = r < hidden ? tg : tu;
            const uint8_t *w = r < hidden ? gate[g] + rr * rg : up[g] + rr * ru;
            if (rr + PREFETCH_ROWS < hidden)
                prefetch_row(w + PREFETCH_ROWS * (r < hidden ? rg : ru), r < hidden ? rg : ru);
            /* this row's activation format: the shared one, or Q4_K's own beside another type */
            int own = two && type == Q4_K;
            const int8_t *aq8 = own ? kq : xq;
            const float *ad8 = own ? kd : xd;
            const int16_t *ab8 = own ? kb : xb;
            int64_t ds = own ? dim / 256 : dim / 32;
            int64_t p = gstart[g];
#ifdef Q4K_ROWS
            /* decode once, dot up to ROWS_MAX pairs (each pair's sums as alone: the same bits) */
            for (int R; type == Q4_K && (R = rows_left(p, gstart[g + 1])) > 1; p += R) {
                const int8_t *q[ROWS_MAX];
                const float *dd[ROWS_MAX];
                const int16_t *bb[ROWS_MAX];
                float out[ROWS_MAX];
                for (int j = 0; j < R; j++) {
                    int64_t i = tok[p + j];
                    q[j] = aq8 + i * dim, dd[j] = ad8 + i * ds, bb[j] = ab8 + i * dim / 16;
                }
                ROWS_LITERAL(dot_q4_k_rows, w, q, dd, bb, dim / 256, R, out);
                for (int j = 0; j < R; j++) h[(p + j) * 2 * hidden + r] = out[j];
            }
#endif
            for (; p < gstart[g + 1]; p++) {
                int64_t i = tok[p];
                h[p * 2 * hidden + r] = dot(type, w, aq8 + i * dim, ad8 + i * ds,
                                            ab8 + i * dim / 16, dim);
            }
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t p = p0; p < p1; p++) {
            float *gp = h + p * 2 * hidden, *u = gp + hidden;
            for (int64_t r = 0; r < hidden; r++) {
                float v = gp[r];
                float a = act == 0 ? v / (1.f + expf(-v))
                                   : 0.5f * v * (1.f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
                gp[r] = a * u[r];
            }
            quantize_for(td, gp, hidden, aq + p * hidden, ad + p * hidden / 32, ab + p * hidden / 16);
        }
        share(ngroups, gstart, dim, nth, id, &lo, &hi);
        for (int64_t idx = lo; idx < hi; idx++) {
            int64_t g = idx / dim, r = idx % dim;
            const uint8_t *w = down[g] + r * rd;
            if (r + PREFETCH_ROWS < dim) prefetch_row(w + PREFETCH_ROWS * rd, rd);
            int64_t p = gstart[g];
#ifdef Q6K_ROWS
            for (int R; td == Q6_K && (R = rows_left(p, gstart[g + 1])) > 1; p += R) {
                const int8_t *q[ROWS_MAX];  /* assemble once, dot up to ROWS_MAX pairs */
                const float *dd[ROWS_MAX];
                const int16_t *bb[ROWS_MAX];
                float out[ROWS_MAX];
                for (int j = 0; j < R; j++)
                    q[j] = aq + (p + j) * hidden, dd[j] = ad + (p + j) * hidden / 32,
                    bb[j] = ab + (p + j) * hidden / 16;
                ROWS_LITERAL(dot_q6_k_rows, w, q, dd, bb, hidden / 256, R, out);
                for (int j = 0; j < R; j++) dn[(p + j) * dim + r] = out[j];
            }
#endif
            for (; p < gstart[g + 1]; p++)
                dn[p * dim + r] = dot(td, w, aq + p * hidden, ad + p * hidden / 32,
                                      ab + p * hidden / 16, hidden);
        }
    }
}

/* y [t, dim] = sum over choices j (in order) of wts [i, j] * dn [pos[i*kk + j]] (moe_pairs' rows). */
void moe_combine(int64_t t, int64_t kk, const int64_t *pos, const float *wts, const float *dn,
                 int64_t dim, float *y, int threads) {
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t i = 0; i < t; i++) {
        for (int64_t r = 0; r < dim; r++) {
            float acc = 0.f;
            for (int64_t j = 0; j < kk; j++)
                acc += wts[i * kk + j] * dn[pos[i * kk + j] * dim + r];
            y[i * dim + r] = acc;
        }
    }
}

/* The host side of a handshake with a GPU through page-locked flags (engine/split_link.py,
 * kernels/host_flags.py the GPU's side): the GPU's signal is a store it makes after its copies into host memory, so no
 * driver call sits between the GPU's rows and the CPU's share. 0 once *flag == want (acquire:
 * what the GPU wrote before it is visible), -1 after timeout_us. */
int flag_wait(const int32_t *flag, int32_t want, int64_t timeout_us) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (uint32_t i = 1;; i++) {
        if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) == want) return 0;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        __asm__ volatile("yield");
#endif
        if ((i & 4095) == 0) {
            clock_gettime(CLOCK_MONOTONIC, &t1);
            int64_t us = (t1.tv_sec - t0.tv_sec) * 1000000 + (t1.tv_nsec - t0.tv_nsec) / 1000;
            if (us > timeout_us) return -1;
        }
    }
}

/* *flag = v after every earlier store of this thread (release: the CPU's rows before it). */
void flag_set(int32_t *flag, int32_t v) { __atomic_store_n(flag, v, __ATOMIC_RELEASE); }

/* One split layer's CPU share of a decode step (kernels/cpu/split_run.py lays these out once
 * per captured graph, a ctypes Structure of the same fields): its flags, its routing's shape, its
 * experts' blocks (expert e's at gate + e * sg, ...), the page-locked rows / weights / ids the GPU
 * copies out and the sum it copies back, RowsCall's index arrays and a scratch. */
typedef struct {
    const int32_t *gpu_flag;
    int32_t *cpu_flag;
    int64_t t, k, n_expert, dim, hidden, tg, tu, td, act;
    const uint8_t *gate, *up, *down;
    int64_t sg, su, sd;
    const float *x, *w;
    const int64_t *ids;
    float *y;
    const int64_t *gstart, *tok, *pos;
    int8_t *xq, *kq, *aq;
    float *xd, *kd, *ad, *h, *dn;
    int16_t *xb, *kb, *ab;
    double wait_s, cpu_s; /* summed here over the calls */
} split_layer;

#define SPLIT_MAX_PAIRS 256

static double seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* A decode step's CPU shares, layer by layer: wait until the layer's GPU flag holds `seq`,
 * compute (moe_pairs + moe_combine over the pairs in routing order, as RowsCall does), set its
 * CPU flag. -1 when all went; else every CPU flag from the failing layer on is set all the same
 * (the GPU must never wait for a host that gave up) and the answer is the layer's index (its
 * rows never came) or -2 - index (an expert id out of range). No Python between layers. */
int64_t split_run(split_layer *layers, int64_t n, int32_t seq, int64_t timeout_us, int threads) {
    int64_t bad = -1;
    for (int64_t i = 0; i < n && bad == -1; i++) {
        split_layer *L = &layers[i];
        double t0 = seconds();
        if (flag_wait(L->gpu_flag, seq, timeout_us) != 0) {
            bad = i;
            break;
        }
        double t1 = seconds();
        int64_t np = L->t * L->k;
        const uint8_t *ga[SPLIT_MAX_PAIRS], *ua[SPLIT_MAX_PAIRS], *da[SPLIT_MAX_PAIRS];
        for (int64_t p = 0; p < np; p++) {
            int64_t e = L->ids[p];
            if (np > SPLIT_MAX_PAIRS || e < 0 || e >= L->n_expert) {
                bad = -2 - i;
                break;
            }
            ga[p] = L->gate + e * L->sg;
            ua[p] = L->up + e * L->su;
            da[p] = L->down + e * L->sd;
        }
        if (bad != -1) break;
        moe_pairs(L->t, np, L->gstart, ga, ua, da, L->tok, L->x, (int)L->tg, (int)L->tu,
                  (int)L->td, L->dim, L->hidden, (int)L->act, L->xq, L->xd, L->xb, L->kq, L->kd,
                  L->kb, L->h, L->aq, L->ad, L->ab, L->dn, threads);
        moe_combine(L->t, L->k, L->pos, L->w, L->dn, L->dim, L->y, threads);
        flag_set(L->cpu_flag, seq);
        L->wait_s += t1 - t0;
        L->cpu_s += seconds() - t1;
    }
    if (bad != -1) {
        int64_t from = bad >= 0 ? bad : -2 - bad;
        for (int64_t i = from; i < n; i++) flag_set(layers[i].cpu_flag, seq);
    }
    return bad;
}
